"""The local pool: `nkicache compile --workers N`, all processes sharing the configured tier.

With one worker every pass runs here, one after the other. With N, this process and N - 1 pool processes
trace the compile's distinct kernel variants (workers/variant_pool.py, bridge/parallel.py), and this process
runs each pass, in order, with a fresh BirCodeGenLoop handed the variants traced for it. Each pool process
opens its own tier client once. Pool processes ignore Ctrl-C: the parent stops tracing and starting passes,
lets the running ones finish (artifacts are written atomically) and reports what was done.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachestore.client import open_tier
from cachestore.settings import Settings
from workers.passes import PassResult, compile_graph

if TYPE_CHECKING:
    import multiprocessing.context

    from bridge.parallel import TraceOutcome, TraceTask

# multiprocessing and the trace tasks (bridge.parallel) are imported where a pool is used: a compile with one
# worker never starts a process. The forkserver preloads what a pool process runs.
FORKSERVER_PRELOAD = ["workers.pool", "bridge.parallel"]

_process_tier = None  # the tier client of a pool process, opened by _init_process
_process_limits = None  # the settings' bounds on one graph's work, set by _init_process


def _init_process(settings: Settings, dropped_outside_passes: Any = None) -> None:
    """A pool process's start: its own tier client, closed as the process ends; what the client drops outside
    the passes is added to `dropped_outside_passes` (a shared multiprocessing Value) when one is given."""
    import multiprocessing.util

    global _process_tier, _process_limits
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _process_limits = settings.limits()
    _process_tier = open_tier(settings)  # one metrics series per host and worker name, however many processes
    if _process_tier is not None:
        # Pool processes end without running atexit; a multiprocessing finalizer still runs, before the
        # process exits and so before the parent's shutdown(wait=True) returns.
        multiprocessing.util.Finalize(None, _close_process_tier, args=(dropped_outside_passes,), exitpriority=10)


def _close_process_tier(dropped_outside_passes: Any) -> None:
    """Close this process's tier client and add what it dropped outside every pass (at close above all: the
    writes still queued when the tier is down) to the parent's shared counter, which no result carries: a pool
    process runs trace tasks, never a pass, so every write it dropped is outside the passes."""
    _process_tier.close()
    if dropped_outside_passes is None:
        return
    unreported = _process_tier.counts()["tier_dropped"]
    with dropped_outside_passes.get_lock():
        dropped_outside_passes.value += unreported


def _trace_in_process(tasks: list[TraceTask]) -> list[TraceOutcome]:
    """Trace tasks of `workers.variant_pool`, in a pool process, with its limits; never published here: the pass
    that takes a trace publishes it, as it publishes its own."""
    from bridge.parallel import trace_task

    return [trace_task(task, None, _process_limits) for task in tasks]


def duplicate_names(paths: Sequence[str], max_bytes: int) -> dict[str, str]:
    """{path: error} for graph files whose artifact name an earlier file in `paths` already takes; a
    file that cannot be read or is larger than `max_bytes` is left to its pass to report."""
    from bridge.artifact import artifact_filename
    from bridge.graph import GraphError, parse_graph_json, read_graph_file

    seen: dict[str, str] = {}
    errors: dict[str, str] = {}
    for path in paths:
        try:
            name = parse_graph_json(read_graph_file(path, max_bytes), path).get("name") or Path(path).stem
        except GraphError:
            continue
        filename = artifact_filename(str(name))
        if filename in seen:
            errors[path] = (
                f"{path}: graph name {name!r} was already compiled from {seen[filename]} in this call; "
                f"its artifact {filename} would be overwritten"
            )
        else:
            seen[filename] = path
    return errors


@dataclass
class CompileRun:
    results: list[PassResult]  # in input order
    interrupted: bool
    # Tier writes dropped outside every pass, so in no result: above all those still queued when the tier
    # clients closed after the last pass (the tier being down), but also any refused between passes.
    tier_dropped_outside_passes: int = 0
    # Tier errors and timeouts outside every pass: `compile --workers N`'s plan asks the tier for the compile's
    # variants before any pass runs (workers/variant_pool.py).
    tier_faults_outside_passes: dict[str, int] = field(default_factory=dict)


def compile_run(
    paths: Sequence[str],
    *,
    settings: Settings,
    workers: int,
    out_dir: str,
    target_name: str | None = None,
    on_result: Callable[[PassResult], None] = lambda result: None,
) -> CompileRun:
    """Compile every path (results in input order, whether Ctrl-C stopped it, what the tier dropped outside
    the passes), and close the tier clients the compile opened."""
    from bridge.artifact import ArtifactError

    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # before any pass: every artifact would fail the same way
        raise ArtifactError(f"{out_dir}: cannot create the output folder: {exc.strerror or exc}") from None
    refused = duplicate_names(paths, settings.max_graph_bytes)
    run = _compile_all([p for p in paths if p not in refused], settings=settings, workers=workers,
                       out_dir=out_dir, target_name=target_name, on_result=on_result)  # fmt: skip
    by_path = {result.file: result for result in run.results}
    results = []
    for path in paths:
        if path in refused:
            results.append(PassResult(path, error=refused[path]))
            on_result(results[-1])
        elif path in by_path:
            results.append(by_path[path])
    run.results = results
    return run


def _compile_all(
    paths: Sequence[str],
    *,
    settings: Settings,
    workers: int,
    out_dir: str,
    target_name: str | None,
    on_result: Callable[[PassResult], None],
) -> CompileRun:
    if workers <= 1:
        return _compile_serially(paths, settings, out_dir, target_name, on_result)
    from workers.variant_pool import compile_in_parallel

    return compile_in_parallel(paths, settings=settings, workers=workers, out_dir=out_dir, target_name=target_name,
                               on_result=on_result)  # fmt: skip


CTRL_C_POLL_SECONDS = 0.1


class CtrlC:
    """Ctrl-C as a flag the compile loop polls: the first one stops handing out graphs (running passes finish),
    a second one raises KeyboardInterrupt. A KeyboardInterrupt raised at an arbitrary point of the main thread
    can land inside concurrent.futures while it holds a future's lock (its `wait` takes them one by one) and
    hang the pool's shutdown, or inside the first submit, before the executor can be shut down at all."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc_info: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def pool_context() -> multiprocessing.context.BaseContext:
    """forkserver (spawn on Windows), the server importing the compiler once so pool processes start with it.

    A terminal's Ctrl-C goes to the whole process group. The server is started with SIGINT ignored, which it
    and every process forked from it inherit, so Ctrl-C cannot kill one of them while it is still importing
    (before `_init_process` ignores SIGINT itself) and print a traceback or break the pool: only this process
    sees it, and stops the pool cleanly."""
    import multiprocessing.forkserver

    if sys.platform == "win32":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, previous)
    return context


def _compile_serially(
    paths: Sequence[str],
    settings: Settings,
    out_dir: str,
    target_name: str | None,
    on_result: Callable[[PassResult], None],
) -> CompileRun:
    tier = open_tier(settings)
    results: list[PassResult] = []
    try:
        with CtrlC() as ctrl_c:
            for path in paths:
                if ctrl_c.pressed:
                    break
                result, _ = compile_graph(path, tier=tier, target_name=target_name, out_dir=out_dir,
                                          limits=settings.limits())  # fmt: skip
                results.append(result)
                on_result(result)
    finally:
        if tier is not None:
            tier.close()
    run = CompileRun(results, ctrl_c.pressed)
    if tier is not None:
        # The client counts every drop of its life; the passes counted theirs: the rest happened outside them.
        passes_dropped = sum(int(r.counts.get("tier_dropped", 0)) for r in results)
        run.tier_dropped_outside_passes = tier.counts()["tier_dropped"] - passes_dropped
    return run
