"""What one compile call returns (`CompileRun`), and what every way of running one shares: the Ctrl-C handling,
and the tier library's import."""

from __future__ import annotations

import gc
import signal
import threading
from typing import Any

import msgspec

from cachestore.settings import Settings
from cachestore.stores import import_store_library
from workers.passes import PassResult


class CompileRun(msgspec.Struct):
    results: list[PassResult]  # in input order
    interrupted: bool
    # Tier writes dropped outside every pass, so in no result: above all those still queued when the tier
    # clients closed after the last pass (the tier being down), but also any refused between passes.
    tier_dropped_outside_passes: int = 0
    # Tier errors and timeouts outside every pass: `compile --workers N`'s plan asks the tier for the compile's
    # variants before any pass runs (workers/variant_pool.py).
    tier_faults_outside_passes: dict[str, int] = msgspec.field(default_factory=dict)


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


def import_tier_library(settings: Settings) -> None:
    """Import the library of the tier's store now (redis-py: 60-70 ms) and keep what it made from the collector,
    as workers.pool.compile_paths keeps the compiler's (a warm Redis compile exits ~7 ms sooner): a serial
    compile at once, `compile --workers N` after forking its helpers, while they trace."""
    import_store_library(settings)
    gc.freeze()
