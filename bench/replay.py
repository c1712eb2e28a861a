"""Replay a recorded pass log against a cache of fixed size, to compare retention policies.

A pass log is what passes used: for each pass, when it ran and how many times it called each cache key; the
entries are what each key cost to trace and takes to store. The replay runs the passes in order against a
cache holding at most `budget_bytes`: a key found is a hit and saves its compile seconds; a key missing is
traced and stored. A store past the budget evicts, as the local tier's trim does, until TRIM_TO of the budget
is left, choosing victims by the policy:

- `lru`: least recently used first (the local tier before issue 21, Redis's volatile-lru);
- `value`: lowest `cachestore.value.retention_score` first (compile seconds x the passes that used the key so
  far / stored bytes, halved for every week unused; equal scores least recently used first), as the local
  tier trims today.

What a policy is worth is the compile seconds its hits saved: `nkicache bench` reports value / lru
(`value_retention_ratio`).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from cachestore.value import retention_score

TRIM_TO = 0.9  # as cachestore.backends.sqlite: past the budget, evict down to 90% of it
POLICIES = ("lru", "value")


class LoggedEntry(msgspec.Struct, frozen=True):
    compile_seconds: float
    stored_bytes: int


class LoggedPass(msgspec.Struct, frozen=True):
    time: float  # seconds, any origin
    uses: Mapping[str, int]  # cache key -> calls in the pass (the value counts the pass once)


class ReplayResult(msgspec.Struct):
    policy: str
    saved_seconds: float = 0.0  # compile seconds the hits saved
    traced_seconds: float = 0.0  # compile seconds the misses cost
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    def as_json(self) -> dict:
        return {
            "policy": self.policy,
            "saved_seconds": round(self.saved_seconds, 6),
            "traced_seconds": round(self.traced_seconds, 6),
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }


class ReplayError(ValueError):
    """A pass log the replay cannot run: a key with no entry, a bad budget or policy."""


def replay(
    passes: Iterable[LoggedPass], entries: Mapping[str, LoggedEntry], budget_bytes: int, policy: str
) -> ReplayResult:
    """Run `passes` in order against a cache of `budget_bytes` under `policy` (`lru` or `value`)."""
    if policy not in POLICIES:
        raise ReplayError(f"unknown retention policy {policy!r}; use {' or '.join(POLICIES)}")
    if budget_bytes <= 0:
        raise ReplayError(f"budget must be a positive number of bytes, got {budget_bytes}")
    result = ReplayResult(policy)
    cached: dict[str, float] = {}  # key -> last use
    uses: dict[str, int] = {}  # passes that used each key so far, kept after an eviction (as the metrics are)
    held = 0
    for logged in passes:
        for key in logged.uses:
            entry = entries.get(key)
            if entry is None:
                raise ReplayError(f"pass log names key {key[:16]}... with no entry")
            uses[key] = uses.get(key, 0) + 1  # a pass traces a key once whatever its calls: it saves one trace
            if key in cached:
                result.hits += 1
                result.saved_seconds += entry.compile_seconds
            else:
                result.misses += 1
                result.traced_seconds += entry.compile_seconds
                held += entry.stored_bytes
            cached[key] = logged.time
        if held > budget_bytes:
            held, evicted = _trim(cached, uses, entries, held, budget_bytes, policy, logged.time)
            result.evictions += evicted
    return result


def _trim(
    cached: dict[str, float],
    uses: Mapping[str, int],
    entries: Mapping[str, LoggedEntry],
    held: int,
    budget_bytes: int,
    policy: str,
    now: float,
) -> tuple[int, int]:
    """Evict down to TRIM_TO of the budget at the end of a pass (the tier stores a pass's entries together)."""

    def rank(key: str) -> tuple[float, float]:
        if policy == "lru":
            return (cached[key], 0.0)
        entry = entries[key]
        return (retention_score(entry.compile_seconds, uses[key], entry.stored_bytes, now - cached[key]), cached[key])

    evicted = 0
    for key in sorted(cached, key=rank):
        if held <= budget_bytes * TRIM_TO:
            break
        held -= entries[key].stored_bytes
        del cached[key]
        evicted += 1
    return held, evicted


def scaled_log(
    recorded: Sequence[LoggedPass], factor: int, seed: int, spacing_seconds: float = 3600.0
) -> list[LoggedPass]:
    """A workload `factor` times the recorded one: factor x len(recorded) passes, each a recorded pass drawn
    with Zipf-like popularity (the i-th recorded pass, in a seeded shuffled order, weighs 1 / (i + 1)), as a
    fleet compiles a few models far more often than the rest; one pass every `spacing_seconds`."""
    if not recorded or factor < 1:
        raise ReplayError("a scaled log needs recorded passes and a factor of at least 1")
    rng = random.Random(seed)
    order = list(range(len(recorded)))
    rng.shuffle(order)
    weights = [0.0] * len(recorded)
    for rank, index in enumerate(order):
        weights[index] = 1.0 / (rank + 1)
    drawn = rng.choices(range(len(recorded)), weights=weights, k=factor * len(recorded))
    return [LoggedPass(i * spacing_seconds, recorded[index].uses) for i, index in enumerate(drawn)]


def compare(
    passes: Sequence[LoggedPass], entries: Mapping[str, LoggedEntry], budget_bytes: int
) -> dict[str, ReplayResult]:
    """Both policies over the same log and budget."""
    return {policy: replay(passes, entries, budget_bytes, policy) for policy in POLICIES}
