"""What every `nkicache` command shares: exit codes, tier flags, file expansion, summaries."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

# Exit codes: 1 = a check failed or some inputs failed (the command ran); 2 = a project error reported as
# one line (bad kernel, corrupt binary, unreachable fleet, ...); click's usage errors also exit 2.
EXIT_CHECK_FAILED = 1
EXIT_PROJECT_ERROR = 2


def tier_options(command: Callable) -> Callable:
    """--tier and --tier-mode; both fall back to the settings (config file, NKICACHE_* environment)."""
    command = click.option(
        "--tier-mode",
        type=click.Choice(["read-through", "mirror", "off"]),
        default=None,
        help="read-through: ask the tier before tracing (default); mirror: only write to it; off: ignore it.",
    )(command)
    return click.option(
        "--tier",
        default=None,
        metavar="URL",
        help="off, local:PATH (default: local:~/.cache/nkicache/tier.sqlite), redis://, rediss://, unix:// or "
        "redis+cluster://host:port[,host:port]. Passwords belong in $NKICACHE_REDIS_PASSWORD, not here.",
    )(command)


def load_cli_settings(**flags: Any) -> Any:
    from cachestore.settings import load_settings

    return load_settings(flags)


def expand(paths: tuple[str, ...], suffix: str) -> list[str]:
    """Files in command-line order; a directory stands for its *suffix files, sorted by name."""
    files: list[str] = []
    for path in paths:
        if Path(path).is_dir():
            files.extend(str(p) for p in sorted(Path(path).glob(f"*{suffix}")) if p.is_file())
        else:
            files.append(path)
    return files


def plural(count: float, word: str) -> str:
    count = int(count)
    return f"{count} {word}{'' if count == 1 else 'es' if word.endswith('s') else 's'}"


def hit_rate(totals: dict) -> float:
    """Local and remote hits over kernels, from summed counts (never an average of rates)."""
    kernels = totals.get("kernels", 0)
    return (totals.get("cache_hits", 0) + totals.get("remote_hits", 0)) / kernels if kernels else 0.0


def summary_line(passes: int, failed: int, totals: dict, seconds: float) -> str:
    return (
        f"{plural(passes, 'pass')} ({passes - failed} compiled, {failed} failed): "
        f"{plural(totals['kernels'], 'kernel')}, {plural(totals['cache_hits'], 'hit')}, "
        f"{plural(totals['cache_misses'], 'miss')}, {plural(totals['remote_hits'], 'remote hit')}, "
        f"{plural(totals['traces'], 'trace')}, hit rate {hit_rate(totals):.0%}, "
        f"compile {totals['compile_seconds']:.2f} s, saved {totals['saved_seconds']:.2f} s, {seconds:.2f} s"
        + (
            f", tier: {totals['tier_errors']} errors, {totals['tier_timeouts']} timeouts, "
            f"{totals['tier_rejected']} rejected"
            if totals["tier_errors"] or totals["tier_timeouts"] or totals["tier_rejected"]
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

            self._bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=True)  # fmt: skip
            self._task = self._bar.add_task(label, total=total)
            self._bar.start()

    def advance(self, line: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
        elif not self.quiet:
            click.echo(f"[{self.done}/{self.total}] {line}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
