"""Stored entries built by hand (schema 4: header, SHA-256 and HMAC of the payload, zstd payload compressed with
the shipped dictionary), for tests that plant what encode_entry would never write."""

from __future__ import annotations

import hashlib
import hmac

import msgpack
import zstandard

from cachestore.entry import _BODY_FIELDS, MAGIC, SCHEMA_VERSION, Entry, entry_dictionary


def compress(body: bytes, dictionary: zstandard.ZstdCompressionDict | None = None) -> bytes:
    """`body` as one zstd frame, compressed with `dictionary` (default: the one entries use)."""
    dictionary = entry_dictionary() if dictionary is None else dictionary
    return zstandard.ZstdCompressor(write_content_size=True, write_dict_id=False, dict_data=dictionary).compress(body)


def decompress(payload: bytes) -> bytes:
    return zstandard.ZstdDecompressor(dict_data=entry_dictionary()).decompress(payload)


def stored(
    body: bytes | None = None,
    *,
    payload: bytes | None = None,
    schema: int = SCHEMA_VERSION,
    key: bytes | None = None,
    signature: bytes | None = None,
    digest: bytes | None = None,
) -> bytes:
    """An entry as encode_entry lays it out: `payload` as given, else `body` compressed; signed with `key`, or
    carrying `signature` as is; its digest computed unless given."""
    if payload is None:
        payload = compress(body)
    if key is not None:
        signature = hmac.new(key, payload, hashlib.sha256).digest()
    flags = 1 if signature is not None else 0
    digest = hashlib.sha256(payload).digest() if digest is None else digest
    return MAGIC + bytes((schema, flags)) + digest + (signature or b"") + payload


def body_of(entry: Entry, **overrides: object) -> bytes:
    """The entry's body (msgpack, uncompressed) with fields replaced; a name not in the schema adds a field."""
    fields = {name: getattr(entry, name, None) for name in _BODY_FIELDS}  # ("ref" is no attribute: nil)
    fields.update(overrides)
    return msgpack.packb(list(fields.values()), use_bin_type=True)


def old_reference(entry: Entry, holder_key: str, key: bytes | None = None) -> bytes:
    """`entry` as builds with content dedupe stored it when `holder_key`'s entry held the same binary: binary
    empty, `ref` naming that key (with an HMAC under `key`)."""
    return stored(body_of(entry, binary=b"", ref=holder_key), key=key)


def payload_of(data: bytes) -> bytes:
    """The payload of an encoded entry (what its digest and signature cover)."""
    flags = data[len(MAGIC) + 1]
    return data[len(MAGIC) + 2 + 32 + (32 if flags & 1 else 0) :]


def signature_of(data: bytes) -> bytes | None:
    start = len(MAGIC) + 2 + 32
    return data[start : start + 32] if data[len(MAGIC) + 1] & 1 else None
