"""`nkicache report`, `nkicache serve-metrics` and `nkicache inspect ...`: reading a tier (or a snapshot)."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from workers.cli_common import (
    EXIT_CHECK_FAILED,
    PROCESS_COUNT,
    SEED,
    echo_json,
    load_cli_settings,
    plural,
    refuse_read_only,
)

if TYPE_CHECKING:
    from cachestore.api import Reader
    from cachestore.settings import Settings

TIER_HELP = (
    "local:PATH (default: local:~/.cache/nkicache/tier.sqlite), dir:PATH, redis://, rediss://, unix:// or "
    "redis+cluster://host:port[,host:port]; the key namespace comes from $NKICACHE_NAMESPACE or the config file."
)


def _settings(tier: str | None) -> Any:
    settings = load_cli_settings(tier=tier)
    if settings.tier == "off":
        raise click.UsageError("--tier off has nothing to read; name a tier")
    return settings


def _parsed(parse: Callable[[str], Any], flag: str) -> Callable:
    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=flag) from None

    return convert


def _since(value: str) -> float:
    from cachestore.report import parse_since

    return parse_since(value)


def _duration(value: str) -> float:
    from cachestore.report import parse_duration

    return parse_duration(value)


def _size(value: str) -> int:
    from cachestore.report import parse_size

    return parse_size(value)


# -- report ---------------------------------------------------------------------------------------
@click.command("report")
@click.option("--tier", default=None, metavar="URL", help=TIER_HELP)
@click.option(
    "--since",
    default=None,
    metavar="T",
    callback=_parsed(_since, "--since"),
    help="Only passes since T in the timeline: 2h / 7d (ago), Unix seconds or 2024-05-01T12:00.",
)
@click.option("--top", type=click.IntRange(min=0), default=10, show_default=True, help="Top variants listed.")
@click.option(
    "--bucket",
    default=None,
    metavar="D",
    callback=_parsed(_duration, "--bucket"),
    help="Timeline bucket width (5m, 1h, 1d). Default: chosen to give at most 48 buckets.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--prometheus", is_flag=True, help="Print the Prometheus text exposition format (textfile collector).")
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Write a self-contained HTML page with plots to FILE (needs the html extra: pip install 'nkicache[html]').",
)
@click.option(
    "--zero",
    is_flag=True,
    help="Zero the fleet counters (as sccache -z / ccache -z) instead of reporting; the pass log records "
    "when and by whom. Entries, key usage and per-kernel counts are kept.",
)
def report_command(
    tier: str | None,
    since: float | None,
    top: int,
    bucket: float | None,
    as_json: bool,
    prometheus: bool,
    html_file: str | None,
    zero: bool,
) -> None:
    """Fleet-wide hit rates and compile time from the tier's metrics: totals, per host and worker, per
    toolchain, per kernel (call_count and variants, as the specification's _export_new_nki_fe_metrics), the most used
    variants with their shapes, and the hit rates over time from the pass log.

    --zero zeroes the counters instead (as sccache -z): totals, per host and worker and per toolchain start
    again from 0, and the pass log keeps a record of it, which the report's timeline shows ("zeroed" in
    --json: [{when, host, worker}]). Entries, key usage (which gc and warm rank by) and per-kernel counts
    are kept.

    Two hit rates, from summed counts: the shared-cache hit rate (remote_hits / tier_lookups, the headline;
    n/a, null in JSON, when nothing asked the tier) and the in-pass hit rate (the specification's
    cache_hits / kernels). Totals cover every pass; --since limits the timeline.

    --json keys: tier, generated, since, totals (passes, kernels, cache_hits, cache_misses, remote_hits,
    tier_lookups, traces, compile_seconds, tier_saved_seconds,
    in_pass_saved_seconds, lease_waits, tier_errors, tier_timeouts,
    tier_rejected, tier_dropped, shared_hit_rate, in_pass_hit_rate, as `nkicache compile --json`), per_host
    ({host: {totals, workers: {worker: {...}}}}), per_toolchain ({toolchain id: {...the same counters}}: the
    passes of each compiler, so an upgrade's cold start shows as such), per_kernel ({name: {call_count,
    variants}}), variants, kernel_types, top_variants, bucket_seconds, timeline ([{start, end, passes,
    kernels, cache_hits, cache_misses, tier_lookups, remote_hits, traces, shared_hit_rate,
    in_pass_hit_rate}]), window (the timeline's summed counts), zeroed, coverage ({toolchain: {other
    toolchain: {variants, covered_variants, usage, covered_usage, share}}}: how much of each other toolchain's
    stored variants, weighted by fleet usage, a toolchain holds too; while upgrading, switch traffic when the
    new compiler's share of the old one is near 1).
    """
    from cachestore.report import build_report
    from cachestore.report_render import render_html, render_json, render_prometheus, render_text, require_matplotlib

    if as_json and prometheus:
        raise click.UsageError("--json and --prometheus are two different outputs; choose one")
    if zero:
        if prometheus or html_file:
            raise click.UsageError("--zero prints what it zeroed (or --json); it makes no report")
        settings = _settings(tier)
        refuse_read_only(settings, "report --zero", "zeroes the fleet counters")
        _zero(settings, as_json)
        return
    if html_file:
        require_matplotlib()  # before reading the tier, which can take a while, only to fail at the end
    with _report_reader(_settings(tier)) as reader:
        report = build_report(
            reader, since=since, top=top, bucket_seconds=int(bucket) if bucket else None, timeline=not prometheus
        )
    if html_file:
        _write_atomically(Path(html_file), render_html(report))
    if as_json:
        click.echo(render_json(report))
    elif prometheus:
        click.echo(render_prometheus(report), nl=False)
    elif html_file:
        click.echo(f"wrote {html_file}")
    else:
        click.echo(render_text(report, width=_terminal_width(), ascii_only=not sys.stdout.isatty()), nl=False)


def _zero(settings: Settings, as_json: bool) -> None:
    """`report --zero`: the fleet counters start again from 0; the pass log keeps a record of it (and of the
    counters it zeroed), so the report's history shows when the counts were reset and by whom."""
    from cachestore.report import counters, zero_record
    from cachestore.stores import open_backend

    reader = open_backend(settings, reading=True)
    try:
        previous = counters(reader.totals())
        record = zero_record(settings.host, settings.worker, previous)
        reader.zero_counters(record)
    finally:
        reader.close()
    if as_json:
        echo_json({"zeroed": True, "tier": reader.description, "when": record["finished"], "previous": previous})
    else:
        click.echo(
            f"zeroed the fleet counters of {reader.description} (they held "
            f"{plural(previous['passes'], 'pass')}, {plural(previous['kernels'], 'kernel')}); the pass log "
            "records it"
        )


@contextlib.contextmanager
def _report_reader(settings: Settings) -> Iterator[Reader]:
    """The tier to report on. A local tier that does not exist yet (a fresh machine: nothing compiled) reports
    zeros, as sccache -s does, instead of an error; reading still never creates it where it was named: an empty
    one is made in a temporary folder and read instead."""
    import tempfile

    from cachestore.backends.sqlite import SqliteBackend
    from cachestore.stores import open_backend
    from cachestore.tier_urls import LOCAL, scheme_of, shared_level, tier_path

    url = shared_level(settings.tier)  # what open_backend opens
    path = Path(tier_path(url)).expanduser() if scheme_of(url) == LOCAL else None
    if path is None or path.exists():
        reader = open_backend(settings, reading=True)
        try:
            yield reader
        finally:
            reader.close()
        return
    with tempfile.TemporaryDirectory(prefix="nkicache-empty-") as folder:
        reader = SqliteBackend(Path(folder) / "tier.sqlite")
        reader.description = f"local:{path} (not created yet: nothing compiled with it)"
        try:
            yield reader
        finally:
            reader.close()


def _terminal_width() -> int | None:
    import shutil

    return max(100, shutil.get_terminal_size((140, 40)).columns) if sys.stdout.isatty() else None


def _write_atomically(path: Path, text: str) -> None:
    from bridge.errors import NkiCacheError

    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
    except OSError as exc:
        with contextlib.suppress(OSError):  # under a path that is no folder, unlinking fails too
            partial.unlink(missing_ok=True)
        raise NkiCacheError(f"cannot write {path}: {exc.strerror or exc}") from None


# -- serve-metrics --------------------------------------------------------------------------------
@click.command("serve-metrics")
@click.option("--tier", default=None, metavar="URL", help=TIER_HELP)
@click.option("--port", type=click.IntRange(0, 65535), required=True, help="Port of the /metrics endpoint.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 for all).")
def serve_metrics_command(tier: str | None, port: int, host: str) -> None:
    """Serve the report's Prometheus metrics at http://HOST:PORT/metrics, read from the tier on every
    scrape (totals, per worker, per kernel). A tier that cannot be read gives nkicache_tier_up 0."""
    from prometheus_client import start_http_server

    from bridge.errors import NkiCacheError
    from cachestore.report import build_report
    from cachestore.report_render import prometheus_registry
    from cachestore.stores import open_backend
    from cachestore.tier_urls import redact_url

    settings = _settings(tier)

    def build() -> Any:
        reader = open_backend(settings, reading=True)  # one per scrape: scrapes run on the server's threads
        try:
            return build_report(reader, top=0, timeline=False, coverage=False)
        finally:
            reader.close()

    try:
        server, _thread = start_http_server(port, addr=host, registry=prometheus_registry(build))
    except OSError as exc:
        raise NkiCacheError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    click.echo(f"serving http://{host}:{server.server_port}/metrics for {redact_url(settings.tier)}", err=True)
    _wait_for_signal()
    server.shutdown()
    server.server_close()


def _wait_for_signal() -> None:
    import signal

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    with contextlib.suppress(KeyboardInterrupt):
        while not stop:
            time.sleep(0.2)


# -- inspect --------------------------------------------------------------------------------------
def source_options(command: Callable) -> Callable:
    command = click.option(
        "--snapshot",
        type=click.Path(dir_okay=False),
        default=None,
        metavar="FILE",
        help="Read a snapshot file (from `inspect export`) instead of a tier.",
    )(command)
    return click.option("--tier", default=None, metavar="URL", help=TIER_HELP)(command)


@contextlib.contextmanager
def _source(
    ctx: click.Context, tier: str | None, snapshot: str | None, writable: bool = False, create: bool = False
) -> Iterator[Any]:
    """The reader for a command: its own --tier/--snapshot, else the group's, else the configured tier.
    `create`: a local tier that does not exist yet is made (import into a new file), not an error."""
    from cachestore.backends.snapshot import SnapshotReader
    from cachestore.stores import open_backend

    group = ctx.find_object(dict) or {}
    tier = tier or group.get("tier")
    snapshot = snapshot or group.get("snapshot")
    toolchain = group.get("toolchain")  # --toolchain: its id names its trusted partition, where the reader looks
    if tier and snapshot:
        raise click.UsageError("--tier and --snapshot name two sources; give one")
    if snapshot:
        if writable:
            raise click.UsageError("a snapshot is read-only; name a --tier")
        reader = SnapshotReader(snapshot, toolchain)
    else:
        reader = open_backend(_settings(tier), reading=not create, partition=toolchain)
    try:
        yield reader
    finally:
        reader.close()


def _policy(tier: str | None = None, trusting: bool = False) -> Any:
    """The configured signature policy; `trusting`: with the trust policy too (verify and show, which look at
    one partition; gc and import, which go over every scope, would refuse every untrusted scope's entries)."""
    from cachestore.credentials import settings_credentials
    from cachestore.entry import SignaturePolicy

    settings = load_cli_settings(tier=tier)
    trust = settings_credentials(settings, writes=False).trust if trusting else None
    return SignaturePolicy(settings.hmac_key, settings.require_signed, settings.reject_unverifiable, trust), settings


@click.group("inspect")
@source_options
@click.option(
    "--toolchain",
    default=None,
    metavar="ID",
    help="The toolchain whose entries show, verify and explain look at (default: this compiler's, "
    "see nkicache --version). ls, du, export, import and gc cover every toolchain.",
)
@click.pass_context
def inspect_group(ctx: click.Context, tier: str | None, snapshot: str | None, toolchain: str | None) -> None:
    """Look inside a tier, or a snapshot of one: list, show, disk usage, verify, explain a miss, export,
    import, garbage-collect. Read-only except import and gc (which never touch the metrics).

    A tier keeps each toolchain's entries apart (a compiler change makes a new toolchain id).
    --tier/--snapshot may be given here or after the subcommand."""
    ctx.obj = {"tier": tier, "snapshot": snapshot, "toolchain": toolchain}


def _short(value: Any) -> str:
    if value is None:
        return "-"
    return " ".join("[" + ",".join(str(d) for d in shape) + "]" for shape in value) or "-"


def _when(value: float | None) -> str:
    from cachestore.report_render import when

    return when(value)


@inspect_group.command("ls")
@click.option("--kernel", default=None, metavar="NAME", help="Only entries of this kernel_name.")
@click.option("--target", default=None, metavar="T", help="Only entries compiled for this target (Trn1, Trn2).")
@click.option("--failed", is_flag=True, help="Only the kernels that failed to compile (negative entries).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of entries.")
@source_options
@click.pass_context
def ls_command(
    ctx: click.Context,
    kernel: str | None,
    target: str | None,
    failed: bool,
    as_json: bool,
    tier: str | None,
    snapshot: str | None,
) -> None:
    """List entries: key, kernel, target, operand and result shapes, stored bytes, usage, last use.

    A kernel that failed to compile is kept as a negative entry (format "failed"): every pass that meets it
    within failure_ttl of when it was recorded fails at once with its message; --failed lists only those, with
    the message and when it was recorded (`compile --retry-failed` traces them again).

    --json: [{key, toolchain, kernel_name, target, num_neuroncores, operand_shapes, operand_dtypes, result_shapes,
    result_dtypes, attrs, format, bytes, binary_bytes, usage, last_use, producer, writer, created, ttl, failure,
    error}] (writer: the key id in the entry's header, "" for none; failure: the message of a negative entry).
    """
    from cachestore.inspect import list_entries
    from cachestore.json_text import json_text

    with _source(ctx, tier, snapshot) as reader:
        rows = list_entries(reader, kernel=kernel, target=target, failed=failed)
        if as_json:
            click.echo("[", nl=False)
            for i, row in enumerate(rows):
                click.echo(("," if i else "") + "\n" + json_text(row), nl=False)
            click.echo("\n]")
            return
        count = 0
        for row in rows:
            count += 1
            if row["error"]:
                click.echo(
                    f"{row['key'][:16]}  {row['toolchain'][:8]}  UNREADABLE ({row['error']}), {row['bytes']} bytes"
                )
                continue
            if row["failure"] is not None:
                click.echo(
                    f"{row['key'][:16]}  {row['toolchain'][:8]}  {row['kernel_name']:<32} {row['target']:<5} "
                    f"FAILED ({row['failure']}), recorded {_when(row['created'])}"
                )
                continue
            dtypes = ",".join(sorted(set(row["operand_dtypes"] + row["result_dtypes"])))
            click.echo(
                f"{row['key'][:16]}  {row['toolchain'][:8]}  {row['kernel_name']:<32} {row['target']:<5} "
                f"{_short(row['operand_shapes'])} -> {_short(row['result_shapes'])} {dtypes}  "
                f"{row['bytes']} B ({row['binary_bytes']} B binary)  usage {row['usage']}  "
                f"last {_when(row['last_use'])}  "
                f"writer {row['writer'][:8] or '-'}"
            )
        click.echo(plural(count, "entry"), err=True)


@inspect_group.command("show")
@click.argument("key")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@source_options
@click.pass_context
def show_command(ctx: click.Context, key: str, as_json: bool, tier: str | None, snapshot: str | None) -> None:
    """Everything about one entry (KEY or a unique prefix of it): key components, sizes, producer, usage,
    hosts, first and last use, and whether it verifies with the configured signature policy."""
    from cachestore.inspect import show_entry

    policy, _ = _policy(tier, trusting=True)
    with _source(ctx, tier, snapshot) as reader:
        shown = show_entry(reader, key, policy)
    if as_json:
        echo_json(shown, indent=2)
        return
    for name, value in shown.items():
        if name == "key_components":
            click.echo("key_components:")
            for part, item in value.items():
                click.echo(f"  {part}: {json.dumps(item)}")
        elif name in ("first_use", "last_use", "created"):
            click.echo(f"{name}: {_when(value)}" + (f" ({value:.3f})" if value else ""))
        else:
            click.echo(f"{name}: {_as_read(value)}")


def _as_read(value: Any) -> str:
    """A field of `inspect show` as a person reads it, not as Python spells it (None, True, [])."""
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


# verify and du read the entries of a Redis tier in this many processes (cachestore.scan_split)
PROCESSES = click.option(
    "--processes",
    type=PROCESS_COUNT,
    default=None,
    metavar="N",
    help="Processes reading a Redis tier's entries. Default: one a CPU, at most 4.",
)


@inspect_group.command("du")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@PROCESSES
@source_options
@click.pass_context
def du_command(
    ctx: click.Context, as_json: bool, processes: int | None, tier: str | None, snapshot: str | None
) -> None:
    """Storage by kernel: entries, bytes stored, binary bytes.

    --json keys: kernels ({name: {entries, bytes, binary_bytes}}), toolchains ({id: {entries, bytes}}), writers
    ({key id, "" for none: {entries, bytes}}), total (the same summed), unreadable ({entries, bytes}), capacity
    ({file_bytes, max_size} of a local tier, else null).
    """
    from rich.console import Console
    from rich.table import Table

    from bridge.identity import toolchain_id
    from cachestore.inspect import disk_usage

    with _source(ctx, tier, snapshot) as reader:
        usage = disk_usage(reader, processes=processes)
    if as_json:
        echo_json(usage, indent=2)
        return
    from rich import box

    # Box drawing on a terminal; ASCII when piped or redirected, where it may reach a file or another program.
    table = Table(
        title="Storage by kernel", title_justify="left", box=box.HEAVY_HEAD if sys.stdout.isatty() else box.ASCII
    )
    columns = ("entries", "bytes", "binary_bytes")
    table.add_column("kernel")
    for column in columns:
        table.add_column(column.replace("_", " "), justify="right")
    for name, row in usage["kernels"].items():
        table.add_row(name, *(f"{row[c]:,}" for c in columns))
    table.add_row("(total)", *(f"{usage['total'][c]:,}" for c in columns), style="bold")
    console = Console(width=140, force_terminal=False, color_system=None)
    console.print(table)
    for toolchain, row in usage["toolchains"].items():
        mine = " (this compiler)" if toolchain == toolchain_id() else ""
        console.print(f"toolchain {toolchain}{mine}: {plural(row['entries'], 'entry')}, {plural(row['bytes'], 'byte')}")
    for writer, row in usage["writers"].items():
        console.print(f"writer {writer or '(none)'}: {plural(row['entries'], 'entry')}, {plural(row['bytes'], 'byte')}")
    console.print(f"{usage['unreadable']['entries']:,} unreadable entries ({usage['unreadable']['bytes']:,} bytes)")
    capacity = usage["capacity"]
    if capacity is not None and capacity["max_size"]:
        share = capacity["file_bytes"] / capacity["max_size"]
        console.print(
            f"file: {capacity['file_bytes']:,} bytes of max_size {capacity['max_size']:,} bytes ({share:.0%})"
        )


@inspect_group.command("verify")
@click.option(
    "--recompile",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Also re-trace N sampled entries from their key components and compare the bytes.",
)
@click.option(
    "--execute",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Also run N sampled entries on random inputs against the numpy references.",
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the sample and of the inputs.")
@click.option("--json", "as_json", is_flag=True, help="Print {checked, ok, bad: [{key, reason}], ...}.")
@PROCESSES
@source_options
@click.pass_context
def verify_command(
    ctx: click.Context,
    recompile: int,
    execute: int,
    seed: int,
    as_json: bool,
    processes: int | None,
    tier: str | None,
    snapshot: str | None,
) -> None:
    """Check every entry: it decodes with the configured signature policy (schema, digest of the binary,
    HMAC when a key is set, a trusted writer's signature when trust_policy is set), its key components hash
    to its key. Exit 1 when any entry is bad.

    --json keys: checked, ok, bad ([{key, reason}]), recompiled, executed.
    """
    from workers.verify import verify_entries

    policy, settings = _policy(tier, trusting=True)
    with _source(ctx, tier, snapshot) as reader:
        report = verify_entries(
            reader,
            policy,
            max_bytes=settings.max_entry_bytes,
            recompile=recompile,
            execute=execute,
            seed=seed,
            processes=processes,
        )
    if as_json:
        echo_json(report.as_json())
    else:
        extra = "".join(
            f", {n} {what}" for n, what in ((report.recompiled, "recompiled"), (report.executed, "executed")) if n
        )
        click.echo(
            f"checked {plural(report.checked, 'entry')}{extra}: {report.ok} ok, {plural(len(report.bad), 'problem')}"
        )
        for item in report.bad:
            click.echo(f"  {item['key']}: {item['reason']}")
    if report.bad:
        sys.exit(EXIT_CHECK_FAILED)


@inspect_group.command("explain")
@click.argument("components", required=False, metavar="[COMPONENTS]")
@click.option(
    "--graph",
    "graph_file",
    type=click.Path(dir_okay=False),
    default=None,
    metavar="FILE",
    help="Take the key components of an op of this graph file.",
)
@click.option("--op", "op_index", type=click.IntRange(min=0), default=None, metavar="N", help="With --graph.")
@click.option(
    "--target",
    "target_name",
    type=click.Choice(["Trn1", "Trn2"]),
    default=None,
    help="Target to key for. Default: the graph's, the components', else $NKICACHE_TARGET/Trn2.",
)
@click.option("--top", type=click.IntRange(min=1), default=5, show_default=True, help="Nearest variants shown.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@source_options
@click.pass_context
def explain_command(
    ctx: click.Context,
    components: str | None,
    graph_file: str | None,
    op_index: int | None,
    target_name: str | None,
    top: int,
    as_json: bool,
    tier: str | None,
    snapshot: str | None,
) -> None:
    """Why did a kernel miss? Given key components (JSON text, a JSON file, or - for stdin), or an op of a
    graph file (--graph FILE --op N), say whether the tier holds that variant and list the nearest
    variants it does hold, with the components that differ.

    COMPONENTS as the codegen loop builds them: {"kernel_name": "softmax", "operands": {"shapes":
    [[64, 48]], "dtypes": ["float32"]}, "results": {...}, "attrs": {...}}; target and num_neuroncores are
    filled in from --target when missing.

    --json keys: key, present, components, nearest ([{key, distance, usage, differs: [{component, wanted,
    existing}]}]).
    """
    from bridge.codegen import cache_key_of_stored
    from cachestore.inspect import explain
    from workers.verify import components_for, components_of_graph_op

    if (graph_file is None) == (components is None):
        raise click.UsageError("give either COMPONENTS or --graph FILE --op N")
    if graph_file is not None:
        if op_index is None:
            raise click.UsageError("--graph needs --op N (the op's index in the graph file)")
        wanted = components_of_graph_op(graph_file, op_index, target_name)
    else:
        wanted = components_for(_load_components(components), target_name)
    with _source(ctx, tier, snapshot) as reader:
        answer = explain(reader, wanted, cache_key_of_stored, top=top)
    if as_json:
        echo_json(answer, indent=2)
        return
    verdict = "the tier holds this variant: a lookup hits" if answer["present"] else "not in the tier: a lookup misses"
    click.echo(f"key {answer['key']}: {verdict}")
    if not answer["nearest"]:
        click.echo("the tier holds no variants")
    for near in answer["nearest"]:
        if near["distance"] == 0:
            continue
        click.echo(f"  {near['key'][:16]} (usage {near['usage']}, distance {near['distance']}) differs in:")
        for diff in near["differs"]:
            click.echo(
                f"    {diff['component']}: wanted {json.dumps(diff['wanted'])}, stored {json.dumps(diff['existing'])}"
            )


def _load_components(text: str) -> dict:
    source = "COMPONENTS"
    data: str | bytes = text
    if text == "-":
        data, source = sys.stdin.buffer.read(), "stdin"
    elif not text.lstrip().startswith("{"):
        try:
            source, data = text, Path(text).read_bytes()
        except OSError as exc:
            raise click.BadParameter(f"cannot read {text}: {exc.strerror or exc}", param_hint="COMPONENTS") from None
    try:
        # Bytes, decoded by json itself: a file that is not UTF-8 is bad JSON, not a UnicodeDecodeError traceback.
        value = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"{source} is not valid JSON: {exc}", param_hint="COMPONENTS") from None
    if not isinstance(value, dict):
        raise click.BadParameter(f"{source} must be a JSON object of key components", param_hint="COMPONENTS")
    return value


@inspect_group.command("export")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print {exported, file}.")
@source_options
@click.pass_context
def export_command(ctx: click.Context, file: str, as_json: bool, tier: str | None, snapshot: str | None) -> None:
    """Write every entry (still encoded, signatures kept) and its usage to a msgpack snapshot FILE."""
    from cachestore.backends.snapshot import write_snapshot

    with _source(ctx, tier, snapshot) as reader:
        count = write_snapshot(reader, file)
    if as_json:
        echo_json({"exported": count, "file": file})
    else:
        click.echo(f"exported {plural(count, 'entry')} to {file}")


@inspect_group.command("import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print {imported, rejected: [{key, reason}]}.")
@click.option("--tier", default=None, metavar="URL", help=TIER_HELP)
@click.pass_context
def import_command(ctx: click.Context, file: str, as_json: bool, tier: str | None) -> None:
    """Write a snapshot's entries into the tier, verifying each first (signature policy, digest, key);
    entries that fail are reported and skipped (exit 1). Metrics are not imported. A local tier that does not
    exist yet is created."""
    from bridge.codegen import cache_key_of_stored
    from cachestore.backends.snapshot import SnapshotReader
    from cachestore.inspect import import_snapshot

    policy, settings = _policy(tier)
    refuse_read_only(settings, "inspect import", "writes entries")
    snapshot = SnapshotReader(file)
    with _source(ctx, tier, None, writable=True, create=True) as target:
        result = import_snapshot(
            snapshot,
            target,
            policy,
            cache_key_of_stored,
            default_ttl=settings.entry_ttl,
            max_bytes=settings.max_entry_bytes,
        )
    if as_json:
        echo_json(result)
    else:
        click.echo(f"imported {plural(result['imported'], 'entry')}, rejected {len(result['rejected'])}")
        for item in result["rejected"]:
            click.echo(f"  {item['key']}: {item['reason']}")
    if result["rejected"]:
        sys.exit(EXIT_CHECK_FAILED)


def _writer_id(value: str | None) -> str | None:
    """A --writer key id: 32 hex digits (`nkicache keygen` prints it)."""
    if value is None:
        return None
    if len(value) != 32 or any(c not in "0123456789abcdef" for c in value.lower()):
        raise click.BadParameter(f"{value!r} is not a writer key id (32 hex digits)", param_hint="--writer")
    return value.lower()


@inspect_group.command("gc")
@click.option("--dry-run", is_flag=True, help="Say what would be evicted; delete nothing.")
@click.option(
    "--max-bytes",
    default=None,
    metavar="B",
    callback=_parsed(_size, "--max-bytes"),
    help="Evict the least valuable entries until the rest take at most B bytes (500M, 2GiB).",
)
@click.option(
    "--unused-for",
    default=None,
    metavar="D",
    callback=_parsed(_duration, "--unused-for"),
    help="Evict entries not used for D (12h, 30d).",
)
@click.option(
    "--other-toolchains",
    is_flag=True,
    help="Evict every entry of a toolchain other than this compiler's (after an upgrade).",
)
@click.option(
    "--writer",
    default=None,
    metavar="KEYID",
    help="Evict every entry signed by this writer key id, in every toolchain and scope.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--tier", default=None, metavar="URL", help=TIER_HELP)
@click.pass_context
def gc_command(
    ctx: click.Context,
    dry_run: bool,
    max_bytes: int | None,
    unused_for: float | None,
    other_toolchains: bool,
    writer: str | None,
    as_json: bool,
    tier: str | None,
) -> None:
    """Evict entries of every toolchain, never metrics: always the unreadable ones (old builds' dedupe
    references among them); with --other-toolchains, every toolchain's but this compiler's; with --writer
    KEYID, everything that writer signed (in every scope: `nkicache trust distrust` first); with
    --unused-for, those not used for that long; with --max-bytes, the lowest-value entries (usage x compile
    seconds per stored byte) until the rest fit.

    --dry-run lists each entry it would evict (key, toolchain, bytes, reason), one a line.

    --json keys: dry_run, entries, bytes, evicted, evicted_bytes, reasons, kept, kept_bytes,
    expired_purged, keys, evictions ([{key, toolchain, bytes, reason}]), evicted_by_toolchain.
    """
    from bridge.identity import toolchain_id
    from cachestore.inspect import collect_garbage

    policy, settings = _policy(tier)
    if not dry_run:
        refuse_read_only(settings, "inspect gc", "deletes entries (--dry-run only looks)")
    with _source(ctx, tier, None, writable=True) as reader:
        result = collect_garbage(
            reader,
            policy,
            max_bytes=max_bytes,
            unused_for=unused_for,
            dry_run=dry_run,
            only_toolchain=toolchain_id() if other_toolchains else None,
            writer=_writer_id(writer),
        )
    if as_json:
        echo_json(result)
        return
    verb = "would evict" if dry_run else "evicted"
    reasons = ", ".join(f"{n} {reason}" for reason, n in result["reasons"].items()) or "nothing to evict"
    click.echo(
        f"{plural(result['entries'], 'entry')} ({plural(result['bytes'], 'byte')}): {verb} {result['evicted']} "
        f"({result['evicted_bytes']:,} bytes: {reasons}); {result['kept']} kept "
        f"({result['kept_bytes']:,} bytes)"
    )
    if dry_run:
        for item in result["evictions"]:
            click.echo(
                f"  would evict {item['key'][:16]} {item['toolchain'][:8]} {plural(item['bytes'], 'byte')}: "
                f"{item['reason']}"
            )
    if result["expired_purged"]:
        click.echo(f"{'would purge' if dry_run else 'purged'} {plural(result['expired_purged'], 'expired entry')}")
