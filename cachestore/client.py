"""The tier as the codegen loop sees it (it implements `bridge.port.KernelStore`): verified reads,
write-behind mirroring, single flight, and fault handling that never lets the tier fail or stall a compile.

The client turns what the loop hands it (trace results, key components, pass records) into entries and
metrics batches; backends (`cachestore.backends`) only move the encoded bytes.

Reads happen on the compiling thread, bounded by the operation timeout. Writes (entries, lease releases,
TTL refreshes, metrics batches) go to the write-behind (cachestore.write_behind), whose thread encodes and sends
them; every store call goes through the guard (cachestore.guard), whose breaker keeps a failed tier off for
`breaker_cooldown` seconds. A metrics batch no tier would take (a NaN, a count that is not a number) is
never queued, and one a tier refuses anyway (`BatchRefused`) is no failure of the tier: both are dropped
and counted in tier_dropped, and the breaker stays closed.

Read-only is a wrapper of it (cachestore.read_only).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import msgspec

from bridge.identity import toolchain_id
from bridge.klir import VERSION_IDENTIFIERS
from bridge.miss_causes import VariantFacts, facts_of_stored, merged_facts
from bridge.port import TIER_COUNTERS, KernelStore, PassRecord, StoredTrace
from cachestore.api import (
    Backend,
    KeyUsage,
    MetricsBatch,
    StoreRequest,
    TierError,
    batch_problem,
)
from cachestore.breaker import Breaker
from cachestore.credentials import Credentials, settings_credentials
from cachestore.entry import (
    FAILED,
    MAX_FAILURE_BYTES,
    Entry,
    EntryRejected,
    SignaturePolicy,
    TooLarge,
    decode_entries,
    encode_entry,
    open_stored,
    payload_problem,
)
from cachestore.guard import Guard
from cachestore.keys import partition
from cachestore.leases import LeaseKeeper
from cachestore.rejections import RejectionLog
from cachestore.settings import Settings
from cachestore.value import ValueMedian, entry_value
from cachestore.variant_index import facts, query_fields, stored_fields
from cachestore.write_behind import GROUPED, Item, LeaseRelease, PendingStore, TtlRefresh, UnbuiltBatch, WriteBehind

logger = logging.getLogger(__name__)
LEASE_POLL_SECONDS = 0.05


class TierStats:
    """Thread-safe counters of what the tier did for this process."""

    # What a pass reports (TIER_COUNTERS), lookups skipped while the breaker was open, batches applied, and
    # verified entries handed to the loop (a stacked tier reports them per level: `level_hits`).
    NAMES = (*TIER_COUNTERS, "tier_skipped", "metrics_applied", "entries_found")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.NAMES, 0)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class EntryReads(KernelStore):
    """The port's reads made of a tier's `find_many` and `wait_for_entry`: one key is a batch of one, and each
    entry is handed to the loop as its trace."""

    def find_many(self, cache_keys: list[str]) -> tuple[dict[str, Entry], set[str]]:
        raise NotImplementedError

    def wait_for_entry(self, cache_key: str) -> Entry | None:
        raise NotImplementedError

    def lookup(self, cache_key: str) -> Entry | None:
        """The verified entry for `cache_key`, or None (miss, rejected, or the tier is unavailable)."""
        return self.find_many([cache_key])[0].get(cache_key)

    def find_traces(self, cache_keys: Sequence[str]) -> tuple[dict[str, StoredTrace], set[str]]:
        """The port's read: `find_many`, each entry as the trace the loop takes from it."""
        entries, held = self.find_many(list(cache_keys))
        return {key: stored_trace(entry) for key, entry in entries.items()}, held

    def wait_for_trace(self, cache_key: str) -> StoredTrace | None:
        entry = self.wait_for_entry(cache_key)
        return None if entry is None else stored_trace(entry)


class TierClient(EntryReads):
    """One per process; shared by every pass the process runs."""

    def __init__(
        self,
        backend_factory: Callable[[], Backend],
        settings: Settings,
        description: str = "tier",
        credentials: Credentials | None = None,
        toolchain: str | None = None,
    ):
        """`credentials`: the writer key, trust policy and scope (default: loaded from the settings; the backend
        must work in `partition(toolchain, credentials.scope)`, as open_tier's does). `toolchain`: the compiler
        whose entries this client reads and writes (default: this package's, bridge.identity; another for a
        foreign loop attached by workers.attach)."""
        self.settings = settings
        self.description = description
        self.stats = TierStats()
        self._rejections = RejectionLog(description)
        self.owner = f"{settings.host}:{settings.worker}:{uuid.uuid4().hex[:8]}"
        self.toolchain = toolchain or toolchain_id()
        self.credentials = credentials or settings_credentials(settings)
        self.writer = self.credentials.writer
        self.policy = SignaturePolicy(
            settings.hmac_key, settings.require_signed, settings.reject_unverifiable, self.credentials.trust
        )
        self._breaker = Breaker(settings.breaker_cooldown, lambda: self._outbox.wake())
        self._guard = Guard(backend_factory, self._breaker, self.stats.add, description)
        self._outbox = WriteBehind(
            send=self._send,
            prepare=self._prepare,
            before_send=self._collect_touched,
            close_store=self._close_backend,
            breaker=self._breaker,
            flush_interval=settings.flush_interval,
            limit=settings.outbox_limit,
            dropped=partial(self.stats.add, "tier_dropped"),
        )
        self._silent_holders: set[str] = set()  # lease holders that let a wait run out (dead, most likely)
        self._leases = LeaseKeeper(self._renew_lease, settings.lease_ttl)
        # Entries served and stored per writer key id since the last pass record, sent with it (report per writer).
        self._writer_counts: collections.Counter[str] = collections.Counter()
        self._writer_lock = threading.Lock()
        self._values = ValueMedian()
        # Entries a read found on Redis, whose TTLs the flusher refreshes (`_collect_touched`): (cache key, compile
        # seconds, stored bytes). A deque: appended by the compiling thread without a lock or a wake-up, taken by
        # the flusher.
        self._touched: collections.deque[tuple[str, float, int]] = collections.deque(maxlen=settings.outbox_limit)

    def __repr__(self) -> str:
        return f"TierClient({self.description}, mode={self.settings.tier_mode})"

    writes = True

    @property
    def reads(self) -> bool:
        return self.settings.tier_mode != "mirror"

    @property
    def single_flight(self) -> bool:
        return self.settings.single_flight

    @property
    def _value_ttls(self) -> bool:
        """The store's `value_ttls` (cachestore.api.Backend), asked of it once open: what depends on it runs on the
        open backend (a read's lambda, `_touch` after a read, a send, which opens it first: `_send`)."""
        return self._backend is not None and self._backend.value_ttls

    def _refresh_ttl(self, refresh: bool) -> int | None:
        """The TTL a read asks the backend to give back to the entries it finds as it reads them; None: none asked
        (`refresh` off), or a store with value TTLs, whose entries' TTLs are refreshed in the background instead
        (`_touch`), so that a hit costs one command."""
        return self.settings.entry_ttl if refresh and not self._value_ttls else None

    def counts(self) -> dict[str, int]:
        return self.stats.snapshot()

    @property
    def _partition(self) -> str:
        """Where this client's entries are: its toolchain's partition in its scope (cachestore.keys)."""
        return partition(self.toolchain, self.credentials.scope)

    @property
    def available(self) -> bool:
        """False while the breaker keeps the tier off after a failure, or another call is probing it."""
        return self._breaker.available()

    @property
    def failed(self) -> bool:
        """True while the breaker keeps the tier off after a failure (breaker_cooldown). Unlike `available`, not
        while another call is merely probing it: the first call to a tier not proven yet is no failure."""
        return self._breaker.is_open()

    def overdue(self, caller: int, patience: float) -> bool:
        """Whether thread `caller`'s call to the store has waited past `patience` (cachestore.guard): a store
        that takes calls and does not answer (a frozen server) is seen here long before the call times out."""
        return self._guard.overdue(caller, patience)

    def give_up(self, why: str) -> None:
        """The tier failed in a caller's eyes (it left a call unanswered for longer than the caller can wait):
        counted as a timeout, not asked again for breaker_cooldown, and the calls waiting on it cut short."""
        self._guard.give_up(why)

    def level_hits(self) -> dict[str, int]:
        """{this tier: verified entries it answered so far}: one level (cachestore.stacked has several)."""
        return {self.description: self.stats.snapshot()["entries_found"]}

    @property
    def _backend(self) -> Backend | None:
        """The store, once the guard opened it."""
        return self._guard.store

    # -- reads ------------------------------------------------------------------------------------
    def find_many(self, cache_keys: list[str], refresh: bool = True) -> tuple[dict[str, Entry], set[str]]:
        """(verified entries, the keys the tier held anything under, rejected or not), in one round trip. The tier
        being unavailable looks like all misses. An entry over max_entry_bytes is not downloaded: the backend says
        its size, and it is rejected and counted. Their writers' signatures, for a reader with a trust policy, are
        checked in one loop (cachestore.entry.decode_entries). `refresh`: give the entries found their TTL back (a
        reader that may not write does not)."""
        if not cache_keys:
            return {}, set()
        # (While the breaker is open a read is a miss, as ever: the outbox is no cache for an outage.)
        own = self._own_unsent(cache_keys) if self._outbox.has_unsent and self._breaker.available() else {}
        if own:
            cache_keys = [key for key in cache_keys if key not in own]
            if not cache_keys:
                self.stats.add("entries_found", len(own))
                return own, set(own)
        ok, found = self._guard.call(lambda b: b.fetch(cache_keys, self._refresh_ttl(refresh)), "lookup")
        if not ok or found is None:
            return own, set(own)
        entries = own
        decoded = decode_entries(found, self.policy, self.settings.max_entry_bytes)
        for key, data in found.items():
            entry = self._decoded(key, data, decoded[key])
            if entry is not None:
                if refresh:
                    self._touch(key, entry, data)
                entries[key] = entry
        held = set(found) | set(own)
        for key in [key for key, entry in entries.items() if entry.format == FAILED and not self._failure_known(entry)]:
            del entries[key]  # traced again: to this pass the failure was never there
            held.discard(key)
        self._count_found(entries.values())
        return entries, held

    def _failure_known(self, entry: Entry) -> bool:
        """Whether a negative entry still stands: failure_ttl from when it was stored (its own time, which no
        store's TTL refresh extends), and retry_failed not asked."""
        return not self.settings.retry_failed and time.time() < entry.created + self.settings.failure_ttl

    def _count_found(self, entries: Collection[Entry]) -> None:
        """Entries handed to the loop: counted, and per writer that signed them."""
        served = [f"writer_served:{entry.writer}" for entry in entries if entry.writer]
        if served:  # (no lock taken for entries no writer signed)
            self._count_writers(served)
        self.stats.add("entries_found", len(entries))

    def _own_unsent(self, cache_keys: Sequence[str]) -> dict[str, Entry]:
        """The entries of `cache_keys` this client queued and has not stored yet: its own traces (or copies it
        verified when it read them), so nothing to verify; the tier will hold them once the flusher sends them."""
        own = {}
        for key in cache_keys:
            pending = self._outbox.unsent(key)
            if pending is not None:
                own[key] = pending.built()
        return own

    def _count_writers(self, names: Iterable[str]) -> None:
        with self._writer_lock:
            self._writer_counts.update(names)

    def _touch(self, cache_key: str, entry: Entry, data: bytes | TooLarge) -> None:
        """A read found this entry on a store with value TTLs (Redis): its TTL is refreshed in the background, to
        entry_ttl or, for one worth more than the usual entry, longer. Only an append here: the flusher computes
        the TTLs and sends them together (`_collect_touched`)."""
        if not self._value_ttls or entry.format == FAILED:  # a negative entry keeps its own short TTL
            return
        self._touched.append((cache_key, entry.compile_seconds, len(data)))
        self._outbox.start()

    def _collect_touched(self) -> None:
        """The TTL refreshes of the entries read since the last call, queued as TtlRefresh (one per key, its
        longest TTL), to go out with the next send in one pipeline."""
        ttls: dict[str, int] = {}
        base = self.settings.entry_ttl
        while True:
            try:  # the flusher and a flush() may both be taking
                key, seconds, size = self._touched.popleft()
            except IndexError:
                break
            ttl = self._values.ttl(base, entry_value(seconds, 1, size))
            ttls[key] = max(ttl, ttls.get(key, 0))
        if ttls:
            self._outbox.put_all(TtlRefresh(key, ttl) for key, ttl in ttls.items())

    def _decoded(self, cache_key: str, data: bytes | TooLarge, entry: Entry | EntryRejected) -> Entry | None:
        """A decoded entry (or the EntryRejected that stands for it) handed on: a rejection counted and logged, an
        unverified entry counted, its stored bytes kept."""
        if isinstance(entry, EntryRejected):
            self.reject(cache_key, entry.reason)
            return None
        if entry.unverified:
            self.stats.add("tier_unverified")  # accepted on its digest alone (reject_unverifiable is off)
        if isinstance(data, bytes):
            entry.stored = data
        return entry

    def variant_facts(self, misses: Mapping[str, Mapping[str, Any]]) -> dict[str, VariantFacts] | None:
        """What the variant index knows of each missed cache key (its key components given), in one round
        trip; None when the index cannot be read (a tier failure, counted and opening the breaker as any)."""
        if not misses:
            return None
        queries = {key: query_fields(key, components, self._partition) for key, components in misses.items()}
        ok, answers = self._guard.call(lambda b: b.read_variant_index(list(queries.values())), "variant index")
        if not ok or answers is None:
            return None
        found = {
            key: facts(values, self._partition)
            for key, values in zip(queries, answers, strict=True)
            if values is not None
        }
        return self._with_own_unsent(misses, found)

    def _with_own_unsent(
        self, misses: Mapping[str, Mapping[str, Any]], found: dict[str, VariantFacts]
    ) -> dict[str, VariantFacts]:
        """`found` with what this client queued and has not stored yet counted as in the index, as its reads
        count those entries as held: a pass's miss causes do not depend on how far the write-behind got."""
        queued = {key: entry.key_components for key, entry in self._outbox.unsent_entries().items()}
        if not queued:
            return found
        for key in found:  # (a key the index could not say anything of stays unknown)
            found[key] = merged_facts(found[key], facts_of_stored(key, misses[key], queued))
        return found

    def reject(self, cache_key: str, reason: str) -> bool:
        self.stats.add("tier_rejected")
        self._rejections.add(cache_key, reason)
        return False  # one store: a read would hand the same entry over again

    # -- single flight ----------------------------------------------------------------------------
    def acquire_lease(self, cache_key: str) -> bool:
        """True when this process should trace `cache_key` (it holds the lease, or the tier cannot say)."""
        ttl = self.settings.lease_ttl
        ok, acquired = self._guard.call(lambda b: b.acquire_lease(cache_key, self.owner, ttl), "lease")
        if ok and acquired:
            self._leases.hold(cache_key)  # renewed while this process traces, left to lapse if it dies
        return (not ok) or bool(acquired)

    def _renew_lease(self, cache_key: str) -> None:
        self._guard.call(lambda b: b.renew_lease(cache_key, self.owner, self.settings.lease_ttl), "lease renewal")

    def wait_for_entry(self, cache_key: str) -> Entry | None:
        """Wait (bounded) for another worker's trace of `cache_key`; None when it does not come."""
        deadline = time.monotonic() + self.settings.lease_wait
        holder = None
        while time.monotonic() < deadline and self._breaker.available():
            entries, held = self.find_many([cache_key])
            if entries or held:
                return entries.get(cache_key)  # an entry there but rejected will not get better by waiting
            ok, holder = self._guard.call(lambda b: b.lease_holder(cache_key), "lease")
            if ok and holder is None:
                # The holder finished without publishing (failed) or died: look once more, then trace.
                entry = self.lookup(cache_key)
                if entry is None:
                    logger.info(
                        "lease on %s... lapsed without a trace (its holder failed or died); taken over", cache_key[:16]
                    )
                return entry
            if ok and holder in self._silent_holders:
                return None  # it already let a wait run out: it is gone, do not wait on its leases again
            time.sleep(LEASE_POLL_SECONDS)
        if holder is not None:
            self._silent_holders.add(holder)
            logger.warning(
                "lease holder %s of %s... did not trace within lease_wait (%g s); taken over, and "
                "its other leases are not waited on",
                holder,
                cache_key[:16],
                self.settings.lease_wait,
            )
        return None

    # -- writes (write-behind) --------------------------------------------------------------------
    def publish(self, cache_key: str, entry: Entry, release_lease: bool = False) -> None:
        self._publish(PendingStore(cache_key, lambda: entry), release_lease)

    def publish_copy(self, cache_key: str, entry: Entry) -> None:
        """Keep a copy of an entry another tier handed over (a stack's farther level): its stored bytes as they
        are, so the writer's signature over them still verifies here (this client's own key, or none, would
        re-sign it, and a trust policy would then refuse it); an entry without them is encoded anew."""
        if entry.stored is None:
            self.publish(cache_key, entry)
            return
        stored = entry.stored
        pending = PendingStore(cache_key, lambda: entry)
        index = stored_fields(cache_key, entry.key_components, self._partition)
        pending.request = StoreRequest(
            cache_key,
            entry.digest,
            stored,
            str(entry.key_components.get("kernel_name", "")),
            entry.compile_seconds,
            None,
            index,
        )
        pending.prepared = True
        self._outbox.put(pending)

    def _publish(self, pending: PendingStore, release_lease: bool) -> None:
        """Queue the entry (it is encoded on the flusher thread), then the lease release, in that order."""
        self._outbox.put(pending, wake=False)
        if release_lease:
            self.release_lease(pending.cache_key)

    def _prepare(self, pending: PendingStore) -> StoreRequest | None:
        """On the flusher thread: the entry built and encoded, or None when it is over max_entry_bytes or its
        payload is one readers refuse unread (cachestore.entry.payload_problem); a writer's entry is signed."""
        if not pending.prepared:
            entry = pending.built()
            full = encode_entry(entry, self.settings.hmac_key, self.writer, pending.cache_key)
            if entry.format == FAILED:  # a negative entry: its own short TTL, and no variant index (nothing stored)
                pending.request = StoreRequest(
                    pending.cache_key, entry.digest, full, "", 0.0, self.settings.failure_ttl, {}
                )
                pending.prepared = True
                return pending.request
            size = len(full)
            problem = payload_problem(open_stored(full)[1], self.settings.max_entry_bytes)
            if size > self.settings.max_entry_bytes:
                logger.warning(
                    "entry %s... of %d bytes exceeds max_entry_bytes; not mirrored", pending.cache_key[:16], size
                )
            elif problem is not None:  # stored, every reader would refuse it: a miss each time, and a counted rejection
                logger.warning("entry %s... not mirrored, readers would refuse it: %s", pending.cache_key[:16], problem)
            else:
                kernel_name = str(entry.key_components.get("kernel_name", ""))
                index = stored_fields(pending.cache_key, entry.key_components, self._partition)
                pending.request = StoreRequest(
                    pending.cache_key, entry.digest, full, kernel_name, entry.compile_seconds, None, index
                )
                pending.value = entry_value(entry.compile_seconds, 1, size)
            pending.prepared = True
        return pending.request

    def publish_trace(
        self,
        cache_key: str,
        result: dict,
        key_components: Mapping[str, Any],
        compile_seconds: float,
        release_lease: bool = False,
    ) -> None:
        """The port's write: the entry for a kernel the loop traced, produced by this host and worker. The
        compiling thread only copies what the entry needs and queues it: the Entry (the binary's SHA-256) and
        its encoding (compression, the stored bytes' SHA-256 and HMAC) are made on the flusher thread."""
        if self.writer is not None:
            self._count_writers([f"writer_stored:{self.writer.key_id_hex}"])
        build = partial(
            Entry,
            binary=result["binary"],
            input_names=list(result["input_names"]),
            output_names=list(result["output_names"]),
            format=result["format"],
            version_identifier=VERSION_IDENTIFIERS[result["format"]],
            key_components=dict(key_components),
            producer_host=self.settings.host,
            producer_worker=self.settings.worker,
            created=time.time(),
            compile_seconds=compile_seconds,
            toolchain=self.toolchain,  # the compiler that traced it: this one
        )
        self._publish(PendingStore(cache_key, build), release_lease)

    def publish_failure(
        self, cache_key: str, key_components: Mapping[str, Any], message: str, release_lease: bool = False
    ) -> None:
        """The port's negative entry: the kernel failed to compile with this compiler, for this one-line reason.
        It lives failure_ttl, signed like any entry; passes that meet it fail at once with the same message."""
        text = message.encode()[:MAX_FAILURE_BYTES].decode(errors="ignore")
        build = partial(
            Entry,
            binary=text.encode(),
            input_names=[],
            output_names=[],
            format=FAILED,
            version_identifier=FAILED,
            key_components=dict(key_components),
            producer_host=self.settings.host,
            producer_worker=self.settings.worker,
            created=time.time(),
            toolchain=self.toolchain,
        )
        self._publish(PendingStore(cache_key, build), release_lease)

    def release_lease(self, cache_key: str) -> None:
        """Queue the release of a lease this process holds; one it never got (the tier could not say, so it traced
        without) has nothing to release, and no write is queued, or counted as dropped on a tier that is down."""
        if self._leases.drop(cache_key):
            self._outbox.put(LeaseRelease(cache_key, self.owner), wake=False)

    def record(self, batch: MetricsBatch) -> None:
        """Queue a metrics batch, unless no tier would take it (a NaN, a count that is not a number): that one
        is dropped here with one warning, and counted in tier_dropped (a write that never reaches the tier,
        like the outbox's own drops). Queued, it would only be refused by the tier."""
        if not self._dropped_invalid(batch):
            self._outbox.put(batch)

    def _dropped_invalid(self, batch: MetricsBatch) -> bool:
        """Drop `batch` with one warning, counted in tier_dropped, when no tier would take it."""
        problem = batch_problem(batch)
        if problem is not None:
            self.stats.add("tier_dropped")
            logger.warning("metrics batch %s not sent to tier %s: %s", batch.batch_id, self.description, problem)
        return problem is not None

    def record_pass(self, record: PassRecord) -> None:
        """The port's pass record, as one metrics batch applied once by the pass's id. The pass's end: nothing more
        is coming soon, so what it traced is sent at once (`send_now`) instead of gathering; this does not wait for
        it (a caller that needs the pass stored, e.g. before acknowledging a job, calls `flush`)."""
        writers: dict[str, int] = {}
        if self._writer_counts:
            with self._writer_lock:
                writers = dict(self._writer_counts)  # fields WRITER_COUNTERS:KEYID, beside the pass's counters
                self._writer_counts.clear()
        self._outbox.put(UnbuiltBatch(record, writers))  # made into its metrics batch on the flusher
        self.send_now()

    def send_now(self) -> None:
        """Have the flusher send what is queued without waiting out flush_interval, when it holds what other
        processes may wait for (entries, lease releases); returns at once. A pass that only read leaves its
        metrics batch to the flusher's timer, which sends the batches of the passes meanwhile in one wake-up: a
        send at every warm pass's end would contend with the next pass for the GIL and the tier."""
        self._outbox.send_now()

    def _send(self, group: list[Item]) -> bool:
        head = group[0]
        if isinstance(head, GROUPED):
            # The entries first, then the releases: a waiter woken by a release finds the entry it waited for.
            stores = [item for item in group if isinstance(item, PendingStore)]
            if stores and not self._guard.open():  # opened first: its `value_ttls` decides the entries' TTLs
                return False
            for pending in stores:
                self._prepare(pending)
                if pending.value is not None and pending.request is not None:
                    if self._value_ttls:  # a TTL that grows with its value (cachestore.value); else the call's
                        ttl = self._values.ttl(self.settings.entry_ttl, pending.value)
                        pending.request = msgspec.structs.replace(pending.request, ttl=ttl)
                    pending.value = None
            requests = [pending.request for pending in stores if pending.request is not None]
            ok = True
            if requests:  # (none when every one was too large: warned and dropped)
                ok = self._store(requests)
            releases = [(item.cache_key, item.owner) for item in group if isinstance(item, LeaseRelease)]
            if ok and releases:
                ok, _ = self._guard.call(lambda b: b.release_leases(releases), "lease release")
            refreshes = [(item.cache_key, item.ttl) for item in group if isinstance(item, TtlRefresh)]
            if ok and refreshes:
                ok, _ = self._guard.call(lambda b: b.refresh_ttls(refreshes), "TTL refresh")
        else:
            if isinstance(head, UnbuiltBatch):  # (record() checked a batch handed over whole)
                batch = self._made(head)
                if self._dropped_invalid(batch):
                    return True
            else:
                batch = head
            ok, applied = self._guard.call(lambda b: b.apply_metrics(batch), "metrics")
            if ok and applied:
                self.stats.add("metrics_applied")
        return ok

    def _store(self, requests: list[StoreRequest]) -> bool:
        return self._guard.call(lambda b: b.store(requests, self.settings.entry_ttl), "store")[0]

    def _made(self, unbuilt: UnbuiltBatch) -> MetricsBatch:
        """A pass record made into its metrics batch, once (a send retried after an outage applies the same id)."""
        if unbuilt.made is None:
            unbuilt.made = metrics_batch(unbuilt.record, self.settings.host, self.settings.worker, self.toolchain)
            unbuilt.made.totals.update(unbuilt.writer_counts)
        return unbuilt.made

    def flush(self, timeout: float | None = None, *, through_outage: bool = False) -> bool:
        """Wait until the outbox is empty, at most `timeout` seconds (default final_flush_timeout). While the tier
        is down it gives up at once, unless `through_outage` and the breaker closes before the deadline."""
        wait = self.settings.final_flush_timeout if timeout is None else timeout
        return self._outbox.flush(wait, through_outage=through_outage)

    def pending(self) -> int:
        return self._outbox.pending()

    def close(self, timeout: float | None = None) -> None:
        """Flush and stop the write-behind within `timeout` seconds in all (default final_flush_timeout), count
        what could not be delivered, close the backend: here once the flusher has stopped, else by the flusher
        itself as it stops (a send cut off by the deadline is never followed by a close under it)."""
        self._leases.stop()
        # A tier that is there (it answered, or took a call and was slow: a paused server) may deliver once its
        # cooldown ends; one that refused every connection is down, and waiting would only make the exit late.
        wait = self.settings.final_flush_timeout if timeout is None else timeout
        stopped = self._outbox.close(wait, through_outage=self._breaker.reachable)
        self._rejections.log_summary()
        if stopped:
            self._close_backend()
        else:
            logger.warning(
                "tier %s: the flusher was still sending when closed; it closes the backend when done", self.description
            )

    def _close_backend(self) -> None:
        if self._backend is not None:
            with contextlib.suppress(TierError):
                self._backend.close()


def stored_trace(entry: Entry) -> StoredTrace:
    return StoredTrace(entry.trace_result(), entry.compile_seconds, entry.key_components, entry.toolchain)


def metrics_batch(record: PassRecord, host: str, worker: str, toolchain: str) -> MetricsBatch:
    """One batch per pass. Its id is the pass's id (a fresh one unless the caller named the pass): applying
    it twice (a retried flush) counts once, and the fleet names a pass after its job, so a job compiled to
    the end twice (reclaimed from a worker that was slow, not dead) still counts once."""
    kernel_calls: dict[str, int] = defaultdict(int)
    keys = {}
    for cache_key, use in record.variants.items():
        kernel_calls[use.kernel_name] += use.usage
        keys[cache_key] = KeyUsage(use.kernel_name, use.usage, use.first_use, use.last_use)
    pass_id = record.pass_id or uuid.uuid4().hex
    # `toolchain`: the compiler that ran the pass; reports break the fleet down by it.
    log_record = {
        "pass_id": pass_id,
        "graph": record.graph_name,
        "host": host,
        "worker": worker,
        "toolchain": toolchain,
        "started": record.started,
        "finished": record.finished,
        **record.counts,
    }
    if record.kernel_misses:  # the report's misses by cause per kernel, over time
        log_record["kernel_misses"] = record.kernel_misses
    return MetricsBatch(pass_id, host, worker, dict(record.counts), dict(kernel_calls), keys, log_record, toolchain)
