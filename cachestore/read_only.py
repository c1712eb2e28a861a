"""Read-only as a wrapper (`tier_mode read-only`): a tier client that reads and never writes.

It answers reads as the client it wraps does, but asks for no TTL refresh, and its writes are no-ops: no entry,
lease, lease release nor metrics batch is ever queued or sent, so credentials that cannot write (the
`nkicache-reader` ACL user, a read-only file) cost no errors. It traces its misses without a lease, as a
single-flight-off client does, and so never waits on another process's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bridge.miss_causes import VariantFacts
from bridge.port import PassRecord
from cachestore.api import MetricsBatch
from cachestore.client import EntryReads, TierClient
from cachestore.entry import Entry, SignaturePolicy
from cachestore.settings import Settings


class ReadOnlyTier(EntryReads):
    reads = True
    writes = False
    single_flight = False  # a lease is a write

    def __init__(self, client: TierClient):
        self.client = client
        self.settings: Settings = client.settings
        self.description = client.description
        self.toolchain = client.toolchain
        self.owner = client.owner
        self.policy: SignaturePolicy = client.policy

    def __repr__(self) -> str:
        return f"ReadOnlyTier({self.client.description})"

    # -- what it is, and what it did: the client's ------------------------------------------------------
    @property
    def available(self) -> bool:
        return self.client.available

    @property
    def failed(self) -> bool:
        return self.client.failed

    def overdue(self, caller: int, patience: float) -> bool:
        return self.client.overdue(caller, patience)

    def give_up(self, why: str) -> None:
        self.client.give_up(why)

    def counts(self) -> dict[str, int]:
        return self.client.counts()

    def level_hits(self) -> dict[str, int]:
        return self.client.level_hits()

    # -- reads ------------------------------------------------------------------------------------
    def find_many(self, cache_keys: list[str]) -> tuple[dict[str, Entry], set[str]]:
        return self.client.find_many(cache_keys, refresh=False)

    def variant_facts(self, misses: Mapping[str, Mapping[str, Any]]) -> dict[str, VariantFacts] | None:
        return self.client.variant_facts(misses)

    def reject(self, cache_key: str, reason: str) -> bool:
        return self.client.reject(cache_key, reason)

    # -- single flight: none ------------------------------------------------------------------------
    def acquire_lease(self, cache_key: str) -> bool:
        return True  # trace it yourself

    def release_lease(self, cache_key: str) -> None:
        pass

    def wait_for_entry(self, cache_key: str) -> Entry | None:
        return None

    # -- writes: none -------------------------------------------------------------------------------
    def publish(self, cache_key: str, entry: Entry, release_lease: bool = False) -> None:
        pass

    def publish_copy(self, cache_key: str, entry: Entry) -> None:
        pass

    def publish_trace(
        self,
        cache_key: str,
        result: dict,
        key_components: Mapping[str, Any],
        compile_seconds: float,
        release_lease: bool = False,
    ) -> None:
        pass

    def publish_failure(
        self, cache_key: str, key_components: Mapping[str, Any], message: str, release_lease: bool = False
    ) -> None:
        pass

    def record_pass(self, record: PassRecord) -> None:
        pass

    def record(self, batch: MetricsBatch) -> None:
        pass

    def send_now(self) -> None:
        pass

    def flush(self, timeout: float | None = None, *, through_outage: bool = False) -> bool:
        return True  # nothing is ever queued

    def pending(self) -> int:
        return 0

    def close(self, timeout: float | None = None) -> None:
        self.client.close(timeout)
