"""Whole-operation deadlines for calls that block in socket reads (the Redis tier's compile path).

A socket timeout bounds each read, not an operation: a server that trickles its reply, a few bytes now and
then, keeps every read within the timeout and the operation going for as long as it likes. A `Watchdog`
thread ends an operation that overran its deadline by calling the `abort` it was given (the Redis backend
closes its client's connections, so a read blocked on the socket fails at once), and calls it again every
ABORT_AGAIN_SECONDS until the operation returns, should the client try again on a new connection.

The calling thread does the work itself and the watchdog only watches: a watch costs a lock and a set entry.
Handing each call to a worker thread and waiting for it with a timeout would be simpler, but each hand-off
costs about 70 µs here, a quarter of a remote hit.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator

ABORT_AGAIN_SECONDS = 0.05  # an aborted operation still running is aborted again this often


class Watch:
    """One watched operation. `aborted`: its deadline passed and its abort was called (whatever it raises
    from then on is the abort's doing)."""

    __slots__ = ("abort", "aborted", "deadline")

    def __init__(self, deadline: float, abort: Callable[[], None]) -> None:
        self.deadline = deadline
        self.abort = abort
        self.aborted = False


class Watchdog:
    """One daemon thread per process that aborts the watched operations that overran their deadline. It sleeps
    until the earliest deadline, and is woken only when a new one comes earlier than that (not per watch)."""

    def __init__(self) -> None:
        # watch/unwatch (every remote hit's) take the bare lock: a Condition's `with` is two Python-level calls more.
        self._lock = threading.Lock()
        self._condition = threading.Condition(self._lock)
        self._watches: set[Watch] = set()
        self._thread: threading.Thread | None = None
        self._wakes_at = math.inf  # when the thread wakes next; infinity: asleep until a watch comes

    @contextlib.contextmanager
    def watching(self, seconds: float, abort: Callable[[], None]) -> Iterator[Watch]:
        """Watch the operation run inside the block: `abort` is called (from the watchdog's thread) once it has
        run `seconds`, and again every ABORT_AGAIN_SECONDS until the block ends."""
        watch = self.watch(seconds, abort)
        try:
            yield watch
        finally:
            self.unwatch(watch)

    def watch(self, seconds: float, abort: Callable[[], None]) -> Watch:
        """`watching` without a context manager (a remote hit's path: a generator-based one costs a few µs):
        the caller must `unwatch` the watch in a `finally`."""
        watch = Watch(time.monotonic() + seconds, abort)
        with self._lock:  # (the condition's lock: notify below is allowed)
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nkicache-deadlines", daemon=True)
                self._thread.start()
            if watch.deadline < self._wakes_at:
                self._condition.notify()
        return watch

    def unwatch(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def _run(self) -> None:
        while True:
            with self._condition:
                now = time.monotonic()
                due = [watch for watch in self._watches if watch.deadline <= now]
                for watch in due:
                    watch.aborted = True
                    watch.deadline = now + ABORT_AGAIN_SECONDS
                if not due:
                    self._wakes_at = min((watch.deadline for watch in self._watches), default=math.inf)
                    self._condition.wait(None if self._wakes_at == math.inf else self._wakes_at - now)
                    continue
            for watch in due:  # outside the lock: an abort may take a while, and watches keep coming
                with contextlib.suppress(Exception):  # a failing abort must not end the watchdog
                    watch.abort()


_lock = threading.Lock()
_watchdog: Watchdog | None = None


def watchdog() -> Watchdog:
    """The process's watchdog, started on first use."""
    global _watchdog
    if _watchdog is not None:  # every compile-path call asks: no lock once there is one
        return _watchdog
    with _lock:
        if _watchdog is None:
            _watchdog = Watchdog()
        return _watchdog


def _forget_after_fork() -> None:
    """A forked child inherits the parent's watchdog object but not its thread, and perhaps a lock some other
    thread held: it starts afresh."""
    global _lock, _watchdog
    _lock = threading.Lock()
    _watchdog = None


os.register_at_fork(after_in_child=_forget_after_fork)
