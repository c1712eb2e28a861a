"""The tier contract: what the codegen loop's persistent tier must do, whatever stores it.

A backend moves encoded entries and metrics batches; it raises `TierUnavailable` or `TierTimeout` when the
store cannot answer, and never decides whether an entry is trustworthy (that is `cachestore.entry`'s job,
done by the client for every backend alike). `MISS` is the typed "nothing there" answer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bridge.errors import NkiCacheError


class TierError(NkiCacheError):
    """The tier could not do what was asked."""


class TierUnavailable(TierError):
    """The tier is down, unreachable, refusing, or out of memory."""


class TierTimeout(TierError):
    """The tier did not answer within the operation timeout."""


class _Miss(enum.Enum):
    MISS = "miss"


MISS = _Miss.MISS


@dataclass(frozen=True)
class StoreRequest:
    cache_key: str
    digest: str
    full: bytes  # the encoded entry holding the binary
    # The same entry encoded as a reference to the cache key (the argument) whose entry already holds this
    # digest: only the backend learns which key that is, and only the client can sign the encoding.
    reference: Callable[[str], bytes]
    kernel_name: str


@dataclass
class KeyUsage:
    kernel_name: str
    usage: int
    first_use: float
    last_use: float


@dataclass
class MetricsBatch:
    """Counts from one pass (or part of one), applied to the fleet metrics exactly once by `batch_id`."""

    batch_id: str
    host: str
    worker: str
    totals: dict[str, float] = field(default_factory=dict)
    kernel_calls: dict[str, int] = field(default_factory=dict)
    keys: dict[str, KeyUsage] = field(default_factory=dict)
    pass_record: dict[str, object] | None = None  # appended to the pass log when the pass ends


TOTAL_COUNTERS = (
    "passes", "kernels", "cache_hits", "cache_misses", "remote_hits", "traces", "compile_seconds",
    "saved_seconds", "tier_errors", "tier_timeouts", "tier_rejected", "tier_unverified", "lease_waits", "tier_dropped",
)  # fmt: skip


class Backend(Protocol):
    """What every tier backend implements."""

    def fetch(self, cache_keys: Sequence[str], ttl: int) -> dict[str, bytes]:
        """Encoded entries for the keys that have one (refreshing their TTL); references are not followed."""

    def store(self, requests: Sequence[StoreRequest], ttl: int) -> None:
        """Write entries; a binary already stored under another key is written as a reference to it."""

    def apply_metrics(self, batch: MetricsBatch) -> bool:
        """Apply a batch unless one with its id was applied already; True when applied now."""

    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool: ...

    def release_lease(self, cache_key: str, owner: str) -> None: ...

    def lease_holder(self, cache_key: str) -> str | None: ...

    def scan_entries(self) -> Iterator[tuple[str, bytes]]:
        """Every (cache key, encoded entry), streamed."""

    def ping(self) -> None: ...

    def close(self) -> None: ...
