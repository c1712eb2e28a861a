"""The cache entry as stored in a tier: msgpack with a versioned schema, a digest, optionally an HMAC.

    envelope  = msgpack {"schema": SCHEMA_VERSION, "body": <bytes>, "sig": <32 bytes> | nil}
    body      = msgpack {"binary", "input_names", "output_names", "format", "version_identifier",
                         "key_components", "producer_host", "producer_worker", "created", "compile_seconds",
                         "digest", "ref", "toolchain"}

`toolchain` is the id of the compiler that traced the binary (`bridge.identity`); a tier keeps each
toolchain's entries apart, and the codegen loop takes only its own toolchain's. `digest` is the SHA-256 of
the binary. An entry whose binary is already stored under another cache key is
written as a reference (`binary` empty, `ref` naming that key), so identical binaries are stored once. The
HMAC, when a key is configured, covers the body bytes. Nothing here ever unpickles: key_components hold
tuples, which msgpack brings back as lists, and `key_components` is informational (reports, explain): the
cache key itself is never recomputed from it.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

SCHEMA_VERSION = 2  # 2: the body names its toolchain
MAX_ENTRY_BYTES = 64 * 1024 * 1024
_BODY_FIELDS = (
    "binary", "input_names", "output_names", "format", "version_identifier", "key_components",
    "producer_host", "producer_worker", "created", "compile_seconds", "digest", "ref", "toolchain",
)  # fmt: skip


class EntryRejected(Exception):
    """An entry failed to decode or verify; `reason` says why (for counters and `inspect verify`)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Entry:
    binary: bytes
    input_names: list[str]
    output_names: list[str]
    format: str
    version_identifier: str
    key_components: dict[str, Any]
    producer_host: str = ""
    producer_worker: str = ""
    created: float = 0.0
    compile_seconds: float = 0.0
    digest: str = ""
    ref: str | None = None  # the cache key whose entry holds this binary, for deduplicated entries
    toolchain: str = ""  # the id of the compiler that traced the binary
    signed: bool = field(default=False, compare=False)  # the signature verified with the reader's key
    unverified: bool = field(default=False, compare=False)  # signed, but the reader had no key to check it

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = binary_digest(self.binary)

    @property
    def is_reference(self) -> bool:
        return self.ref is not None

    def as_reference_to(self, cache_key: str) -> Entry:
        """This entry, its binary replaced by a pointer to `cache_key`'s entry."""
        return Entry(**{**self._fields(), "binary": b"", "ref": cache_key})

    def with_binary(self, binary: bytes) -> Entry:
        return Entry(**{**self._fields(), "binary": binary, "ref": None})

    def trace_result(self) -> dict:
        """The specification's trace-result dict, as the bridge would have returned it."""
        return {
            "binary": self.binary,
            "input_names": list(self.input_names),
            "output_names": list(self.output_names),
            "format": self.format,
        }

    def _fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _BODY_FIELDS}


def binary_digest(binary: bytes) -> str:
    return hashlib.sha256(binary).hexdigest()


def encode_entry(entry: Entry, hmac_key: bytes | None = None) -> bytes:
    body = msgpack.packb(entry._fields(), use_bin_type=True)
    signature = hmac.new(hmac_key, body, hashlib.sha256).digest() if hmac_key else None
    return msgpack.packb({"schema": SCHEMA_VERSION, "body": body, "sig": signature}, use_bin_type=True)


@dataclass(frozen=True)
class SignaturePolicy:
    """How a reader treats signatures. With a key: a wrong signature is always rejected, an unsigned entry
    is rejected when `require_signed`. Without a key: a signed entry cannot be verified and is rejected
    when `reject_unverifiable`, else accepted on its digest alone."""

    hmac_key: bytes | None = None
    require_signed: bool = True
    reject_unverifiable: bool = False


def decode_entry(data: bytes, policy: SignaturePolicy, max_bytes: int = MAX_ENTRY_BYTES) -> Entry:
    """Decode and verify; raises EntryRejected with the reason on any problem."""
    if len(data) > max_bytes:
        raise EntryRejected(f"entry of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    envelope = _unpack(data, "envelope")
    if not isinstance(envelope, dict):
        raise EntryRejected("envelope is not a map")
    if envelope.get("schema") != SCHEMA_VERSION:
        raise EntryRejected(f"schema version {envelope.get('schema')!r}, expected {SCHEMA_VERSION}")
    body, signature = envelope.get("body"), envelope.get("sig")
    if not isinstance(body, bytes) or not (signature is None or isinstance(signature, bytes)):
        raise EntryRejected("envelope body or signature has the wrong type")
    signed = _check_signature(body, signature, policy)
    fields = _unpack(body, "body")
    entry = _entry_from_fields(fields)
    entry.signed = signed
    entry.unverified = signature is not None and not signed
    if not entry.is_reference and binary_digest(entry.binary) != entry.digest:
        raise EntryRejected("binary does not match its digest")
    return entry


def _check_signature(body: bytes, signature: bytes | None, policy: SignaturePolicy) -> bool:
    if policy.hmac_key is not None:
        if signature is None:
            if policy.require_signed:
                raise EntryRejected("entry is unsigned and this reader requires signatures")
            return False
        expected = hmac.new(policy.hmac_key, body, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, signature):
            raise EntryRejected("signature does not verify with this reader's key")
        return True
    if signature is not None and policy.reject_unverifiable:
        raise EntryRejected("entry is signed and this reader has no key to verify it")
    return False


def _unpack(data: bytes, what: str) -> object:
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_str_len=1 << 20, max_array_len=1 << 16, max_map_len=1024,
            max_ext_len=0,
        )  # fmt: skip
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise EntryRejected(f"{what} cannot be decoded: {type(exc).__name__}") from None


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "binary": (bytes,), "input_names": (list,), "output_names": (list,), "format": (str,),
    "version_identifier": (str,), "key_components": (dict,), "producer_host": (str,), "producer_worker": (str,),
    "created": (float, int), "compile_seconds": (float, int), "digest": (str,), "ref": (str, type(None)),
    "toolchain": (str,),
}  # fmt: skip


def _entry_from_fields(fields: object) -> Entry:
    if not isinstance(fields, dict) or set(fields) != set(_BODY_FIELDS):
        raise EntryRejected("body fields do not match the schema")
    for name, kinds in _FIELD_TYPES.items():
        if not isinstance(fields[name], kinds) or isinstance(fields[name], bool):
            raise EntryRejected(f"body field {name!r} has the wrong type")
    for name in ("created", "compile_seconds"):
        # NaN and infinities would poison every sum they enter (saved seconds, fleet metrics, --json).
        if not math.isfinite(fields[name]) or fields[name] < 0:
            raise EntryRejected(f"body field {name!r} is {fields[name]!r}, not a finite number >= 0")
    if fields["format"] not in ("bir", "klir"):
        raise EntryRejected(f"unknown binary format {fields['format']!r}")
    names = fields["input_names"] + fields["output_names"]
    if not all(isinstance(n, str) for n in names):
        raise EntryRejected("input/output names must be strings")
    return Entry(**fields)
