"""Writer checkpoints: one signature over the leaves of many of a writer's flush groups (issue 22).

A batch signature (cachestore.trust, cachestore.entry.seal) covers one flush of a writer's outbox, and a pass's
end has its outbox sent at once (`TierClient.send_now`), so a fresh reader still verifies about one Ed25519
signature a pass it reads. A writer process on a Redis tier therefore also keeps, per partition (toolchain and
scope), a checkpoint: the list of the leaf hashes (cachestore.merkle.leaf_hash of each entry's `signed_message`,
the full 32 bytes) of the entries it stored, in chunks of at most MAX_CHUNK_LEAVES, each signed. The current
chunk is rewritten, grown and signed anew, at each flush, in the same pipeline after the entries; a full chunk is
written a last time and left alone, and a new one begun. Each entry's writer section names its chunk (`ChunkRef`:
the writer process's random instance id and the chunk number), which the signature of the entry does not cover:
it is a hint of where to look, and a wrong one only costs the fallback below.

A reader, at the first entry naming a chunk it has not loaded, fetches it (one round trip), verifies its
signature once with the trusted key the entry names, and adds its leaves to the trust policy's memo of nodes
known to be under a signature of that writer; from then on an entry of the chunk costs its leaf hash and a dict
lookup. An entry whose leaf the loaded chunk does not list (the chunk grew since, expired, was replaced, is
garbage or forged) falls back to its own group signature: always checked, just slower. A chunk is fetched again
at most once per REFETCH_SECONDS, so hostile entries naming chunks cannot make a reader fetch without bound.

Stored form (`NS:vV:tc:PARTITION:checkpoint:{KEYID.INSTANCE}:CHUNK`, cachestore.keys):

    b"NKK" <version: 1> <key id: 16> <instance: 8> <chunk: 4> <count: 4> <leaves: 32 x count> <signature: 64>

The signature is over `checkpoint_message`: a domain of its own (so it is never an entry's or a group's
message), the key id, the partition (a checkpoint copied into another toolchain or scope does not verify), the
instance, the chunk, the count and the SHA-256 of the leaves. Leaves are not truncated: whoever can get a
trusted writer to compile inputs of their choosing (a model graph sent upstream) could search for two entries
whose 16-byte truncated leaves collide in about 2^64 hashes, one honest for the writer to store and one of
their own to plant; full leaves keep the 2^128 of a signature. A chunk of MAX_CHUNK_LEAVES is 8 KB.
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

from cachestore.merkle import HASH_BYTES
from cachestore.trust import KEY_ID_BYTES, SIGNATURE_BYTES, TrustPolicy, WriterKey

logger = logging.getLogger(__name__)

# The current chunk is rewritten whole at each flush: with chunks of 1024 leaves (32 KB) a writer whose flushes
# carry ~5 entries (7 KB) would send about twice those bytes again in checkpoints over a chunk's life; 256 bounds
# that to 8 KB a flush (0.6 of the entries' bytes on average), and a fresh reader still verifies one chunk per
# 256 entries of a writer process, 0.4 us a hit (bench/RESULTS.md, writer checkpoints).
MAX_CHUNK_LEAVES = 256
INSTANCE_BYTES = 8
REF_BYTES = INSTANCE_BYTES + 4  # instance id, chunk number: what an entry's writer section names
MAGIC = b"NKK"
VERSION = 1
_HEADER_BYTES = len(MAGIC) + 1 + KEY_ID_BYTES + REF_BYTES + 4
MAX_CHECKPOINT_BYTES = _HEADER_BYTES + HASH_BYTES * MAX_CHUNK_LEAVES + SIGNATURE_BYTES
REFETCH_SECONDS = 1.0  # a chunk named again by an entry it does not list (it grew since) is fetched again after
REMEMBERED_CHUNKS = 4096  # chunks a reader remembers having tried (an LRU: hostile refs cannot grow it)
_DOMAIN = b"nkicache-checkpoint-ed25519\x00"


class CheckpointRejected(ValueError):
    """A stored checkpoint that is not a valid, trusted chunk of the one asked for; the message says why."""


def chunk_ref(instance: bytes, chunk: int) -> bytes:
    return instance + chunk.to_bytes(4, "big")


def split_ref(ref: bytes) -> tuple[bytes, int]:
    return ref[:INSTANCE_BYTES], int.from_bytes(ref[INSTANCE_BYTES:REF_BYTES], "big")


def checkpoint_message(key_id: bytes, partition: str, instance: bytes, chunk: int, leaves: bytes) -> bytes:
    """The bytes a writer signs for one chunk (`leaves`: the leaf hashes, concatenated)."""
    where = partition.encode("utf-8")
    count = len(leaves) // HASH_BYTES
    return b"".join((_DOMAIN, key_id, len(where).to_bytes(2, "big"), where, instance, chunk.to_bytes(4, "big"),
                     count.to_bytes(4, "big"), hashlib.sha256(leaves).digest()))  # fmt: skip


def encode_checkpoint(writer: WriterKey, partition: str, instance: bytes, chunk: int, leaves: Sequence[bytes]) -> bytes:
    joined = b"".join(leaves)
    signature = writer.sign(checkpoint_message(writer.key_id, partition, instance, chunk, joined))
    count = len(leaves).to_bytes(4, "big")
    head = b"".join((MAGIC, bytes((VERSION,)), writer.key_id, chunk_ref(instance, chunk), count))
    return head + joined + signature


def decode_checkpoint(data: object, key_id: bytes, partition: str, ref: bytes, trust: TrustPolicy) -> list[bytes]:
    """The leaves of the chunk `ref` of writer `key_id` in `partition`, once its signature verifies with that
    trusted key; raises CheckpointRejected naming the cause otherwise. Nothing is built before the size and
    the header are checked."""
    if not isinstance(data, bytes):
        raise CheckpointRejected(f"not bytes but {type(data).__name__}")
    if len(data) > MAX_CHECKPOINT_BYTES:
        raise CheckpointRejected(f"{len(data)} bytes, over the {MAX_CHECKPOINT_BYTES}-byte limit")
    if len(data) < _HEADER_BYTES + SIGNATURE_BYTES or not data.startswith(MAGIC) or data[3] != VERSION:
        raise CheckpointRejected("not a checkpoint of this version (or truncated)")
    named, where = data[4 : 4 + KEY_ID_BYTES], data[4 + KEY_ID_BYTES : 4 + KEY_ID_BYTES + REF_BYTES]
    if named != key_id or where != ref:
        raise CheckpointRejected(f"names writer {named.hex()} chunk {where.hex()}, not {key_id.hex()} {ref.hex()}")
    count = int.from_bytes(data[_HEADER_BYTES - 4 : _HEADER_BYTES], "big")
    if not 0 < count <= MAX_CHUNK_LEAVES or len(data) != _HEADER_BYTES + HASH_BYTES * count + SIGNATURE_BYTES:
        raise CheckpointRejected(f"declares {count} leaves in {len(data)} bytes")
    leaves = data[_HEADER_BYTES : _HEADER_BYTES + HASH_BYTES * count]
    instance, chunk = split_ref(ref)
    message = checkpoint_message(key_id, partition, instance, chunk, leaves)
    problem = trust.check(key_id, message, data[-SIGNATURE_BYTES:])
    if problem is not None:
        raise CheckpointRejected(problem)
    return [leaves[i : i + HASH_BYTES] for i in range(0, len(leaves), HASH_BYTES)]


@dataclass(frozen=True)
class CheckpointRecord:
    """One chunk to write: where (the writer's key id and instance, hex, and the chunk number) and its bytes."""

    key_id_hex: str
    instance_hex: str
    chunk: int
    data: bytes
    count: int


class CheckpointLog:
    """A writer process's checkpoint in one partition: the leaves it stored, the chunk each went to, and the
    chunks changed since they were last written. Used by the flusher thread (a lock all the same)."""

    def __init__(self, writer: WriterKey, partition: str):
        self.writer = writer
        self.partition = partition
        self.instance = os.urandom(INSTANCE_BYTES)  # a process's own: two writers never rewrite one chunk
        self.chunk = 0
        self._leaves: list[bytes] = []
        self._seen: set[bytes] = set()
        self._unwritten: dict[int, list[bytes]] = {}
        self._lock = threading.Lock()

    def place(self, leaves: Sequence[bytes]) -> list[bytes]:
        """Add the leaves of entries about to be stored; the chunk ref each entry is to name."""
        refs = []
        with self._lock:
            for leaf in leaves:
                if leaf not in self._seen:  # the same entry sealed again (a retried reference): listed once
                    if len(self._leaves) == MAX_CHUNK_LEAVES:
                        self.chunk, self._leaves, self._seen = self.chunk + 1, [], set()  # the full one is frozen
                    self._leaves.append(leaf)
                    self._seen.add(leaf)
                    self._unwritten[self.chunk] = self._leaves
                refs.append(chunk_ref(self.instance, self.chunk))
        return refs

    def records(self) -> list[CheckpointRecord]:
        """The chunks changed since last written, each signed as it is now."""
        with self._lock:
            todo = [(chunk, list(leaves)) for chunk, leaves in sorted(self._unwritten.items())]
        key, instance = self.writer.key_id_hex, self.instance.hex()
        return [CheckpointRecord(key, instance, chunk, encode_checkpoint(self.writer, self.partition, self.instance,
                                                                          chunk, leaves), len(leaves))
                for chunk, leaves in todo]  # fmt: skip

    def written(self, records: Sequence[CheckpointRecord]) -> None:
        """These records are stored: their chunks are clean unless they grew since."""
        with self._lock:
            for record in records:
                leaves = self._unwritten.get(record.chunk)
                if leaves is not None and len(leaves) == record.count:
                    del self._unwritten[record.chunk]


class CheckpointReader:
    """A reader's checkpoints: fetches a chunk an entry names (`load`), at most once per REFETCH_SECONDS, and
    adds the leaves of a valid one to the trust policy's memo. `fetch(key id hex, instance hex, chunk)` returns
    the stored bytes or None (no chunk, the tier unavailable); it never raises."""

    def __init__(self, fetch: Callable[[str, str, int], object], trust: TrustPolicy, partition: str):
        self._fetch = fetch
        self.trust = trust
        self.partition = partition
        self._tried: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()
        self._lock = threading.Lock()
        self.fetches = 0  # round trips for checkpoints (`nkicache bench` prints them per hit)
        self.loaded = 0
        self.rejected = 0

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
            self.fetches += 1
        instance, chunk = split_ref(ref)
        data = self._fetch(key_id.hex(), instance.hex(), chunk)
        if data is None:
            return
        try:
            leaves = decode_checkpoint(data, key_id, self.partition, ref, self.trust)
        except CheckpointRejected as exc:
            self.rejected += 1
            logger.warning("checkpoint %s.%s:%d of %s rejected (entries fall back to their own signatures): %s",
                           key_id.hex(), instance.hex(), chunk, self.partition, exc)  # fmt: skip
            return
        self.trust.remember_leaves(leaves, key_id)
        self.loaded += 1
