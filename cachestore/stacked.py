"""A stack of tiers, nearest first (`--tier local:PATH --tier redis://HOST`), as one store to the codegen loop.

Each level is a whole `cachestore.client.TierClient`, with its own breaker, outbox, flusher and counters, so
one level failing (Redis down, a remote whose credentials cannot write) never turns off another: a down Redis
behind a healthy local file still serves everything the file holds.

- A read (of entries or of the variant index) asks the nearest level first and each farther level only for
  what the nearer ones missed; an entry found farther down is written to every nearer level (through their
  outboxes), so the next pass finds it near. Each level counts the verified entries it answered (`level_hits`).
- A write (a traced kernel, a pass's metrics batch) goes to every level that writes.
- Single flight belongs to the shared level, the farthest: leases there are what machines see of each
  other, and a wait for another machine's trace polls that level.
- tier_mode read-only applies to the shared level only: the nearer levels are this machine's own store and
  keep being filled (sccache #2773: a read-only remote must not leave the local level unwritten). mirror
  applies to every level.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from bridge.miss_causes import VariantFacts
from bridge.port import PassRecord
from cachestore.api import MetricsBatch
from cachestore.client import EntryReads, TierClient, TierStats
from cachestore.entry import Entry
from cachestore.read_only import ReadOnlyTier
from cachestore.settings import Settings

Level = TierClient | ReadOnlyTier
SERVED_KEPT = 4096  # keys whose serving level is remembered, to count a rejection on the level that served it


def level_settings(settings: Settings, levels: Sequence[str], index: int) -> Settings:
    """The settings of level `index` of a stack: its own URL; a nearer level under a read-only stack reads
    and writes (see the module's docstring)."""
    if settings.read_only and index < len(levels) - 1:
        return settings.replace(tier=levels[index], tier_mode="read-through")
    return settings.replace(tier=levels[index])


class StackedTier(EntryReads):
    """TierClients, nearest first, presenting a TierClient's interface (bridge.port.KernelStore and the calls
    the pool, the fleet worker and warm make)."""

    def __init__(self, levels: Sequence[Level]):
        if len(levels) < 2:
            raise ValueError("a stack needs at least two levels")
        self.levels = list(levels)
        self.shared = self.levels[-1]
        self.settings = self.shared.settings
        self.toolchain = self.shared.toolchain
        self.owner = self.shared.owner
        self.mode = self.settings.tier_mode
        self.description = " ".join(level.description for level in self.levels)
        self._served: dict[str, Level] = {}  # cache key -> the level whose entry the loop was last handed
        self._refused: dict[str, set[Level]] = {}  # cache key -> the levels whose entry for it the loop refused

    def __repr__(self) -> str:
        return f"StackedTier({self.description}, mode={self.mode})"

    @property
    def reads(self) -> bool:
        return any(level.reads for level in self.levels)

    @property
    def writes(self) -> bool:
        return any(level.writes for level in self.levels)

    @property
    def single_flight(self) -> bool:
        return self.shared.single_flight

    @property
    def available(self) -> bool:
        """The shared level's: a miss while it is down is the tier's being unavailable (it may have held the
        entry), whatever the nearer levels answer."""
        return self.shared.available

    @property
    def failed(self) -> bool:
        """The shared level's: it is the one whose failure the parallel plan's skipped tasks depend on."""
        return self.shared.failed

    def overdue(self, caller: int, patience: float) -> bool:
        return self.shared.overdue(caller, patience)

    def give_up(self, why: str) -> None:
        self.shared.give_up(why)

    def counts(self) -> dict[str, int]:
        """Every level's counts summed: a pass reports the stack's errors, timeouts, rejections and drops."""
        totals = dict.fromkeys(TierStats.NAMES, 0)
        for level in self.levels:
            for name, value in level.counts().items():
                totals[name] += value
        return totals

    def level_hits(self) -> dict[str, int]:
        """{level: verified entries it answered so far}, nearest first."""
        hits: dict[str, int] = {}
        for level in self.levels:
            hits.update(level.level_hits())
        return hits

    # -- reads ------------------------------------------------------------------------------------
    def find_many(self, cache_keys: list[str]) -> tuple[dict[str, Entry], set[str]]:
        """(verified entries, the keys any asked level held anything under): each level is asked only for the
        keys the nearer ones did not answer, and what a farther level answers is written to the nearer ones."""
        entries: dict[str, Entry] = {}
        held: set[str] = set()
        missing = list(cache_keys)
        for index, level in enumerate(self.levels):
            asked = [key for key in missing if level not in self._refused.get(key, ())]
            if not asked:
                continue
            if not level.reads:
                continue
            found, level_held = level.find_many(asked)
            held |= level_held
            if len(self._served) > SERVED_KEPT:
                self._served.clear()  # a long-lived worker's: only the current pass's rejections need it
            for key, entry in found.items():
                self._served[key] = level
                self._fill(index, key, entry)
            entries.update(found)
            missing = [key for key in missing if key not in found]
        return entries, held

    def _fill(self, index: int, cache_key: str, entry: Entry) -> None:
        for nearer in self.levels[:index]:
            nearer.publish_copy(cache_key, entry)  # queued; a read-only or mirror-only level's is a no-op

    def variant_facts(self, misses: Mapping[str, Mapping[str, Any]]) -> dict[str, VariantFacts] | None:
        """Each level's index, nearest first, asked only for the keys no nearer level says it stored: a warm
        local level keeps the compile off the network. A farther level's answer replaces a nearer one's (the
        shared index knows what the whole fleet stored); None when no level's index could be read."""
        known: dict[str, VariantFacts] | None = None
        asked = dict(misses)
        for level in self.levels:
            if not asked:
                break
            if not level.reads:
                continue
            facts = level.variant_facts(asked)
            if facts is None:
                continue
            known = {**(known or {}), **facts}
            asked = {key: parts for key, parts in asked.items() if not (key in facts and facts[key].stored_here_before)}
        return known

    def reject(self, cache_key: str, reason: str) -> bool:
        """Counted by the level that handed the entry over (the shared one when none did). That level is not asked
        for the key again by this process, so the next read goes on to the farther levels (True when there is
        one): a forged or foreign entry near does not hide a good copy farther down."""
        level = self._served.pop(cache_key, self.shared)
        level.reject(cache_key, reason)
        if len(self._refused) > SERVED_KEPT:
            self._refused.clear()
        self._refused.setdefault(cache_key, set()).add(level)
        farther = self.levels[self.levels.index(level) + 1 :]
        return any(other.reads and other not in self._refused[cache_key] for other in farther)

    # -- single flight: the shared level's ------------------------------------------------------------
    def acquire_lease(self, cache_key: str) -> bool:
        return self.shared.acquire_lease(cache_key)

    def release_lease(self, cache_key: str) -> None:
        self.shared.release_lease(cache_key)

    def wait_for_entry(self, cache_key: str) -> Entry | None:
        entry = self.shared.wait_for_entry(cache_key)
        if entry is not None:
            self._served[cache_key] = self.shared
            self._fill(len(self.levels) - 1, cache_key, entry)
        return entry

    # -- writes: every level ------------------------------------------------------------------------
    def publish(self, cache_key: str, entry: Entry, release_lease: bool = False) -> None:
        for level in self.levels:
            level.publish(cache_key, entry, release_lease=release_lease and level is self.shared)

    def publish_copy(self, cache_key: str, entry: Entry) -> None:
        for level in self.levels:
            level.publish_copy(cache_key, entry)

    def publish_trace(
        self,
        cache_key: str,
        result: dict,
        key_components: Mapping[str, Any],
        compile_seconds: float,
        release_lease: bool = False,
    ) -> None:
        for level in self.levels:
            level.publish_trace(
                cache_key, result, key_components, compile_seconds, release_lease=release_lease and level is self.shared
            )

    def publish_failure(
        self, cache_key: str, key_components: Mapping[str, Any], message: str, release_lease: bool = False
    ) -> None:
        for level in self.levels:
            level.publish_failure(
                cache_key, key_components, message, release_lease=release_lease and level is self.shared
            )

    def record_pass(self, record: PassRecord) -> None:
        """Every level's metrics take the pass (the same id: each applies it once): the shared level's are the
        fleet's, a local level's are this machine's usage, which its retention ranks entries by."""
        for level in self.levels:
            level.record_pass(record)

    def record(self, batch: MetricsBatch) -> None:
        """A metrics batch (warm's) to every level, as record_pass."""
        for level in self.levels:
            level.record(batch)

    def send_now(self) -> None:
        for level in self.levels:
            level.send_now()

    def flush(self, timeout: float | None = None, *, through_outage: bool = False) -> bool:
        """Every level flushed within one deadline (not one timeout per level)."""
        deadline = time.monotonic() + (self.settings.final_flush_timeout if timeout is None else timeout)
        flushed = True
        for level in self.levels:
            remaining = max(0.0, deadline - time.monotonic())
            flushed = level.flush(remaining, through_outage=through_outage) and flushed
        return flushed

    def pending(self) -> int:
        return sum(level.pending() for level in self.levels)

    def close(self, timeout: float | None = None) -> None:
        for level in self.levels:
            level.close(timeout)


Tier = Level | StackedTier  # what cachestore.stores.open_tier opens, None aside: one level, or a stack of them
