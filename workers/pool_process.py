"""What runs in a pool process of `compile --workers N` and `warm --workers N`, and the forkserver that starts
them: each opens its own tier client once, ignores Ctrl-C (the parent handles it) and traces the tasks it is
sent (bridge.parallel), publishing nothing itself."""

from __future__ import annotations

import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

from cachestore.settings import Settings
from cachestore.stores import open_tier
from workers.own_code import own_code_launch

if TYPE_CHECKING:
    import multiprocessing.context

    from bridge.parallel import TraceOutcome, TraceTask

# multiprocessing and the trace tasks (bridge.parallel) are imported where a pool is used: a compile with one
# worker never starts a process. The forkserver preloads what a pool process runs.
FORKSERVER_PRELOAD = ["workers.pool_process", "bridge.parallel"]

_process_tier = None  # the tier client of a pool process, opened by init_process
_process_limits = None  # the settings' bounds on one graph's work, set by init_process


def init_process(settings: Settings, dropped_outside_passes: Any = None) -> None:
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


def trace_in_process(tasks: list[TraceTask]) -> list[TraceOutcome]:
    """Trace tasks of `workers.variant_pool`, in a pool process, with its limits; never published here: the pass
    that takes a trace publishes it, as it publishes its own."""
    from bridge.parallel import trace_task

    return [trace_task(task, None, _process_limits) for task in tasks]


def pool_context() -> multiprocessing.context.BaseContext:
    """forkserver (spawn on Windows), the server importing the compiler once so pool processes start with it.

    A terminal's Ctrl-C goes to the whole process group. The server is started with SIGINT ignored, which it
    and every process forked from it inherit, so Ctrl-C cannot kill one of them while it is still importing
    (before `init_process` ignores SIGINT itself) and print a traceback or break the pool: only this process
    sees it, and stops the pool cleanly. The server and so every pool process runs the command's own code, whatever
    the current directory holds (workers.own_code)."""
    import multiprocessing.forkserver

    if sys.platform == "win32":
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(FORKSERVER_PRELOAD)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        with own_code_launch():  # the server imports its preload from where this process did (workers.own_code)
            multiprocessing.forkserver.ensure_running()
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)
    return context
