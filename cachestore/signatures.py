"""What a writer's Ed25519 signature covers: the signed-message format, shared by the entry codec
(cachestore.entry, which writes and reads signatures) and the trust layer (cachestore.trust, keys and policies).

Stdlib alone, so that the entry codec loads no key or policy code.

A signature of one entry (`signed_message`) covers a domain tag, the entry's schema and flags, the writer's key
id (`key_id_of`), the cache key it is stored under and the SHA-256 of its stored payload. Binding the cache key
means a trusted entry copied under another key (a transplant by anyone who can write the store) does not
verify.
"""

from __future__ import annotations

import hashlib

KEY_ID_BYTES = 16
SIGNATURE_BYTES = 64
_DOMAIN = b"nkicache-entry-ed25519\x00"


def key_id_of(public_raw: bytes) -> bytes:
    """A key's id: the first KEY_ID_BYTES of the SHA-256 of its raw 32-byte public key."""
    return hashlib.sha256(public_raw).digest()[:KEY_ID_BYTES]


def signed_message(schema: int, flags: int, key_id: bytes, cache_key: str, payload_sha256: bytes) -> bytes:
    """The bytes a writer signs for one stored entry."""
    key = cache_key.encode("utf-8")
    return b"".join((_DOMAIN, bytes((schema, flags)), key_id, len(key).to_bytes(2, "big"), key, payload_sha256))
