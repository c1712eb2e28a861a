"""`nkicache warm`: before a new compiler takes traffic, trace the variants the old one served most."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from cachestore.tier_urls import is_redis, shared_level
from workers.cli_common import (
    EXIT_CHECK_FAILED,
    PROCESS_COUNT,
    WAIT_SECONDS,
    Progress,
    load_cli_settings,
    plural,
    refuse_read_only,
)

if TYPE_CHECKING:
    from cachestore.settings import Settings


def _since(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    from cachestore.report import parse_since

    if value is None:
        return None
    try:
        return parse_since(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from None


@click.command("warm")
@click.option("--tier", default=None, metavar="URL", help="The tier to warm (default: the configured one).")
@click.option(
    "--from",
    "source",
    default=None,
    metavar="TOOLCHAIN",
    help="Warm from this toolchain's entries (default: the other toolchain used most recently).",
)
@click.option("--top", type=click.IntRange(min=1), default=None, metavar="N", help="Only the N most used variants.")
@click.option(
    "--min-usage", type=click.IntRange(min=0), default=0, metavar="U", help="Only variants used at least U times."
)
@click.option(
    "--since",
    default=None,
    metavar="D",
    callback=_since,
    help="Only variants used since D ago (7d, 12h) or since a date.",
)
@click.option("--workers", type=PROCESS_COUNT, default=2, show_default=True, help="Processes tracing at once.")
@click.option(
    "--fleet", is_flag=True, help="Have the fleet's workers of this compiler trace them (Redis jobs), and wait."
)
@click.option(
    "--per-job", type=click.IntRange(min=1), default=8, show_default=True, help="With --fleet: kernel calls per job."
)
@click.option(
    "--timeout",
    type=WAIT_SECONDS,
    default=None,
    metavar="S",
    help="With --fleet: stop waiting after S seconds (default: the wait_timeout setting).",
)
@click.option("--dry-run", is_flag=True, help="Say what would be traced; trace nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def warm_command(
    tier: str | None,
    source: str | None,
    top: int | None,
    min_usage: int,
    since: float | None,
    workers: int,
    fleet: bool,
    per_job: int,
    timeout: float | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Trace the most used variants of another toolchain (an older compiler) with this one, and store them
    under this compiler's toolchain, so that it starts warm after an upgrade.

    Each kernel call is rebuilt from an entry's key components, traced, and stored, single flight with
    every other process. A variant this compiler already holds is skipped; one that cannot be rebuilt (a
    kernel no longer in the library) is skipped with its reason; one this compiler refuses (over a limit such
    as max_tensor_elements, as a compile would refuse it) is reported as failed. Exit 1 when any failed.

    --fleet traces on the fleet instead of here: the variants to trace become jobs of --per-job kernel calls
    each, under this compiler's toolchain, so only workers of this compiler take them (deploy them before
    switching traffic); their codegen loops hold the single-flight leases. It waits for the jobs (progress
    per job) and counts what they traced; a dead-lettered job is failed with its error. Exit 1 when any job
    failed or did not finish in time.

    --dry-run lists each variant it would trace (key, kernel, target, shapes) and traces nothing; with no other
    toolchain to warm from it says so and exits 0 (a warm exits 2: it was asked to warm and could not).

    --json keys: source, toolchain, considered, to_trace, traced, present, refused (pool traces another compiler
    made, its processes having imported other code: traced here instead), skipped ([{key, reason}]), failed
    ([{key, reason}], with --fleet also [{job, reason}]), seconds, trace_seconds, batch, jobs (with --fleet),
    would_trace ([{key, kernel_name, target, operand_shapes, result_shapes}], with --dry-run), nothing_to_warm
    (with --dry-run: why there is nothing to warm from, else null).
    """
    from bridge.identity import toolchain_id
    from cachestore.stores import open_backend, open_tier
    from workers.warm import WarmError, WarmReport, default_source, pick_variants, warm

    settings = load_cli_settings(tier=tier)
    refuse_read_only(settings, "warm", "stores the entries it traces")
    if settings.tier == "off":
        raise click.UsageError("--tier off has nothing to warm; name a tier")
    if source == toolchain_id():  # its entries are this compiler's already: warming from them traces nothing
        raise WarmError(f"--from {source} is this compiler's own toolchain; name an older compiler's (see `report`)")
    reader = open_backend(settings, reading=True)
    try:
        try:
            source = source or default_source(reader)
        except WarmError as exc:
            if not dry_run:
                raise
            _print_nothing_to_warm(WarmReport(None, toolchain_id(), nothing_to_warm=str(exc)), as_json)
            return
        variants = pick_variants(reader, source, top=top, min_usage=min_usage, since=since)
    finally:
        reader.close()
    if fleet and not is_redis(shared_level(settings.tier)):
        raise click.UsageError("--fleet needs the fleet's Redis tier (--tier redis://...)")
    client = open_tier(settings.replace(tier_mode="read-through", worker="warm"))
    progress = Progress(len(variants), f"warming from {source[:8]}", quiet=as_json)
    try:
        submit = _fleet_submitter(settings) if fleet else None
        report = warm(
            client,
            variants,
            source,
            workers=workers,
            dry_run=dry_run,
            fleet=submit,
            per_job=per_job,
            limits=settings.limits(),
            on_progress=lambda: progress.advance("variant"),
        )
    finally:
        progress.close()
        client.close()
    if report.jobs:
        _wait_for_fleet(settings, report, settings.wait_timeout if timeout is None else timeout, quiet=as_json)
    if as_json:
        click.echo(json.dumps(report.as_json()))
    else:
        verb, traced = (
            ("would warm", f"would trace {report.to_trace}") if dry_run else ("warmed", f"traced {report.traced}")
        )
        click.echo(
            f"{verb} {report.toolchain} from {report.source}: {plural(report.considered, 'variant')}, {traced}, "
            f"{report.present} already present, {len(report.skipped)} skipped, {len(report.failed)} failed "
            f"({report.seconds:.1f} s)"
        )
        for item in report.would_trace:
            click.echo(
                f"  would trace {item['key'][:16]} {item['kernel_name']} {item['target']} "
                f"{_shapes(item['operand_shapes'])} -> {_shapes(item['result_shapes'])}"
            )
        for item in report.skipped + report.failed:
            click.echo(f"  {item.get('key', '')[:16] or item.get('job')}: {item['reason']}", err=True)
    if report.failed:
        sys.exit(EXIT_CHECK_FAILED)


def _print_nothing_to_warm(report: Any, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(report.as_json()))
    else:
        click.echo(f"nothing to warm: {report.nothing_to_warm}")


def _shapes(shapes: list) -> str:
    """[[32, 48], [48]] as '[32,48] [48]', as `inspect ls` shows shapes."""
    return " ".join(json.dumps(shape, separators=(",", ":")) for shape in shapes) or "-"


def _fleet_submitter(settings: Settings) -> Callable[[list[tuple[str, str]]], Any]:
    from cachestore.keys import KeySpace
    from workers.fleet import fleet_client, submit_texts

    def submit(graphs: list[tuple[str, str]]) -> Any:
        client = fleet_client(settings)
        try:
            return submit_texts(client, KeySpace(settings.namespace), graphs, settings.job_ttl, settings.job_shards)
        finally:
            client.close()

    return submit


def _wait_for_fleet(settings: Settings, report: Any, timeout: float, *, quiet: bool) -> None:
    """Wait for the warm jobs; add what they traced to `report`, and each job that failed or did not finish."""
    from cachestore.keys import KeySpace
    from workers.fleet import fleet_client, wait_for

    client = fleet_client(settings)
    progress = Progress(len(report.jobs), "tracing on the fleet", quiet=quiet)

    def finished(done: int) -> None:
        while progress.done < done:
            progress.advance("job finished")

    try:
        waited = wait_for(client, KeySpace(settings.namespace), report.jobs, timeout, finished, settings.job_ttl)
    finally:
        progress.close()
        client.close()
    for job_id in report.jobs:
        result = waited.results.get(job_id)
        if job_id in waited.lost:
            report.failed.append({"job": job_id, "reason": "gone from Redis (it restarted empty or failed over)"})
        elif result is None:
            report.failed.append({"job": job_id, "reason": f"not finished after {timeout:g} s (it stays queued)"})
        elif result.get("status") != "completed":
            report.failed.append({"job": job_id, "reason": result.get("error") or result.get("status", "failed")})
        else:
            # By the job's pass, or by trace tasks for it (workers/trace_tasks.py): each variant once.
            report.traced += int(result.get("traces", 0))  # every trace, the parallel ones included
            report.trace_seconds += float(result.get("compile_seconds", 0.0))
