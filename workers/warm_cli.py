"""`nkicache warm`: before a new compiler takes traffic, trace the variants the old one served most."""

from __future__ import annotations

import json
import sys

import click

from workers.cli_common import EXIT_CHECK_FAILED, Progress, load_cli_settings


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
@click.option("--from", "source", default=None, metavar="TOOLCHAIN",
              help="Warm from this toolchain's entries (default: the other toolchain used most recently).")  # fmt: skip
@click.option("--top", type=click.IntRange(min=1), default=None, metavar="N", help="Only the N most used variants.")
@click.option("--min-usage", type=click.IntRange(min=0), default=0, metavar="U",
              help="Only variants used at least U times.")  # fmt: skip
@click.option("--since", default=None, metavar="D", callback=_since,
              help="Only variants used since D ago (7d, 12h) or since a date.")  # fmt: skip
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Processes tracing at once.")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Say what would be traced; trace nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def warm_command(tier: str | None, source: str | None, top: int | None, min_usage: int, since: float | None,
                 workers: int, dry_run: bool, as_json: bool) -> None:  # fmt: skip
    """Trace the most used variants of another toolchain (an older compiler) with this one, and store them
    under this compiler's toolchain, so that it starts warm after an upgrade.

    Each kernel call is rebuilt from an entry's key components, traced, and stored, single flight with
    every other process. A variant this compiler already holds is skipped; one that cannot be rebuilt (a
    kernel no longer in the library) is skipped with its reason; one this compiler refuses is reported as
    failed. Exit 1 when any failed.

    --json keys: source, toolchain, considered, to_trace, traced, present, skipped ([{key, reason}]), failed
    ([{key, reason}]), seconds, trace_seconds.
    """
    from cachestore.api import open_backend
    from cachestore.client import open_tier
    from workers.warm import default_source, pick_variants, warm

    settings = load_cli_settings(tier=tier)
    if settings.tier == "off":
        raise click.UsageError("--tier off has nothing to warm; name a tier")
    reader = open_backend(settings, reading=True)
    try:
        source = source or default_source(reader)
        variants = pick_variants(reader, source, top=top, min_usage=min_usage, since=since)
    finally:
        reader.close()
    client = open_tier(settings.replace(tier_mode="read-through", worker="warm"))
    progress = Progress(len(variants), f"warming from {source[:8]}", quiet=as_json)
    try:
        report = warm(client, variants, source, workers=workers, dry_run=dry_run,
                      on_progress=lambda: progress.advance("variant"))  # fmt: skip
    finally:
        progress.close()
        client.close()
    if as_json:
        click.echo(json.dumps(report.as_json()))
    else:
        traced = f"would trace {report.to_trace}" if dry_run else f"traced {report.traced}"
        click.echo(f"warmed {report.toolchain} from {report.source}: {report.considered} variants, {traced}, "
                   f"{report.present} already present, {len(report.skipped)} skipped, {len(report.failed)} failed "
                   f"({report.seconds:.1f} s)")  # fmt: skip
        for item in report.skipped + report.failed:
            click.echo(f"  {item['key'][:16]}: {item['reason']}", err=True)
    if report.failed:
        sys.exit(EXIT_CHECK_FAILED)
