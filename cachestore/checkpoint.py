"""Writer checkpoints: one signature over what many of a writer's flush groups stored (issue 22).

A batch signature (cachestore.trust, cachestore.entry.seal) covers one flush of a writer's outbox, and a pass's
end has its outbox sent at once (`TierClient.send_now`), so a fresh reader still verifies about one Ed25519
signature a pass it reads. A writer process on a Redis tier therefore also keeps, per partition (toolchain and
scope), a checkpoint: the list of what it stored, one (cache key, payload SHA-256) pair an entry, in chunks of at
most MAX_CHUNK_PAIRS pairs, each signed. The current chunk is rewritten, grown and signed anew, at each flush,
in the same pipeline after the entries, and copied to the writer key's "latest chunk" key beside it; a full
chunk is written a last time and left alone, and a new one begun. Each entry's writer section names its chunk
(`ChunkRef`: the writer process's random instance id and the chunk number), which the signature of the entry does
not cover: it is a hint of where to look, and a wrong one only costs the fallback below.

A reader, at the first entry naming a chunk it has not loaded, fetches it (one round trip; none when the chunk
came with its first read as a writer's latest, `CheckpointReader.offer`), verifies its signature once with the
trusted key the entry names, and adds its pairs to the trust policy's listing of that writer; from then on an
entry the chunk lists costs one dict lookup by its cache key and a comparison of its payload's digest, no hash
(bench/RESULTS.md, issue 22). An entry the loaded chunk does not list (the chunk grew since, expired, was
replaced, is garbage or forged) falls back to its own group signature: always checked, just slower. A chunk is
fetched again at most once per REFETCH_SECONDS, so hostile entries naming chunks cannot make a reader fetch
without bound.

A listed pair is what the writer's signature of the entry itself covers but for the flags: the cache key it is
stored under and the SHA-256 of its stored payload (its body, as served), with the writer's key id and the entry
schema in the chunk's header. The flags only say how the header is laid out; the payload the digest names is the
writer's whole output.

Stored form (`NS:vV:tc:PARTITION:checkpoint:{KEYID.INSTANCE}:CHUNK`, and the latest one also under
`NS:vV:tc:PARTITION:checkpoint-latest:{KEYID}`, cachestore.keys):

    b"NKK" <version: 2> <entry schema: 1> <key id: 16> <instance: 8> <chunk: 4> <count: 4>
    <pairs: (listing id of the cache key: 32, payload SHA-256: 32) x count> <signature: 64>

A cache key's listing id is its 32 raw bytes when it is a SHA-256 in hex (every key the codegen loop makes), else
the SHA-256 of its UTF-8 text. The signature is over `checkpoint_message`: a domain of its own (so it is never an
entry's or a group's message, nor a version-1 chunk's), the key id, the partition (a checkpoint copied into
another toolchain or scope does not verify), the schema, the instance, the chunk, the count and the SHA-256 of the
pairs. Nothing is truncated: whoever can get a trusted writer to compile inputs of their choosing (a model graph
sent upstream) could search for two keys colliding in a 16-byte prefix in about 2^64 hashes, one honest for the
writer to store and one of their own to plant. A chunk of MAX_CHUNK_PAIRS pairs is 16 KB. Version-1 chunks
(leaf hashes, written before) are rejected like any chunk of another version: their entries verify by their
group signatures.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cachestore.keys import sha256_raw
from cachestore.merkle import HASH_BYTES
from cachestore.trust import KEY_ID_BYTES, SIGNATURE_BYTES, TrustPolicy, WriterKey

logger = logging.getLogger(__name__)

# The current chunk is rewritten whole at each flush: with chunks of 1024 pairs (64 KB) a writer whose flushes
# carry ~5 entries (7 KB) would send many times those bytes again in checkpoints over a chunk's life; 256 bounds
# that to 16 KB a flush, and a fresh reader still verifies one chunk per 256 entries of a writer process.
MAX_CHUNK_PAIRS = 256
PAIR_BYTES = 2 * HASH_BYTES
INSTANCE_BYTES = 8
REF_BYTES = INSTANCE_BYTES + 4  # instance id, chunk number: what an entry's writer section names
MAGIC = b"NKK"
VERSION = 2
_REF_AT = len(MAGIC) + 2 + KEY_ID_BYTES
_HEADER_BYTES = _REF_AT + REF_BYTES + 4
MAX_CHECKPOINT_BYTES = _HEADER_BYTES + PAIR_BYTES * MAX_CHUNK_PAIRS + SIGNATURE_BYTES
REFETCH_SECONDS = 1.0  # a chunk named again by an entry it does not list (it grew since) is fetched again after
REMEMBERED_CHUNKS = 4096  # chunks a reader remembers having tried (an LRU: hostile refs cannot grow it)
# A first read brings at most this many writers' latest chunks (16.5 KB each at most): a policy of many keys
# costs the others' chunks a fetch of their own, not a first read of megabytes.
LATEST_WRITERS = 8
_DOMAIN = b"nkicache-checkpoint-v2-ed25519\x00"


def listing_id(cache_key: str) -> bytes:
    """What a chunk lists for `cache_key`: its raw bytes when it is a SHA-256 in hex, else the SHA-256 of it."""
    raw = sha256_raw(cache_key)
    return raw if raw is not None else hashlib.sha256(cache_key.encode("utf-8", "surrogatepass")).digest()


class CheckpointRejected(ValueError):
    """A stored checkpoint that is not a valid, trusted chunk of the one asked for; the message says why."""


def chunk_ref(instance: bytes, chunk: int) -> bytes:
    return instance + chunk.to_bytes(4, "big")


def split_ref(ref: bytes) -> tuple[bytes, int]:
    return ref[:INSTANCE_BYTES], int.from_bytes(ref[INSTANCE_BYTES:REF_BYTES], "big")


def checkpoint_message(key_id: bytes, partition: str, schema: int, instance: bytes, chunk: int, pairs: bytes) -> bytes:
    """The bytes a writer signs for one chunk (`pairs`: the listed pairs, concatenated)."""
    where = partition.encode("utf-8")
    count = len(pairs) // PAIR_BYTES
    return b"".join((_DOMAIN, key_id, len(where).to_bytes(2, "big"), where, bytes((schema,)), instance,
                     chunk.to_bytes(4, "big"), count.to_bytes(4, "big"), hashlib.sha256(pairs).digest()))  # fmt: skip


def encode_checkpoint(
    writer: WriterKey, partition: str, schema: int, instance: bytes, chunk: int, pairs: Sequence[bytes]
) -> bytes:
    """A signed chunk listing `pairs` (each a listing id and a payload digest, 64 bytes)."""
    joined = b"".join(pairs)
    signature = writer.sign(checkpoint_message(writer.key_id, partition, schema, instance, chunk, joined))
    count = len(pairs).to_bytes(4, "big")
    head = b"".join((MAGIC, bytes((VERSION, schema)), writer.key_id, chunk_ref(instance, chunk), count))
    return head + joined + signature


def stated_ref(data: bytes) -> bytes:
    """The chunk ref a stored chunk's header states (unverified; b"" when it is too short to state one)."""
    return data[_REF_AT : _REF_AT + REF_BYTES] if len(data) >= _HEADER_BYTES else b""


def decode_checkpoint(
    data: object, key_id: bytes, partition: str, schema: int, ref: bytes, trust: TrustPolicy
) -> bytes:
    """The pairs (concatenated) of the chunk `ref` of writer `key_id` in `partition` listing entries of `schema`,
    once its signature verifies with that trusted key; raises CheckpointRejected naming the cause otherwise.
    Nothing is built before the size and the header are checked."""
    if not isinstance(data, bytes):
        raise CheckpointRejected(f"not bytes but {type(data).__name__}")
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise CheckpointRejected(f"{len(data)} bytes, over the {MAX_CHECKPOINT_BYTES}-byte limit")
    if len(data) < _HEADER_BYTES + SIGNATURE_BYTES or not data.startswith(MAGIC) or data[3] != VERSION:
        raise CheckpointRejected("not a checkpoint of this version (or truncated)")
    if data[4] != schema:
        raise CheckpointRejected(f"lists entries of schema {data[4]}, not {schema}")
    named, where = data[5:_REF_AT], stated_ref(data)
    if named != key_id or where != ref:
        raise CheckpointRejected(f"names writer {named.hex()} chunk {where.hex()}, not {key_id.hex()} {ref.hex()}")
    count = int.from_bytes(data[_HEADER_BYTES - 4 : _HEADER_BYTES], "big")
    if not 0 < count <= MAX_CHUNK_PAIRS or len(data) != _HEADER_BYTES + PAIR_BYTES * count + SIGNATURE_BYTES:
        raise CheckpointRejected(f"declares {count} pairs in {len(data)} bytes")
    pairs = data[_HEADER_BYTES : _HEADER_BYTES + PAIR_BYTES * count]
    instance, chunk = split_ref(ref)
    message = checkpoint_message(key_id, partition, schema, instance, chunk, pairs)
    problem = trust.check(key_id, message, data[-SIGNATURE_BYTES:])
    if problem is not None:
        raise CheckpointRejected(problem)
    return pairs


@dataclass(frozen=True)
class CheckpointRecord:
    """One chunk to write: where (the writer's key id and instance, hex, and the chunk number) and its bytes."""

    key_id_hex: str
    instance_hex: str
    chunk: int
    data: bytes
    count: int


class CheckpointLog:
    """A writer process's checkpoint in one partition: the pairs it stored, the chunk each went to, and the
    chunks changed since they were last written. Used by the flusher thread (a lock all the same)."""

    def __init__(self, writer: WriterKey, partition: str, schema: int):
        self.writer = writer
        self.partition = partition
        self.schema = schema
        self.instance = os.urandom(INSTANCE_BYTES)  # a process's own: two writers never rewrite one chunk
        self.chunk = 0
        self._pairs: list[bytes] = []
        self._seen: set[bytes] = set()
        self._unwritten: dict[int, list[bytes]] = {}
        self._lock = threading.Lock()

    def place(self, listed: Sequence[tuple[str, bytes]]) -> list[bytes]:
        """Add the (cache key, payload SHA-256) of entries about to be stored; the chunk ref each is to name."""
        refs = []
        with self._lock:
            for cache_key, digest in listed:
                pair = listing_id(cache_key) + digest
                if pair not in self._seen:  # the same entry sealed again (a retried reference): listed once
                    if len(self._pairs) == MAX_CHUNK_PAIRS:
                        self.chunk, self._pairs, self._seen = self.chunk + 1, [], set()  # the full one is frozen
                    self._pairs.append(pair)
                    self._seen.add(pair)
                    self._unwritten[self.chunk] = self._pairs
                refs.append(chunk_ref(self.instance, self.chunk))
        return refs

    def records(self) -> list[CheckpointRecord]:
        """The chunks changed since last written, each signed as it is now, in chunk order (the last the
        current one: the writer's latest)."""
        with self._lock:
            todo = [(chunk, list(pairs)) for chunk, pairs in sorted(self._unwritten.items())]
        key, instance = self.writer.key_id_hex, self.instance.hex()
        return [CheckpointRecord(key, instance, chunk, encode_checkpoint(self.writer, self.partition, self.schema,
                                                                          self.instance, chunk, pairs), len(pairs))
                for chunk, pairs in todo]  # fmt: skip

    def written(self, records: Sequence[CheckpointRecord]) -> None:
        """These records are stored: their chunks are clean unless they grew since."""
        with self._lock:
            for record in records:
                pairs = self._unwritten.get(record.chunk)
                if pairs is not None and len(pairs) == record.count:
                    del self._unwritten[record.chunk]


class CheckpointReader:
    """A reader's checkpoints: fetches a chunk an entry names (`load`), at most once per REFETCH_SECONDS, and
    adds the pairs of a valid one to the trust policy's listings. `fetch(key id hex, instance hex, chunk)` returns
    the stored bytes or None (no chunk, the tier unavailable); it never raises.

    A writer's latest chunk can come with a read instead (`latest_wanted`, `offer`): the first read of a process
    asks for each trusted writer's, in the same round trip as its entries, and an entry naming that chunk then
    loads it without a fetch. An offered chunk is only kept (16 KB at most a trusted writer), verified when an
    entry names it: one no entry names costs no verify."""

    def __init__(self, fetch: Callable[[str, str, int], object], trust: TrustPolicy, partition: str, schema: int):
        self._fetch = fetch
        self.trust = trust
        self.partition = partition
        self.schema = schema
        self._tried: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()
        self._offered: dict[bytes, bytes] = {}
        self._latest_asked = False
        self._lock = threading.Lock()
        self.fetches = 0  # round trips for checkpoints (`nkicache bench` prints them per hit)
        self.loaded = 0
        self.rejected = 0

    def latest_wanted(self) -> list[str]:
        """The key ids (hex) of the trusted writers whose latest chunk a read should ask for: on a process's first
        read, those of the first LATEST_WRITERS writers of the policy; none after."""
        if self._latest_asked:
            return []
        self._latest_asked = True
        return [key_id.hex() for key_id in list(self.trust.writers)[:LATEST_WRITERS]]

    def offer(self, key_id: bytes, data: object) -> None:
        """The latest chunk of writer `key_id` as a read found it (unverified): kept until an entry names it."""
        if isinstance(data, bytes) and len(data) <= MAX_CHECKPOINT_BYTES and self.trust.trusts(key_id):
            with self._lock:
                self._offered[key_id] = data

    def load(self, key_id: bytes, ref: bytes) -> None:
        if len(ref) != REF_BYTES or not self.trust.trusts(key_id):
            return  # an untrusted writer's entry is rejected whatever its chunk says
        now = time.monotonic()
        with self._lock:
            last = self._tried.get((key_id, ref))
            if last is not None and now - last < REFETCH_SECONDS:
                return
            self._tried[(key_id, ref)] = now
            self._tried.move_to_end((key_id, ref))
            if len(self._tried) > REMEMBERED_CHUNKS:
                self._tried.popitem(last=False)
            offered = self._offered.pop(key_id, None)
            if offered is not None and stated_ref(offered) != ref:
                self._offered[key_id], offered = offered, None  # another chunk: kept for the entries naming it
        if offered is not None and self._accept(key_id, ref, offered):
            return
        with self._lock:
            self.fetches += 1
        instance, chunk = split_ref(ref)
        data = self._fetch(key_id.hex(), instance.hex(), chunk)
        if data is not None:
            self._accept(key_id, ref, data)

    def _accept(self, key_id: bytes, ref: bytes, data: object) -> bool:
        """Whether `data` is the valid chunk `ref` of writer `key_id`: its pairs then go to the trust policy."""
        try:
            pairs = decode_checkpoint(data, key_id, self.partition, self.schema, ref, self.trust)
        except CheckpointRejected as exc:
            self.rejected += 1
            instance, chunk = split_ref(ref)
            logger.warning("checkpoint %s.%s:%d of %s rejected (entries fall back to their own signatures): %s",
                           key_id.hex(), instance.hex(), chunk, self.partition, exc)  # fmt: skip
            return False
        self.trust.remember_listing(key_id, pairs)
        self.loaded += 1
        return True
