"""The storage contract, whole: what a tier backend does, what it raises, the data it moves, and the one
way every command opens one.

A backend moves encoded entries, leases and metrics batches. It raises `TierUnavailable` or `TierTimeout`
when the store cannot answer, and never decides whether an entry is trustworthy: that is
`cachestore.entry`'s job, done by the client (compile path) and by inspection (read path) alike. It does
bound what it reads, since others can write to the store: an entry larger than its `max_entry_bytes` (the
setting) is never downloaded, and is handed over as a `cachestore.entry.TooLarge` naming its size.

Two protocols, implemented by one class per backend (`cachestore/backends/`):

- `Backend`: the compile path, used by `cachestore.client.TierClient` (batched reads that refresh TTLs,
  writes of whole entries, single-flight leases, metrics batches applied exactly once);
- `Reader`: reports, inspection and administration (streamed scans of entries and fleet metrics, plain
  reads that never refresh a TTL, and the few writes `inspect import` and `inspect gc` make).

Optional abilities are declared as class attributes (`value_ttls`, `keeps_expired`,
`splits_scans`), never probed.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, Self, TypeGuard

import msgspec

from bridge.errors import NkiCacheError
from bridge.port import PASS_COUNTERS
from cachestore.entry import TooLarge

if TYPE_CHECKING:
    pass

TOTAL_COUNTERS = PASS_COUNTERS  # what the fleet metrics sum, per fleet and per worker
BATCH = 500  # keys per pipeline / page when streaming
READ_TIMEOUT = 30.0  # seconds for one batch of a report or an inspection: they are not on the compile path
READ_CONNECT_TIMEOUT = 2.0


# -- errors ---------------------------------------------------------------------------------------------
class TierError(NkiCacheError):
    """The tier could not do what was asked."""


class TierUnavailable(TierError):
    """The tier is down, unreachable, refusing, or out of memory."""


class BatchRefused(TierError):
    """The tier is up, but refused a metrics batch as invalid (`batch_problem`) and wrote nothing of it.
    Unlike the tier being down, sending the same batch again cannot succeed."""


class TierTimeout(TierError):
    """The tier did not answer within the operation timeout."""


class ConnectionsDropped(TierError):
    """A call failed because another call's operation timeout closed the connections it was using: not a fault
    of its own (that call counts the timeout), so it is retried like any write, without counting."""


class TierBusy(TierTimeout):
    """Another process held the store's lock for the whole wait (the embedded tier): contention between the
    processes of one machine, not an outage, so it never turns the tier off."""


# -- what moves through a backend ----------------------------------------------------------------------
class StoreRequest(msgspec.Struct, frozen=True):
    cache_key: str
    digest: str
    full: bytes  # the encoded entry
    kernel_name: str
    compile_seconds: float = 0.0  # what tracing it cost: the local tier ranks what it keeps by it
    ttl: int | None = None  # its own TTL (cachestore.value: grows with its value); None: the call's
    # Fields of the kernel's variant index (cachestore.variant_index) this store sets: how misses get a cause.
    index_fields: dict[bytes, bytes] = msgspec.field(default_factory=dict)


class KeyUsage(msgspec.Struct):
    kernel_name: str
    usage: int
    first_use: float
    last_use: float


class MetricsBatch(msgspec.Struct):
    """Counts from one pass (or part of one), applied to the fleet metrics exactly once by `batch_id`."""

    batch_id: str
    host: str
    worker: str
    totals: dict[str, float] = msgspec.field(default_factory=dict)
    kernel_calls: dict[str, int] = msgspec.field(default_factory=dict)
    keys: dict[str, KeyUsage] = msgspec.field(default_factory=dict)
    pass_record: dict[str, object] | None = None  # appended to the pass log when the pass ends
    # The id of the compiler that ran the pass (bridge.identity): its totals are also summed per toolchain.
    # Empty: a batch that names none, counted in the fleet's and the worker's totals only.
    toolchain: str = ""


# Counts and times a batch may carry: a double holds every integer up to 2**53 exactly, and sums of numbers
# this size cannot overflow to infinity (which Redis's HINCRBYFLOAT refuses half-way through a script).
MAX_BATCH_NUMBER = 2**53


def batch_problem(batch: MetricsBatch) -> str | None:
    """Why no tier may apply `batch`, or None. Every number must be finite and at most MAX_BATCH_NUMBER in
    size, and the ones summed with integer arithmetic (kernel calls, key usage) whole: one NaN would poison
    the fleet totals for good, and a backend that took it half-way could not apply the batch wholly or not
    at all. The Redis metrics script checks the same before it writes anything."""
    for name in ("batch_id", "host", "worker", "toolchain"):
        if not isinstance(getattr(batch, name), str):
            return f"{name} is {getattr(batch, name)!r}, not a string"
    for name in ("totals", "kernel_calls", "keys"):
        mapping = getattr(batch, name)
        if not isinstance(mapping, dict) or not all(isinstance(key, str) for key in mapping):
            return f"{name} is {mapping!r}, not a dict with string keys"
    # Checked in the compiling thread at every pass's end: where a number is, is spelled out only for a bad one.
    for name, value in batch.totals.items():
        if problem := number_problem(value):
            return f"totals[{name!r}] is {value!r}: {problem}"
    for name, value in batch.kernel_calls.items():
        if problem := number_problem(value, whole=True):
            return f"kernel_calls[{name!r}] is {value!r}: {problem}"
    for key, usage in batch.keys.items():
        if not isinstance(usage, KeyUsage) or not isinstance(usage.kernel_name, str):
            return f"keys[{key!r}] is {usage!r}, not a KeyUsage naming its kernel"
        for part, value, whole in (
            ("usage", usage.usage, True),
            ("first_use", usage.first_use, False),
            ("last_use", usage.last_use, False),
        ):
            if problem := number_problem(value, whole=whole):
                return f"keys[{key!r}].{part} is {value!r}: {problem}"
    if batch.pass_record is not None:
        if not isinstance(batch.pass_record, dict):
            return f"pass_record is {batch.pass_record!r}, not a dict"
        try:  # stored as JSON text, which has no NaN or infinity (json.dumps would write them all the same)
            json.dumps(batch.pass_record, allow_nan=False)
        except (TypeError, ValueError) as exc:
            return f"pass_record is not JSON of finite numbers: {exc}"
    return None


def number_problem(value: object, *, whole: bool = False) -> str | None:
    """Why `value` is no number a batch may carry, or None. A bool is not one: JSON tells them apart, and the
    Redis script would refuse it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "not a number"
    if isinstance(value, float) and not math.isfinite(value):
        return "not finite"
    if abs(value) > MAX_BATCH_NUMBER:
        return f"larger than {MAX_BATCH_NUMBER}"
    if whole and value != int(value):
        return "not a whole number"
    return None


def stored_number(value: object) -> float:
    """A number of the fleet metrics as a tier gives it back (bytes or text from Redis, any value SQLite
    holds) as a finite float; anything else, a word, NaN and the infinities included, counts as 0. Batches are
    checked before they are applied, but a tier written by an older build or by hand may hold such a value,
    and one must not fail every report of the fleet, nor every scrape of serve-metrics."""
    if isinstance(value, bytes | str):
        try:
            value = float(value)
        except ValueError:
            return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) else 0.0


CLOCK_SKEW_SECONDS = 86400.0  # how far ahead of the tier's clock a host's clock may run, generously


def pass_time(finished: object, appended: float) -> float:
    """When a pass-log record's pass ended: its `finished` when that is a time the pass can have ended at (a
    finite number from 1970 on, not after the record was appended, give or take a day of clock skew between
    hosts), else `appended`, when the tier appended the record. A NaN would misplace the whole timeline, and
    a time centuries away would stretch it past any date the report can print."""
    if (
        isinstance(finished, int | float)
        and not isinstance(finished, bool)
        and math.isfinite(finished)
        and 0 <= finished <= appended + CLOCK_SKEW_SECONDS
    ):
        return float(finished)
    return appended


class RawEntry(msgspec.Struct):
    """An entry as stored, still encoded."""

    cache_key: str
    data: bytes | TooLarge  # TooLarge: larger than the reader's max_entry_bytes, so not read
    ttl: float | None  # seconds left, None when the store keeps no expiry
    partition: str = ""  # the partition it is stored in (cachestore.keys.partition)


class KeyRecord(msgspec.Struct):
    """What the fleet metrics know about one cache key."""

    cache_key: str
    kernel_name: str
    usage: int
    first_use: float
    last_use: float


class WriteItem(msgspec.Struct):
    """An encoded entry for `Reader.put_entries`, written in the reader's partition."""

    cache_key: str
    data: bytes
    digest: str | None  # the binary's SHA-256 (None where unknown)
    ttl: float
    compile_seconds: float = 0.0  # from the entry: the local tier ranks what it keeps by it


# -- the protocols ----------------------------------------------------------------------------------------
class Backend(Protocol):
    """The compile path, in one partition (`partition`, `cachestore.keys.partition`: a toolchain's entries in one
    scope): entries and leases of another compiler, or of another scope, are never read or replaced."""

    description: str
    partition: str
    # True: the store keeps an entry for its TTL alone (Redis, a shared directory), so the client gives each entry
    # a TTL that grows with its value (cachestore.value) and refreshes a read entry's in the background. False:
    # the store ranks what it keeps itself (the local tier), and a read refreshes its entries to entry_ttl.
    value_ttls: bool = False

    def fetch(self, cache_keys: Sequence[str], ttl: int | None) -> dict[str, bytes | TooLarge]:
        """Encoded entries for the keys that have one (refreshing their TTL to `ttl`; None: reading only, as a
        read-only client does, which may not write). An
        entry over the backend's max_entry_bytes is not read: its TooLarge stands for it. On the compile path,
        so the call as a whole returns or raises TierTimeout within the operation timeout."""

    def store(self, requests: Sequence[StoreRequest], ttl: int) -> None:
        """Write entries, each whole."""

    def apply_metrics(self, batch: MetricsBatch) -> bool:
        """Apply a batch unless one with its id was applied already; True when applied now."""

    def read_variant_index(self, queries: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[bytes | None] | None]:
        """The values of each (kernel name, fields) in the variant index (cachestore.variant_index), None for a
        field not set, and None for a query the store could not answer (another type of key under the kernel's
        name); in one round trip, bounded by the operation timeout like fetch."""

    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        """On the compile path, like fetch: bounded as a whole by the operation timeout."""

    def release_lease(self, cache_key: str, owner: str) -> None: ...

    def refresh_ttls(self, items: Sequence[tuple[str, int]]) -> None:
        """Set each (cache key, TTL) entry's TTL, if it is still stored: the value-ranked TTL of an entry read
        (cachestore.value), sent in the background after the read's own refresh to entry_ttl."""

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> None:
        """release_lease for each (cache key, owner), in one round trip (per master on a cluster)."""

    def renew_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        """Extend the lease by `ttl` from now if `owner` still holds it; True when it did."""

    def lease_holder(self, cache_key: str) -> str | None:
        """On the compile path, like fetch: bounded as a whole by the operation timeout."""

    def abort_calls(self) -> None:
        """Make the calls in flight on other threads fail at once (a read blocked on a socket included), as the
        operation timeout does. A store whose calls never wait on a server has none to cut short."""
        return None

    def close(self) -> None: ...


class Reader(Protocol):
    """Reports, inspection and administration. Entries are read and written in one partition, `partition`
    (this compiler's trusted one unless opened for another); `in_partition` gives a reader of another."""

    description: str
    partition: str
    keeps_expired: bool  # True: entries past their expiry stay stored until purge_expired (SQLite)
    # True: the reader is a `PagedReader` (`pages_of`), whose scans other processes can share (Redis;
    # cachestore.scan_split)
    splits_scans: bool

    def entry_partitions(self) -> list[str]:
        """The partitions that hold entries, sorted."""

    def in_partition(self, partition: str) -> Self:
        """The same store, in the partition `partition`: by default a shallow copy sharing its connections and
        files (closing either closes both)."""
        other = copy.copy(self)
        other.partition = partition
        return other

    def entry_keys(self) -> Iterator[tuple[str, str]]:
        """(partition, cache key) of every live entry of every partition, streamed; no value is read."""

    # fleet metrics
    def totals(self) -> dict[str, float]: ...

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        """(host, worker, that worker's totals) for every worker that ever applied a batch."""

    def toolchains(self) -> dict[str, dict[str, float]]:
        """{toolchain id: its totals} for every toolchain whose passes applied a batch naming it."""

    def kernels(self) -> dict[str, dict[str, int]]:
        """{kernel name: {"call_count", "variants"}}, as `_export_new_nki_fe_metrics`, fleet-wide."""

    def key_usage(self) -> Iterator[tuple[str, int]]:
        """(cache key, usage) for every key the metrics know, streamed."""

    def key_count(self) -> int: ...

    def key_records(self, cache_keys: Sequence[str]) -> dict[str, KeyRecord]: ...

    def key_hosts(self, cache_keys: Sequence[str]) -> dict[str, list[str]]:
        """The hosts that used each key (keys no host used are left out)."""

    def pass_log_span(self, since: float | None) -> tuple[float, float] | None:
        """Timestamps of the first and last pass-log record at or after `since`."""

    def pass_log(self, since: float | None) -> Iterator[tuple[float, dict]]:
        """(time the pass ended, pass record), oldest first, streamed."""

    def zero_counters(self, record: dict) -> None:
        """Zero the fleet counters (totals, per worker, per toolchain) and log `record` (`report --zero`)."""

    # entries
    def scan_entries(self, with_ttl: bool = True) -> Iterator[RawEntry]:
        """Every live entry, streamed; `with_ttl=False` when the caller has no use for the time left."""

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        """Encoded entries, read without refreshing their TTL (looking does not keep an entry alive); one over
        the reader's max_entry_bytes as its TooLarge."""

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        """Cache keys that start with `prefix` (at most `limit`)."""

    def put_entries(self, items: Sequence[WriteItem]) -> None: ...

    def delete_entries(self, cache_keys: Sequence[str]) -> None:
        """Delete the entries of these cache keys (in this partition), where there are."""

    def capacity(self) -> dict[str, int | None] | None:
        """What the store holds against its size cap ({"file_bytes", "max_size"}), or None for a store with no
        size of its own to tell (Redis reports its memory itself)."""
        return None

    def expired_count(self) -> tuple[int, int]:
        """(entries past their expiry still stored, their bytes); (0, 0) unless `keeps_expired`."""

    def purge_expired(self) -> None: ...

    def close(self) -> None: ...


class Store(Backend, Reader, Protocol):
    """A whole store, both sides in one object: what a store module's `open_store` opens from a tier URL
    (cachestore.stores), and what the contract suite (cachestore.testing.contract) tests."""


class PagedReader(Reader, Protocol):
    """A reader whose scans can be split over processes (`splits_scans` is True): one process pages through the
    entry names, and any process reads a page (cachestore.scan_split)."""

    def entry_pages(self, every_partition: bool = False, size: int = BATCH) -> Iterator[list[str]]:
        """Pages of at most `size` entry names, of this partition (of every partition: `every_partition`), as
        one scan finds them; no value is read."""

    def read_entry_page(self, names: Sequence[str], with_ttl: bool = True) -> list[RawEntry]:
        """The entries of a page of `entry_pages` still stored, in this process or a forked one."""


def pages_of(reader: Reader) -> TypeGuard[PagedReader]:
    """Whether `reader` is a `PagedReader`, as it declares (`splits_scans`)."""
    return reader.splits_scans


def batched(items: Iterable, size: int = BATCH) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
