"""What an entry is worth keeping: the compile seconds its reuse saves per stored byte.

One definition for every place that chooses what to keep:

- the local tier's `max_size` trim (cachestore/backends/sqlite.py) evicts the lowest `retention_score` first:
  the value, halved for every `HALF_LIFE` the entry has gone unused, so a valuable entry nobody uses any more
  still gives way in time; equal scores go least recently used first;
- `inspect gc --max-bytes` evicts the lowest `entry_value` first (cachestore/inspect.py);
- on Redis an entry's TTL is `entry_ttl x ttl_factor`, so under `maxmemory-policy volatile-ttl` memory
  pressure takes the entries with the least time left, the cheap and the long unused, first.

An entry that took 3.5 s to trace and is used by every model is worth far more than a 5 ms one used once
of the same size; a large binary costs more room for the same seconds saved.

A writer chooses the compile seconds its entry claims, so what it can gain is bounded twice: an entry is read
only with compile seconds of at most MAX_COMPILE_SECONDS (cachestore.entry rejects, and counts in
`tier_rejected`, one claiming more, so it is traced again and replaced, never refreshed), and the TTL factor is at
most MAX_TTL_FACTOR whatever the value; the stored bytes the value divides by are measured by the reader.
"""

from __future__ import annotations

import threading
from collections import deque

DAY = 86400.0
MAX_SECONDS = 10 * 365 * 86400  # the longest TTL a setting may hold (cachestore.settings), and so any entry
HALF_LIFE = 7 * DAY  # an entry unused for a week keeps half its score in the local trim
MIN_COMPILE_SECONDS = 1e-3  # an entry with no recorded compile time (imported, older) still saves a little
# No trace of this compiler takes a day (the slowest measured, a 1024x1024 conv, 7.5 s; a fleet job is killed after
# job_timeout, 600 s by default): decode rejects an entry claiming more (cachestore.entry), and a larger time from
# elsewhere (the local tier's column, a pass log) counts as this, so no writer can inflate a value past it.
MAX_COMPILE_SECONDS = DAY
MAX_TTL_FACTOR = 8.0  # the most valuable entries live at most this many entry_ttl on Redis
MEDIAN_WINDOW = 1024  # values of the entries a client stored or read lately, for the TTL rule's median
MEDIAN_MIN_SAMPLES = 16  # until a client has seen this many, every entry gets the base TTL


def entry_value(compile_seconds: float, uses: int, stored_bytes: int) -> float:
    """Compile seconds saved per stored byte: compile seconds x uses / stored bytes."""
    seconds = min(max(compile_seconds, MIN_COMPILE_SECONDS), MAX_COMPILE_SECONDS)
    return seconds * max(uses, 0) / max(stored_bytes, 1)


def retention_score(compile_seconds: float, uses: int, stored_bytes: int, idle_seconds: float) -> float:
    """The local trim's rank: the value (at least one use: the entry was stored because a pass needed it),
    halved for every HALF_LIFE since its last use."""
    decay = 0.5 ** (max(idle_seconds, 0.0) / HALF_LIFE)
    return entry_value(compile_seconds, max(uses, 1), stored_bytes) * decay


def ttl_factor(value: float, median: float | None) -> float:
    """clamp(value / median, 1, MAX_TTL_FACTOR): an entry worth more than the usual one lives longer, never
    shorter than entry_ttl. No median yet (too few values seen): 1."""
    if median is None or median <= 0:
        return 1.0
    return min(max(value / median, 1.0), MAX_TTL_FACTOR)


class ValueMedian:
    """The median value of the last MEDIAN_WINDOW entries a client stored or read (thread-safe): the usual
    entry of its workload, which the TTL rule measures an entry against."""

    def __init__(self, window: int = MEDIAN_WINDOW) -> None:
        self._values: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._median: float | None = None
        self._since = 0  # values added since the median was last computed

    def add(self, value: float) -> None:
        with self._lock:
            self._values.append(value)
            self._since += 1

    def median(self) -> float | None:
        with self._lock:
            if len(self._values) < MEDIAN_MIN_SAMPLES:
                return None
            if self._median is None or self._since >= 64:  # a sort of 1024 floats every 64 values at most
                import statistics  # with its fractions and decimal, loaded by the first median, not at start-up

                self._median = statistics.median(self._values)
                self._since = 0
            return self._median

    def ttl(self, base_ttl: int, value: float) -> int:
        """The TTL for an entry of `value`: base_ttl x ttl_factor(value, median); the value joins the window."""
        factor = ttl_factor(value, self.median())
        self.add(value)
        return int(min(base_ttl * factor, max(base_ttl, MAX_SECONDS)))  # Redis refuses longer expiries
