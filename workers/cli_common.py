"""What every `nkicache` command shares: exit codes, tier flags, file expansion, summaries."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from cachestore.settings import Settings

# Exit codes: 1 = a check failed or some inputs failed (the command ran); 2 = a project error reported as
# one line (bad kernel, corrupt binary, unreachable fleet, ...); click's usage errors also exit 2; 130 = stopped
# by Ctrl-C (what finished is kept and reported).
EXIT_CHECK_FAILED = 1
EXIT_PROJECT_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
# Every --seed: numpy's generators refuse a negative seed, with a ValueError deep inside a command.
SEED = click.IntRange(min=0)
# Every --workers and --processes: a process per CPU is what helps, and each one holds pipes and file
# descriptors, so 100000 of them fail as "Too many open files" deep inside a pool; no machine has 256 CPUs
# to use here.
MAX_PROCESSES = 256
PROCESS_COUNT = click.IntRange(min=1, max=MAX_PROCESSES)
# Every --timeout: a wait of seconds, bounded as the settings' are (10 years); nan and inf pass a FloatRange
# (every comparison with nan is false) and would wait for ever.
MAX_WAIT_SECONDS = 10 * 365 * 24 * 3600


class _Seconds(click.FloatRange):
    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds


WAIT_SECONDS = _Seconds(min=0, min_open=True, max=MAX_WAIT_SECONDS)
# Every --models: graph files written at once; a million is past any workload and still fits a disk.
MAX_MODELS = 1_000_000
MODEL_COUNT = click.IntRange(min=1, max=MAX_MODELS)


def plural(count: float, word: str) -> str:
    """bridge.port's wording rule, loaded when first used: a command that words no count (`exec`, `--version`)
    does not import the compiler's port."""
    from bridge.port import plural as worded

    return worded(count, word)


# cachestore.settings.TIER_MODES, spelled here so that parsing a command line imports no store code.
TIER_MODES = ("read-through", "mirror", "read-only", "off")


def tier_options(command: Callable) -> Callable:
    """--tier and --tier-mode; both fall back to the settings (config file, NKICACHE_* environment)."""
    command = click.option(
        "--tier-mode",
        type=click.Choice(TIER_MODES),
        default=None,
        help="read-through: ask the tier before tracing (default); mirror: only write to it; read-only: only "
        "read it (no entries, leases, TTL refreshes nor metrics written); off: ignore it.",
    )(command)
    return click.option(
        "--tier",
        multiple=True,
        metavar="URL",
        help="off, local:PATH (default: local:~/.cache/nkicache/tier.sqlite), dir:PATH (a shared directory), "
        "redis://, rediss://, unix:// or redis+cluster://host:port[,host:port]. Repeat it for a stack, nearest "
        "first (--tier local:PATH --tier redis://HOST): reads go down it and fill the levels above. Passwords "
        "belong in $NKICACHE_REDIS_PASSWORD.",
    )(command)


def echo_json(value: Any, *, indent: int | None = None) -> None:
    """Print a command's --json output: valid JSON or a clear error, never NaN or Infinity."""
    from cachestore.json_text import json_text

    click.echo(json_text(value, indent=indent))


def load_cli_settings(**flags: Any) -> Any:
    from cachestore.settings import load_settings

    return load_settings(flags)


def refuse_read_only(settings: Settings, command: str, writes: str) -> None:
    """A command that must write to the tier is refused under tier_mode read-only, instead of writing anyway."""
    if settings.read_only:
        raise click.UsageError(f"`nkicache {command}` {writes}; tier_mode is read-only (a client that never writes)")


def expand(paths: tuple[str, ...], suffix: str) -> list[str]:
    """Files in command-line order; a directory stands for its *suffix files, sorted by name."""
    files: list[str] = []
    for path in paths:
        if Path(path).is_dir():
            files.extend(str(p) for p in sorted(Path(path).glob(f"*{suffix}")) if p.is_file())
        else:
            files.append(path)
    return files


def rates_text(counts: dict) -> str:
    """The two hit rates in words, the shared cache's first: 'shared-cache hit rate 75% (3 of 4 tier lookups),
    in-pass hit rate 40%'; n/a when nothing asked the tier."""
    from bridge.port import HIT_RATE_WORDS, IN_PASS_HIT_RATE, SHARED_HIT_RATE, format_rate, hit_rates

    rates = hit_rates(counts)
    lookups = int(counts.get("tier_lookups", 0))
    shared = (
        f"{format_rate(rates[SHARED_HIT_RATE], 0)} ({int(counts.get('remote_hits', 0))} of {lookups} tier lookups)"
        if lookups
        else "n/a (no tier lookups)"
    )
    return (
        f"{HIT_RATE_WORDS[SHARED_HIT_RATE]} {shared}, "
        f"{HIT_RATE_WORDS[IN_PASS_HIT_RATE]} {format_rate(rates[IN_PASS_HIT_RATE], 0)}"
    )


def saved_text(counts: dict) -> str:
    """Saved time, each cache's apart (bridge.port): 'saved 1.20 s by the shared tier, 0.30 s in-pass'."""
    return (
        f"saved {counts['tier_saved_seconds']:.2f} s by the shared tier, "
        f"{counts['in_pass_saved_seconds']:.2f} s in-pass"
    )


def summary_line(passes: int, failed: int, totals: dict, seconds: float) -> str:
    return (
        f"{plural(passes, 'pass')} ({passes - failed} compiled, {failed} failed): "
        f"{plural(totals['kernels'], 'kernel')}, {plural(totals['cache_hits'], 'in-pass hit')}, "
        f"{plural(totals['remote_hits'], 'remote hit')}, {traces_text(totals)}; {rates_text(totals)}; "
        f"compile time {totals['compile_seconds']:.2f} s, {saved_text(totals)}, wall time {seconds:.2f} s"
        + (
            f"; tier: {plural(totals['tier_errors'], 'error')}, {plural(totals['tier_timeouts'], 'timeout')}, "
            f"{totals['tier_rejected']} rejected, {plural(totals['tier_dropped'], 'write')} dropped"
            if totals["tier_errors"] or totals["tier_timeouts"] or totals["tier_rejected"] or totals["tier_dropped"]
            else ""
        )
    )


class Progress:
    """A progress bar on a terminal, plain lines otherwise (or nothing, for --json)."""

    def __init__(self, total: int, label: str, quiet: bool):
        self.total = total
        self.done = 0
        self.quiet = quiet
        self._bar = None
        if not quiet and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            self._bar = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                transient=True,
            )
            self._task = self._bar.add_task(label, total=total)
            self._bar.start()

    def advance(self, line: str) -> None:
        self.done += 1
        if self._bar is not None:
            # Printed above the bar, and kept when the bar goes: an interactive compile says where each
            # graph's artifact went, as a piped one does.
            from rich.text import Text

            self._bar.console.print(Text(f"[{self.done}/{self.total}] {line}"), soft_wrap=True)
            self._bar.advance(self._task)
        elif not self.quiet:
            click.echo(f"[{self.done}/{self.total}] {line}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _pass_line(result: Any) -> str:
    from bridge.inputs import shown_path  # a file name cannot end the line and forge the next one

    if result.error:
        return f"{shown_path(result.file)}: FAILED"
    c = result.counts
    return (
        f"{shown_path(result.file)} -> {shown_path(result.artifact)}: {result.target}, "
        f"{plural(c['kernels'], 'kernel')}, "
        f"{plural(c['cache_hits'], 'in-pass hit')}, {plural(c['remote_hits'], 'remote hit')}, "
        f"{traces_text(c)}, {result.seconds:.2f} s"
    )


def traces_text(counts: dict) -> str:
    """'N traces', and how many of them trace tasks made for the passes (`compile --workers N`)."""
    parallel = counts.get("parallel_traces", 0)
    traced = plural(counts["traces"], "trace")  # every trace, wherever it ran
    return f"{traced} ({parallel} in parallel)" if parallel else traced


def compile_and_summarize(
    files: list[str],
    *,
    settings: Settings,
    workers: int,
    out_dir: str,
    target_name: str | None,
    as_json: bool,
    print_json: bool = True,
) -> tuple[dict, bool]:
    """Compile with the pool, print per-pass progress and the summary; returns (summary, any failed).
    `print_json=False`: with `as_json`, print nothing (the caller prints one document holding the summary)."""
    from bridge.port import hit_rates
    from cachestore.tier_urls import redact_url
    from workers.passes import add_counts, add_level_hits
    from workers.pool import compile_run

    started = time.perf_counter()
    progress = Progress(len(files), "compiling", quiet=as_json)
    try:
        run = compile_run(
            files,
            settings=settings,
            workers=workers,
            out_dir=out_dir,
            target_name=target_name,
            on_result=lambda r: progress.advance(_pass_line(r)),
        )
    finally:
        progress.close()
    results, interrupted = run.results, run.interrupted
    seconds = time.perf_counter() - started
    failed = [r for r in results if r.error]
    for result in failed:
        click.echo(f"nkicache: error: {result.error}", err=True)
    totals = add_counts(results)
    # Every write that did not reach the tier, the ones the clients dropped as they closed included (with the
    # tier down, all of them): no pass's own figures hold those.
    totals["tier_dropped"] += run.tier_dropped_outside_passes
    for name, count in run.tier_faults_outside_passes.items():
        totals[name] += count
    summary = {
        "passes": len(results),
        "compiled": len(results) - len(failed),
        **totals,
        **hit_rates(totals, digits=4),
        "seconds": seconds,
        "workers": workers,
        "tier": redact_url(settings.tier) if settings.tier_mode != "off" else "off",
        "tier_mode": settings.tier_mode,
        "level_hits": add_level_hits(results),
        "interrupted": interrupted,
        "artifacts": [r.artifact for r in results if r.artifact],
        "failed": [{"file": r.file, "error": r.error} for r in failed],
        "graphs": [r.as_json() for r in results],
    }
    if as_json:
        if print_json:
            echo_json(summary)
    else:
        click.echo(summary_line(len(results), len(failed), totals, seconds))
        if interrupted:
            click.echo(
                f"interrupted: {len(results)} of {plural(len(files), 'graph')} compiled; their artifacts are in "
                f"{out_dir}"
            )
    return summary, bool(failed) or interrupted


def _memory_problem(path: str, artifact: Any, check: bool) -> str | None:
    """Why running `artifact` would not fit in this process's memory, or None (unknown counts as fitting)."""
    import os

    from workers.memory import available_bytes, run_bytes

    needed = run_bytes(artifact, os.path.getsize(path), check)
    available = available_bytes()
    if available is None or needed <= available:
        return None
    gib = 1024**3
    return (
        f"{path}: running graph {artifact.graph!r}{' with --check' if check else ''} needs about "
        f"{needed / gib:.1f} GiB, more than the {max(available, 0) / gib:.1f} GiB of memory available; not run"
    )


def run_one(path: str, seed: int, check: bool) -> dict:
    """Load, sample, execute (and check) one artifact; a project error becomes {'error': one line}."""
    import numpy as np

    from bridge.artifact import load_artifact
    from bridge.errors import NkiCacheError
    from bridge.graph_runner import run_compiled, sample_artifact_inputs

    try:
        artifact = load_artifact(path)
        memory_problem = _memory_problem(path, artifact, check)
        if memory_problem is not None:
            return {"file": path, "error": memory_problem}
        inputs = sample_artifact_inputs(artifact, np.random.default_rng(seed))
        report = run_compiled(artifact, inputs, check=check)
    except NkiCacheError as exc:
        return {"file": path, "error": " ".join(str(exc).split())}
    except MemoryError:  # the estimate fell short: still this artifact's one line, not a traceback
        return {"file": path, "error": f"{path}: ran out of memory running it; not run to the end"}
    return {
        "file": path,
        "graph": report.graph,
        "target": artifact.target,
        "ok": report.ok,
        "seconds": report.seconds,
        "instructions": [item.as_json() for item in report.instructions],
        "outputs": report.output_digests(),
    }


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int | str) -> None:
    """Logging for a command's process (library code never configures it): one line per record on stderr.
    The codegen loop logs every kernel's cache hit or miss at INFO, as the specification has it; on a worker
    that logs one line per job at INFO those would bury the rest, so they show from DEBUG on."""
    import logging

    numeric = level if isinstance(level, int) else logging.getLevelName(level.upper())
    logging.basicConfig(level=numeric, format=LOG_FORMAT, stream=sys.stderr, force=True)
    if numeric > logging.DEBUG:
        logging.getLogger("bridge.codegen").setLevel(max(numeric, logging.WARNING))
