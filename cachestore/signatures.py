"""What a writer's Ed25519 signature covers: the signed-message format, shared by the entry codec
(cachestore.entry, which writes and reads signatures) and the trust layer (cachestore.trust, keys and policies).

Stdlib alone, so that the entry codec loads no key or policy code.

A signature of one entry (`signed_message`) covers a domain tag, the entry's schema and flags, the writer's key
id (`key_id_of`), the cache key it is stored under and the SHA-256 of its stored payload. Binding the cache key
means a trusted entry copied under another key (a transplant by anyone who can write the store) does not
verify.

Batch signatures: a writer signs a group of entries it stores together (a flush of its outbox, at most
`MAX_GROUP`) with one signature over `batch_message`, which names the key id, the group's size and the root of
the Merkle tree (cachestore.merkle, RFC 9162) whose leaves are the entries' `signed_message`s. Each entry
carries the signature, its leaf index, the group's size and its audit path; a reader recomputes its leaf
(`entry_leaf`), walks the path to the root and verifies the signature once per root, so reading N entries of
one group costs one Ed25519 verify, not N. Each entry is still bound to the writer's signature over exactly
what a signature of its own would cover: a forger needs the private key as before.
"""

from __future__ import annotations

import hashlib

KEY_ID_BYTES = 16
SIGNATURE_BYTES = 64
_DOMAIN = b"nkicache-entry-ed25519\x00"
_LEAF_DOMAIN = b"\x00" + _DOMAIN  # RFC 9162's leaf prefix, then an entry message's start (`entry_leaf`)
_BATCH_DOMAIN = b"nkicache-batch-ed25519\x00"  # another domain: a root message is never an entry's message
# The most entries one batch signature covers: a path of 6 hashes (192 bytes an entry) at most, and the bench
# workload's passes store fewer than this at a time (bench/RESULTS.md, batch signatures).
MAX_GROUP = 64


def key_id_of(public_raw: bytes) -> bytes:
    """A key's id: the first KEY_ID_BYTES of the SHA-256 of its raw 32-byte public key."""
    return hashlib.sha256(public_raw).digest()[:KEY_ID_BYTES]


def signed_message(schema: int, flags: int, key_id: bytes, cache_key: str, payload_sha256: bytes) -> bytes:
    """The bytes a writer signs for one stored entry."""
    key = cache_key.encode("utf-8")
    return b"".join((_DOMAIN, bytes((schema, flags)), key_id, len(key).to_bytes(2, "big"), key, payload_sha256))


def entry_leaf(schema: int, flags: int, key_id: bytes, cache_key: str, payload_sha256: bytes) -> bytes:
    """cachestore.merkle.leaf_hash of `signed_message(...)`, in one hash of one join: what an entry's group
    signature covers, looked up among the nodes of verified groups before any verify."""
    key = cache_key.encode("utf-8")
    parts = (_LEAF_DOMAIN, bytes((schema, flags)), key_id, len(key).to_bytes(2, "big"), key, payload_sha256)
    return hashlib.sha256(b"".join(parts)).digest()


def batch_message(key_id: bytes, size: int, root: bytes) -> bytes:
    """The bytes a writer signs for a group of `size` entries whose Merkle root is `root`."""
    return b"".join((_BATCH_DOMAIN, key_id, size.to_bytes(2, "big"), root))
