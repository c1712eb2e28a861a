"""Single-flight leases that die with their holder.

A lease lives `lease_ttl` seconds unless its holder renews it, which a `LeaseKeeper` thread does every third
of that for as long as the holder traces. A process killed in the middle of a trace stops renewing, so its
leases lapse within `lease_ttl` and the processes waiting on them trace for themselves, instead of waiting
out a lease sized for the longest trace there is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

RENEWALS_PER_TTL = 3  # a renewal may be late twice before the lease lapses


class LeaseKeeper:
    """Renews the leases this process holds, from a daemon thread started with the first one."""

    def __init__(self, renew: Callable[[str], None], ttl: float):
        self._renew = renew
        self._interval = ttl / RENEWALS_PER_TTL
        self._held: set[str] = set()
        self._lock = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def hold(self, cache_key: str) -> None:
        with self._lock:
            self._held.add(cache_key)
            if self._thread is None and not self._stopped:
                thread = threading.Thread(target=self._run, name="nkicache-lease-keeper", daemon=True)
                thread.start()  # kept only once started: stop() never joins a thread that could not start
                self._thread = thread

    def drop(self, cache_key: str) -> bool:
        """Stop renewing `cache_key`; whether it was held."""
        with self._lock:
            held = cache_key in self._held
            self._held.discard(cache_key)
            return held

    def held(self) -> set[str]:
        with self._lock:
            return set(self._held)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self._interval + 1.0)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._stopped, self._interval)
                if self._stopped:
                    return
                keys = sorted(self._held)
            for cache_key in keys:  # outside the lock: a renewal is a round trip
                self._renew(cache_key)
