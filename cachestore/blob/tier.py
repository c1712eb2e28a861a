"""The tier on any blob store (cachestore.blob.contract), written once: entries with their TTLs, leases, the
variant index, fleet metrics folded from one blob per batch, and the reader side of reports and inspection. The
shared folder (`dir:`) and S3 (`s3://`) are such stores. In the store (names are hex or SHA-256 digests: no key,
partition or kernel name can name a blob outside its folder):

    nkicache-dir-store                    marker: what tells an nkicache tier from any other store
    entries/<hex partition>/<hex key>     an encoded entry as stored; its blob's expiry is the entry's
    leases/<hex partition>/<hex key>/<n>  generation n of the key's lease (cachestore.blob.leases)
    variants/<sha256 kernel>              the kernel's fields of the variant index, msgpack {field: [value,
                                          expiry]}; the blob expires with its last field
    batches/<sha256 batch id>             an applied metrics batch (cachestore.blob.metrics_fold), never rewritten

A kernel's fields are one blob so that a plan reads one blob per kernel, not one per variant and field (a GET
each on S3). Writers of one kernel at once may drop each other's fields: the index only names why a key
missed and which variants a plan may leave to another process, so a lost field costs a trace, never a wrong
binary. Expired blobs stay until `purge_expired` (inspect gc) deletes them, with the lease generations older
than `lease_ttl`, anything planted, and whatever lies where no name of this layout goes (layout 1's index/
folder, of one blob per field, included).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator, Sequence

import msgspec

from bridge.identity import toolchain_id
from cachestore import api
from cachestore.blob.contract import NEVER, Blob, BlobStore
from cachestore.blob.leases import BlobLease
from cachestore.blob.metrics_fold import FoldedMetrics, batch_record, zero_record
from cachestore.entry import MAX_ENTRY_BYTES, TooLarge

# The name the first blob store (dir:) gave its marker, kept so that the tiers it made still open.
MARKER = "nkicache-dir-store"
MARKER_TEXT = b"nkicache shared directory tier, layout 1\n"
MAX_NAME_BYTES = 120  # a key or partition of at most this many bytes: its hex name fits in any file system's 255
TTL_REFRESH_FRACTION = 0.9  # as the local tier: an entry read is given its TTL again once 10% of it is used up
# Bytes read of a kernel's variants blob or a batch at most. A variants blob grown past it reads as empty, and
# the next write of that kernel's fields starts it afresh.
MAX_SMALL_BLOB = 1 << 20
READ_PAGE = 100  # entries read in one get while scanning
MAX_KNOWN_EXPIRIES = 65536  # expiries of entries read kept for refresh_ttls, forgotten all at once past this
# The parts of a name in each folder; 0: a folder whose every blob is gc's (layout 1's variant index).
DEPTH = {"entries": 3, "variants": 2, "leases": 4, "batches": 2, "index": 0}
Fields = dict[bytes, tuple[bytes, float]]  # a kernel's variant-index fields: {field: (value, expiry)}
_FIELDS = msgspec.msgpack.Decoder(Fields)


def _hex(text: str) -> str:
    raw = text.encode()
    if len(raw) > MAX_NAME_BYTES:
        raise api.TierError(f"a name of {len(raw)} bytes; a blob tier takes keys and toolchains of {MAX_NAME_BYTES}")
    return raw.hex() or "-"


def _unhex(name: str) -> str | None:
    """The text a name stands for; None for a name this tier did not make (skipped)."""
    try:
        return "" if name == "-" else bytes.fromhex(name).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def _sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _misplaced(blob: Blob) -> bool:
    """Whether the blob, in one of the layout's folders, is planted or lies where no name of it goes: gc's."""
    return blob.planted is not None or blob.name.count("/") + 1 != DEPTH[blob.name.partition("/")[0]]


class BlobTier(FoldedMetrics, api.Backend, api.Reader):
    """A tier in a blob store: the compile path (Backend) and the reader side (Reader)."""

    value_ttls = True  # an entry stays for its TTL alone
    keeps_expired = True  # expired blobs stay until purge_expired (inspect gc)
    splits_scans = False  # scanned in one process (cachestore.scan_split)

    def __init__(
        self,
        blobs: BlobStore,
        *,
        create: bool = True,
        writable: bool = True,
        partition: str | None = None,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        lease_ttl: float = 6.0,
    ) -> None:
        """`create`: the marker is written if missing. `partition`: the partition of entries and leases (default:
        this compiler's). Entries over `max_entry_bytes` are not read. A lease lives `lease_ttl` seconds from
        its blob's creation at most. A store holding blobs and no marker (or another's) is refused."""
        self.blobs = blobs
        self.description = blobs.description
        self.partition = partition or toolchain_id()
        self.max_entry_bytes = max_entry_bytes
        self.lease_ttl = lease_ttl
        self.writable = writable  # False: every write raises TierError
        self._records: dict[str, dict | None] = {}
        self._expiries: dict[str, float] = {}  # of the entries this tier read or refreshed: by key
        marker = self._marker()
        if marker is None and create and writable:
            marker = MARKER_TEXT if blobs.create(MARKER, MARKER_TEXT, NEVER) else self._marker()
        if marker is None and (writable or next(blobs.list(""), None) is None):
            if writable:
                raise api.TierUnavailable(f"{self.description} holds no nkicache tier")
            return  # a read-only client of a tier not made yet: an empty tier
        if marker != MARKER_TEXT:
            raise api.TierUnavailable(f"{self.description} is no nkicache tier (its {MARKER} is missing or foreign)")

    def _marker(self) -> bytes | TooLarge | None:
        found = self.blobs.get([MARKER], len(MARKER_TEXT)).get(MARKER)
        return None if found is None else found[1]

    def __repr__(self) -> str:
        return f"BlobTier({self.description!r}, partition {self.partition})"

    def _writing(self) -> BlobStore:
        if not self.writable:
            raise api.TierError(f"{self.description} is opened read-only")
        return self.blobs

    def _entry(self, cache_key: str) -> str:
        return f"entries/{_hex(self.partition)}/{_hex(cache_key)}"

    def _entries(self, cache_keys: Sequence[str]) -> dict[str, tuple[Blob, bytes | TooLarge]]:
        """The live entries of these keys (and whatever was planted under their names), by key."""
        names = {self._entry(key): key for key in cache_keys if len(key.encode()) <= MAX_NAME_BYTES}
        now, found = time.time(), self.blobs.get(list(names), self.max_entry_bytes)
        return {names[name]: read for name, read in found.items() if read[0].planted or read[0].expires > now}

    # -- the compile path -------------------------------------------------------------------------
    def fetch(self, cache_keys: Sequence[str], ttl: int | None) -> dict[str, bytes | TooLarge]:
        found = self._entries(cache_keys)
        if len(self._expiries) > MAX_KNOWN_EXPIRIES:
            self._expiries.clear()
        self._expiries.update((key, blob.expires) for key, (blob, data) in found.items() if isinstance(data, bytes))
        if ttl is not None and self.writable:
            self.refresh_ttls([(key, ttl) for key, (_, data) in found.items() if isinstance(data, bytes)])
        return {key: data for key, (_, data) in found.items()}

    def store(self, requests: Sequence[api.StoreRequest], ttl: int) -> None:
        now = time.time()
        entries = [(self._entry(r.cache_key), r.full, now + (r.ttl or ttl)) for r in requests]
        fields: dict[str, Fields] = {}
        for request in requests:
            kernel = fields.setdefault(request.kernel_name, {})
            kernel.update((name, (value, now + ttl)) for name, value in request.index_fields.items())
        self._writing().put(entries + self._merged_variants(fields, now))

    def _merged_variants(self, new: dict[str, Fields], now: float) -> list[tuple[str, bytes, float]]:
        """The variant blobs of these kernels, their stored fields (live ones) with the new ones over them."""
        names = {f"variants/{_sha(kernel)}": kernel for kernel in new if new[kernel]}
        stored = self._variants(list(names), now)
        merged = [(name, (stored.get(name) or {}) | new[kernel]) for name, kernel in names.items()]
        return [(name, msgspec.msgpack.encode(f), max(e for _, e in f.values())) for name, f in merged]

    def _variants(self, names: Sequence[str], now: float) -> dict[str, Fields | None]:
        """The live fields of each named variant blob there is; None for a planted one. Bytes that are no such
        blob (a foreign or damaged one) hold no field."""
        found: dict[str, Fields | None] = {}
        for name, (blob, data) in self.blobs.get(names, MAX_SMALL_BLOB).items():
            if blob.planted is not None or not isinstance(data, bytes):
                found[name] = None if blob.planted is not None else {}
                continue
            try:
                fields = _FIELDS.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                fields = {}
            found[name] = {field: held for field, held in fields.items() if held[1] > now}
        return found

    def refresh_ttls(self, items: Sequence[tuple[str, int]]) -> None:
        """Only the entries not seen with 90% of the TTL still ahead of them: the client asks for a refresh after
        every read, and on S3 one rewrites the whole object."""
        now = time.time()
        fresh = self._expiries
        due = [(key, now + ttl) for key, ttl in items if fresh.get(key, 0.0) < now + ttl * TTL_REFRESH_FRACTION]
        if due:
            self._writing().touch([(self._entry(key), expires) for key, expires in due])
            self._expiries.update(due)

    def read_variant_index(self, queries: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[bytes | None] | None]:
        names = [f"variants/{_sha(kernel)}" for kernel, _ in queries]
        found = self._variants(sorted(set(names)), time.time())
        answers: list[list[bytes | None] | None] = []
        for name, (_, wanted) in zip(names, queries, strict=True):
            fields = found.get(name, {})  # planted: None, a query the store could not answer
            answers.append(None if fields is None else [fields[f][0] if f in fields else None for f in wanted])
        return answers

    # -- leases -----------------------------------------------------------------------------------
    def _lease(self, cache_key: str, blobs: BlobStore | None = None) -> BlobLease:
        """The key's lease, on a store that may be written unless `blobs` (to read it) is given."""
        folder = f"leases/{_hex(self.partition)}/{_hex(cache_key)}/"
        return BlobLease(blobs or self._writing(), folder, self.lease_ttl)

    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        return self._lease(cache_key).acquire(owner, ttl)

    def renew_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        return self._lease(cache_key).renew(owner, ttl)

    def release_lease(self, cache_key: str, owner: str) -> None:
        self.release_leases([(cache_key, owner)])

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> None:
        for cache_key, owner in leases:
            self._lease(cache_key).release(owner)

    def lease_holder(self, cache_key: str) -> str | None:
        return self._lease(cache_key, self.blobs).holder()

    def abort_calls(self) -> None:
        pass  # each call is bounded by the store's own timeouts

    # -- metrics: one blob per batch, folded by cachestore.blob.metrics_fold -----------------------------
    def apply_metrics(self, batch: api.MetricsBatch) -> bool:
        if (problem := api.batch_problem(batch)) is not None:
            raise api.BatchRefused(f"{self.description}: metrics batch {batch.batch_id!r} refused: {problem}")
        record = batch_record(batch, time.time())
        return self._writing().create(f"batches/{_sha(batch.batch_id)}", record, NEVER)

    def zero_counters(self, record: dict) -> None:
        self._writing().put([(f"batches/zero-{uuid.uuid4().hex}", zero_record(record, time.time()), NEVER)])

    def _record_names(self) -> list[str]:
        return [blob.name for blob in self.blobs.list("batches/") if not _misplaced(blob)]

    def _records_bytes(self, names: list[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for page in api.batched(names):
            reads = self.blobs.get(page, MAX_SMALL_BLOB).items()
            found.update((name, data) for name, (_, data) in reads if isinstance(data, bytes))
        return found

    # -- entries ----------------------------------------------------------------------------------
    def _live(self, prefix: str) -> Iterator[tuple[str, str]]:
        """(partition, cache key) of every live entry under `prefix`, in order, and of every blob planted under
        an entry's name (read as a corrupt entry, so verify reports it)."""
        now = time.time()
        for blob in self.blobs.list(prefix):
            _, partition, key = blob.name.split("/", 2) if blob.name.count("/") == 2 else ("", None, None)
            if partition is None or key is None or (blob.planted is None and blob.expires <= now):
                continue
            if (partition := _unhex(partition)) is not None and (key := _unhex(key)) is not None:
                yield partition, key

    def entry_partitions(self) -> list[str]:
        return sorted({partition for partition, _ in self._live("entries/")})

    def entry_keys(self) -> Iterator[tuple[str, str]]:
        yield from self._live("entries/")

    def _keys(self) -> Iterator[str]:
        return (key for _, key in self._live(f"entries/{_hex(self.partition)}/"))

    def scan_entries(self, with_ttl: bool = True) -> Iterator[api.RawEntry]:
        for page in api.batched(self._keys(), READ_PAGE):
            now, found = time.time(), self._entries(page)
            for key in page:
                if (read := found.get(key)) is not None:
                    yield api.RawEntry(key, read[1], max(read[0].expires - now, 0.0), self.partition)

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        return self.fetch(cache_keys, None)

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        return [key for key in self._keys() if key.startswith(prefix)][:limit]

    def put_entries(self, items: Sequence[api.WriteItem]) -> None:
        now = time.time()
        self._writing().put([(self._entry(item.cache_key), item.data, now + item.ttl) for item in items])

    def delete_entries(self, cache_keys: Sequence[str]) -> None:
        self._writing().delete([self._entry(key) for key in cache_keys])

    def _garbage(self) -> Iterator[Blob]:
        """Every expired entry and index field, every lease generation older than `lease_ttl`, and whatever was
        planted or lies where no name of the layout goes."""
        now = time.time()
        for folder in DEPTH:
            for blob in self.blobs.list(f"{folder}/"):
                spent = blob.created + self.lease_ttl < now if folder == "leases" else blob.expires <= now
                if _misplaced(blob) or (spent and folder != "batches"):  # a batch is never spent
                    yield blob

    def expired_count(self) -> tuple[int, int]:
        """(blobs `purge_expired` would delete, their bytes), of every partition."""
        found = [blob.size for blob in self._garbage()]
        return len(found), sum(found)

    def purge_expired(self) -> None:
        """Delete what `_garbage` lists, a blob written again meanwhile excepted; lease generations are never
        rewritten, and what is misplaced is not ours to keep, so both are deleted as they are."""
        now, garbage = time.time(), list(self._garbage())
        final = [blob.name for blob in garbage if blob.name.startswith("leases/") or _misplaced(blob)]
        self._writing().delete(final)
        deleted = set(final)
        self._writing().delete([blob.name for blob in garbage if blob.name not in deleted], expired_by=now)

    def close(self) -> None:
        self.blobs.close()
