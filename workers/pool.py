"""The local pool: N processes compiling graph files, all sharing the configured tier.

Each process opens its own tier client once and runs one pass per graph with a fresh BirCodeGenLoop.
Workers ignore Ctrl-C: the parent stops handing out graphs, lets the running passes finish (their
artifacts are written atomically) and reports what was done.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachestore.client import open_tier
from cachestore.settings import Settings
from workers.passes import PassResult, compile_graph

_process_tier = None  # the tier client of a pool process, opened by _init_process
_process_limits = None  # the settings' bounds on one graph's work, set by _init_process
_process_passes_dropped = 0  # tier_dropped the passes of this pool process counted in their own results


def _init_process(settings: Settings, dropped_outside_passes: Any = None) -> None:
    """A pool process's start: its own tier client, closed as the process ends; what the client drops outside
    the passes is added to `dropped_outside_passes` (a shared multiprocessing Value) when one is given."""
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
    writes still queued when the tier is down) to the parent's shared counter, which no result carries."""
    _process_tier.close()
    if dropped_outside_passes is None:
        return
    unreported = _process_tier.counts()["tier_dropped"] - _process_passes_dropped
    with dropped_outside_passes.get_lock():
        dropped_outside_passes.value += unreported


def _compile_in_process(path: str, target_name: str | None, out_dir: str) -> PassResult:
    global _process_passes_dropped
    result, _ = compile_graph(path, tier=_process_tier, target_name=target_name, out_dir=out_dir,
                              limits=_process_limits)  # fmt: skip
    _process_passes_dropped += int(result.counts.get("tier_dropped", 0))
    return result


def duplicate_names(paths: Sequence[str], max_bytes: int) -> dict[str, str]:
    """{path: error} for graph files whose artifact name an earlier file in `paths` already takes; a
    file that cannot be read or is larger than `max_bytes` is left to its pass to report."""
    from bridge.artifact import artifact_filename
    from bridge.graph import GraphError, parse_graph_json

    seen: dict[str, str] = {}
    errors: dict[str, str] = {}
    for path in paths:
        try:
            if Path(path).stat().st_size > max_bytes:
                continue
            name = parse_graph_json(Path(path).read_bytes(), path).get("name") or Path(path).stem
        except (OSError, GraphError):
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
    if workers <= 1 or len(paths) <= 1:
        return _compile_serially(paths, settings, out_dir, target_name, on_result)
    results: dict[int, PassResult] = {}
    context = pool_context()
    pending: dict[Future, int] = {}
    # Each process's client is closed by a finalizer as the process ends, after its last result came back:
    # what it drops then reaches this process through shared memory, complete once shutdown() has joined them.
    dropped_outside_passes = context.Value("q", 0)
    with CtrlC() as ctrl_c:
        executor = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_process,
                                       initargs=(settings, dropped_outside_passes))  # fmt: skip
        try:
            for index, path in enumerate(paths):
                pending[executor.submit(_compile_in_process, path, target_name, out_dir)] = index
            while pending and not ctrl_c.pressed:
                done, _ = wait(pending, timeout=CTRL_C_POLL_SECONDS, return_when=FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    results[index] = future.result()
                    on_result(results[index])
        finally:
            # On Ctrl-C: drop the graphs not started, let the running passes finish, keep what they wrote.
            executor.shutdown(wait=True, cancel_futures=True)
        for future, index in pending.items():
            if not future.cancelled() and future.exception() is None:
                results[index] = future.result()
    return CompileRun([results[i] for i in sorted(results)], ctrl_c.pressed, dropped_outside_passes.value)


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
    if sys.platform == "win32":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["workers.pool"])
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
