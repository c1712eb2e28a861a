"""The port between the compiler and a persistent kernel store: what the codegen loop asks of a tier.

The loop (bridge.codegen) knows nothing of storage: it hands a store the keys it is about to need, the
kernels it traced and, once per pass, what the pass did. `cachestore.client.TierClient` implements this
port over Redis, Redis Cluster or the embedded SQLite tier; anything else that implements it (a test
double, another store) plugs into the loop the same way.

The counter names every report, JSON output and metrics batch uses are listed here once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import msgspec

from bridge.miss_causes import MISS_COUNTERS, VariantFacts

# What one pass counts, in the order reports show them. `kernels` = cache_hits + cache_misses (the
# specification's counters, the in-pass cache); `tier_lookups` are the in-pass misses that asked the shared
# tier (none with the tier off or in mirror mode), `remote_hits` the ones it answered; `traces` are the misses
# that neither the in-pass cache nor the tier answered: every trace made for the pass, wherever it ran;
# `parallel_traces` how many of those ran in another process (`nkicache compile --workers N`'s helpers, a fleet
# job's trace tasks), so `traces` is the same with 1 or N workers and `parallel_traces` only says where.
# `traces_refused` counts the traces another process handed over from another compiler than the pass's (code
# imported from elsewhere): the pass traced those itself. `known_failures` counts the kernels the tier knew this
# compiler fails to compile (a negative entry): the pass failed at once on them instead of compiling them again.
# Saved time is counted apart for each cache, so that none reads as the other's: `tier_saved_seconds` is the
# compile seconds stored with the entries the shared tier answered (its remote hits), `in_pass_saved_seconds`
# what tracing the variants the pass's own cache answered cost (its cache hits), which a pass saves with no tier.
PASS_COUNTERS = (
    "passes",
    "kernels",
    "cache_hits",
    "cache_misses",
    "remote_hits",
    "traces",
    "parallel_traces",
    "traces_refused",
    "known_failures",
    "compile_seconds",
    "tier_saved_seconds",
    "in_pass_saved_seconds",
    "tier_errors",
    "tier_timeouts",
    "tier_rejected",
    "tier_unverified",
    "lease_waits",
    "tier_dropped",
    "tier_lookups",
    *MISS_COUNTERS,
)
# The counters that are seconds (sums kept as floats); every other counter is a whole count.
SECONDS_COUNTERS = ("compile_seconds", "tier_saved_seconds", "in_pass_saved_seconds")
# tier_lookups - remote_hits = the tier misses, each counted once under its cause (bridge.miss_causes).
# The store's own share of those counts: faults and refusals, counted apart from misses.
TIER_COUNTERS = ("tier_errors", "tier_timeouts", "tier_rejected", "tier_unverified", "tier_dropped")

# The two hit rates, under the names every JSON output, report and metric uses, and the words every text, table
# and plot uses for them. The shared cache's is the headline (as sccache's "cache hits rate": what the tier
# answered of what it was asked); the in-pass rate is the specification's cache_hits / kernels, which a pass
# gets with no tier at all (a model repeats its layers).
SHARED_HIT_RATE = "shared_hit_rate"
IN_PASS_HIT_RATE = "in_pass_hit_rate"
HIT_RATE_WORDS = {
    SHARED_HIT_RATE: "shared-cache hit rate",
    IN_PASS_HIT_RATE: "in-pass hit rate",
}
HIT_RATE_FORMULAS = {
    SHARED_HIT_RATE: "remote_hits / tier_lookups",
    IN_PASS_HIT_RATE: "cache_hits / kernels",
}


def shared_hit_rate(counts: Mapping[str, float]) -> float | None:
    """Share of tier lookups the shared tier answered (remote_hits / tier_lookups), from summed counts: a
    fleet's rate is computed from its totals, never averaged over passes. None when nothing asked the tier
    (tier off, mirror only): no rate, rather than a 0% that would read as a cache that never hits."""
    lookups = counts.get("tier_lookups", 0)
    if not lookups:
        return None
    return counts.get("remote_hits", 0) / lookups


def in_pass_hit_rate(counts: Mapping[str, float]) -> float | None:
    """The specification's rate: the share of kernels the pass's own cache answered (cache_hits / kernels).
    None when no kernel was compiled, as the shared rate is without lookups: nothing asked, no rate."""
    kernels = counts.get("kernels", 0)
    if not kernels:
        return None
    return counts.get("cache_hits", 0) / kernels


def hit_rates(counts: Mapping[str, float], digits: int = 6) -> dict[str, float | None]:
    """Both rates, rounded, under their names: what every JSON output and report adds to its counts."""
    rates = {SHARED_HIT_RATE: shared_hit_rate(counts), IN_PASS_HIT_RATE: in_pass_hit_rate(counts)}
    return {name: None if rate is None else round(rate, digits) for name, rate in rates.items()}


def plural(count: float, word: str) -> str:
    """'1 job', '2 jobs', '1 pass', '3 passes', '1 entry', '2 entries', '1,024 kernels': every count a person
    reads is worded by this rule, never by a hand-written 's'."""
    count = int(count)
    if count == 1:
        return f"{count:,} {word}"
    if word.endswith("s"):
        return f"{count:,} {word}es"
    if word.endswith("y") and word[-2:-1] not in "aeiou":
        return f"{count:,} {word[:-1]}ies"
    return f"{count:,} {word}s"


def format_rate(rate: float | None, digits: int = 1) -> str:
    """A rate as a percentage, or 'n/a' when there is none (nothing was asked: no tier lookups, no kernels)."""
    return "n/a" if rate is None else f"{rate:.{digits}%}"


class StoredTrace(msgspec.Struct, frozen=True):
    """A verified kernel trace the store holds: the specification's trace-result dict
    ({'binary', 'input_names', 'output_names', 'format'}), what tracing it cost, the key components it was
    stored with, and the id of the compiler that traced it (bridge.identity)."""

    result: dict
    compile_seconds: float
    key_components: Mapping[str, Any]
    toolchain: str


class TracedVariant(msgspec.Struct, frozen=True):
    """A kernel variant another process traced for a pass: the specification's trace-result dict, what tracing
    it took, and the id of the compiler that traced it, as that process computed it (bridge.identity): a pass
    takes only its own compiler's traces."""

    result: dict
    seconds: float
    toolchain: str
    miss_cause: str = "unknown"  # why the tier missed it when the compile's plan asked (bridge.miss_causes)
    elsewhere: bool = False  # traced in another process than the pass's (counted in parallel_traces)
    failure: str | None = None  # the kernel failed to compile, with this one-line message (its result is empty)


class VariantUse(msgspec.Struct, frozen=True):
    """How one pass used one kernel variant (a cache key)."""

    kernel_name: str
    usage: int
    first_use: float
    last_use: float


class PassRecord(msgspec.Struct):
    """What one compilation pass tells the store when it ends."""

    graph_name: str
    pass_id: str | None  # None: the store names the pass (a fresh id); the fleet passes the job id
    started: float
    finished: float
    counts: dict[str, float]  # PASS_COUNTERS
    variants: dict[str, VariantUse] = msgspec.field(default_factory=dict)  # cache key -> use
    kernel_misses: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)  # kernel -> cause -> tier misses


class KernelStore(Protocol):
    """A persistent store of traced kernels, as the codegen loop uses it. Every method returns rather than
    raises when the store is down or slow: a store never makes a compile fail."""

    # Read-only properties: a store may answer them as plain attributes, or compute them.
    @property
    def reads(self) -> bool:
        """False: mirror only (publish, never look up)."""

    @property
    def writes(self) -> bool:
        """False: read-only (nothing is published, no lease taken)."""

    @property
    def available(self) -> bool:
        """False while the store is known to be down (its lookups all miss)."""

    @property
    def single_flight(self) -> bool:
        """Take a lease before tracing, so a variant is traced once across processes."""

    def find_traces(self, cache_keys: Sequence[str]) -> tuple[dict[str, StoredTrace], set[str]]:
        """(verified traces, the keys the store held anything under, rejected or not), in one round trip."""

    def acquire_lease(self, cache_key: str) -> bool:
        """True when this process should trace `cache_key` (it holds the lease, or the store cannot say)."""

    def release_lease(self, cache_key: str) -> None: ...

    def wait_for_trace(self, cache_key: str) -> StoredTrace | None:
        """Wait (bounded) for the lease holder's trace; None when it does not come."""

    def variant_facts(self, misses: Mapping[str, Mapping[str, Any]]) -> dict[str, VariantFacts] | None:
        """What the store's variant index knows of each cache key the pass is about to miss on (its key
        components given), in one round trip; None when it cannot say. For the cause of each miss."""

    def reject(self, cache_key: str, reason: str) -> bool:
        """Count (in tier_rejected) and log a trace the loop refused: not what it asked for under this key. True
        when another read of the key may find another copy (a stack's farther level), which the loop then asks."""

    def publish_trace(
        self,
        cache_key: str,
        result: dict,
        key_components: Mapping[str, Any],
        compile_seconds: float,
        release_lease: bool = False,
    ) -> None:
        """Store a kernel this process traced (write-behind), releasing its lease when it held one."""

    def publish_failure(
        self, cache_key: str, key_components: Mapping[str, Any], message: str, release_lease: bool = False
    ) -> None:
        """Store a negative entry (write-behind): the kernel failed to compile with this compiler, for this
        one-line reason, releasing the lease when it held one. It lives failure_ttl; a pass that reads it fails
        at once with the same message (bridge.codegen)."""

    def record_pass(self, record: PassRecord) -> None:
        """Hand over what a pass did, to be applied to the fleet metrics exactly once. The pass's last call: it
        must not wait for the store (the loop returns right after it); a store that writes behind sends soon."""

    def send_now(self) -> None:
        """Have what was handed over sent at once, without waiting for it: what another process may be waiting
        for (a trace and its lease's release) does not wait out a write-behind's gathering."""

    def flush(self) -> bool:
        """Wait (bounded) until what was handed over is stored; False when it is not (yet). The loop never calls
        it: whoever needs the pass's writes stored before going on does (a fleet job before it is acknowledged)."""

    def counts(self) -> dict[str, int]:
        """This process's TIER_COUNTERS so far (the loop reports the difference over its pass)."""

    def level_hits(self) -> dict[str, int]:
        """{level: verified entries it answered so far}, nearest level first (one item for a store of one level):
        a pass's `level_hits`, the difference over the pass."""
