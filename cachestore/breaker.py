"""The circuit breaker between a tier client and its store.

After a failure the store is not asked at all for `cooldown` seconds. A store not proven yet (just opened, or
its cooldown just over) is asked by one call at a time: the others see it as down instead of waiting behind a
call to a store that may never answer (a frozen server accepts connections and says nothing). The first call
that succeeds proves it, and from then on every call goes through, as many at once as the callers make.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Breaker:
    def __init__(self, cooldown: float, on_probe_end: Callable[[], None] = lambda: None):
        """`on_probe_end` is called (with no lock held) when a probing call returns, whatever its outcome: callers
        that found the store busy being probed may try again."""
        self.cooldown = cooldown
        self._on_probe_end = on_probe_end
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._proven = False
        self._probing = False
        # Whether the store was there since this breaker was made: it answered, or took a call it did not answer in
        # time (a paused or slow server), as against refusing every connection.
        self.reachable = False

    def is_open(self) -> bool:
        """True during the cooldown after a failure."""
        return time.monotonic() < self._open_until

    def reopens_by(self, deadline: float) -> bool:
        """Whether the cooldown (if any) is over before `deadline` (a time.monotonic() value)."""
        return self._open_until < deadline

    @property
    def cooling(self) -> float:
        """Seconds of cooldown left (0 when closed)."""
        return max(0.0, self._open_until - time.monotonic())

    def available(self) -> bool:
        """Whether a call made now would be let through."""
        with self._lock:
            return self._admits()

    def _admits(self) -> bool:
        return not self.is_open() and (self._proven or not self._probing)

    def admit(self) -> bool | None:
        """None: the call must not go to the store (it is cooling down, or another call is probing it); else
        whether this call is the probe, to be handed back to `done`."""
        with self._lock:
            if not self._admits():
                return None
            probe = not self._proven
            self._probing = self._probing or probe
            return probe

    def succeeded(self) -> None:
        """The store answered."""
        with self._lock:
            self._proven = self.reachable = True

    def trip(self, reachable: bool = False) -> None:
        """The store failed (`reachable`: it took the call and did not answer in time): not asked again for
        `cooldown` seconds, and then by one call until it answers."""
        with self._lock:
            self.reachable = self.reachable or reachable
            self._open_until = time.monotonic() + self.cooldown
            self._proven = False

    def done(self, probe: bool) -> None:
        """A call `admit` let through returned."""
        if not probe:
            return
        with self._lock:
            self._probing = False
        self._on_probe_end()
