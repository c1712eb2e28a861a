"""The cache entry as stored in a tier: a short binary header, then the body, msgpack, compressed with zstd.

    stored  = b"NKC" <schema: 1 byte> <flags: 1 byte> <SHA-256 of payload: 32 bytes> [<HMAC: 32 bytes>]
              [<writer key id: 16 bytes> <Ed25519 signature: 64 bytes>] payload
    payload = one zstd frame (its decompressed size declared), compressed with the shipped dictionary, of
    body    = msgpack [binary, input_names, output_names, format, version_identifier, key_components,
                       producer_host, producer_worker, created, compile_seconds, digest, ref, toolchain]

Flag bit 0 says the HMAC is there, bit 1 a writer's signature (`cachestore.signatures`), which covers the
schema, flags, key id, the cache key the entry is stored under and the payload's SHA-256, so it costs no hashing
of the binary. Bits 2 and 3 marked the group (Merkle) signatures of earlier releases: such an entry is rejected
like an entry of an older schema, a miss, traced and rewritten. Entries written before writer signatures have
neither bit and stay readable as they were, except by a reader with a trust policy, which rejects them (no
trusted writer).
The SHA-256 (integrity) and the HMAC (authenticity, when a key is configured) both cover the payload as
stored, so a hit hashes the small compressed form, not the binary, and decodes once: one decompression,
one msgpack unpack. Bodies compress to about a tenth of the binary (bench/RESULTS.md).
Entries of an older schema (a msgpack map, or schema 3's payload compressed without the dictionary) are
rejected like any bad entry: a miss, traced and rewritten.

The dictionary (`entry_dictionary.zstd`, next to this module; `bench/train_zstd_dictionary.py` trains it on
entries of graphs no workload uses) holds what every body repeats: msgpack field names and op names of BIR
binaries, dtypes, key component names. Entries are small (a median binary of 1.3 KB), so compressed alone
each would pay for that structure again. The schema byte names the dictionary: a new dictionary is a new
schema, and entries written with another one are misses, never mis-decoded.

`toolchain` is the id of the compiler that traced the binary (`bridge.identity`); a tier keeps each
toolchain's entries apart, and the codegen loop takes only its own toolchain's. `digest` is the SHA-256 of
the binary, computed by the writer (`inspect verify` checks the binary against it). Every entry holds its
binary: `ref` is always nil. An entry whose `ref` names another cache key (a reference to that key's binary,
which older builds wrote) is rejected, never followed: a miss, traced and rewritten whole. Nothing here ever
unpickles: key_components hold tuples, which msgpack
brings back as lists, and `key_components` is informational (reports, explain): the cache key itself is
never recomputed from it.

Entries come from a store others can write to, so reading one costs a bounded time and memory whatever it
holds: a store hands over no entry larger than its limit (`TooLarge` stands in for it), and `decode_entry`
checks the size, the header, the digest and signature, the payload's declared decompressed size (at most the
same limit: a zstd bomb is refused before anything is allocated), and only then unpacks the body, once the
number of objects it holds is known to be bounded (by its length, or for a longer body by walking its
headers alone).
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import msgspec
import zstandard

from bridge import failures
from cachestore.signatures import KEY_ID_BYTES, SIGNATURE_BYTES, signed_message
from cachestore.value import DAY, MAX_COMPILE_SECONDS

if TYPE_CHECKING:
    from cachestore.trust import TrustPolicy, WriterKey

# 2: the body names its toolchain; 3: binary header, zstd payload, body a list; 4: the payload compressed with
# the shipped dictionary (ENTRY_DICTIONARY_PATH)
SCHEMA_VERSION = 4
MAGIC = b"NKC"
ENTRY_DICTIONARY_PATH = Path(__file__).with_name("entry_dictionary.zstd")
# With the dictionary, measured on the bench workload's bodies (bench/RESULTS.md, "Compact entries"): level 15
# stores a body at 0.092 of its binary in 823 us, on the flusher thread.
COMPRESSION_LEVEL = 15
# What an entry may be, stored or decompressed (Settings.max_entry_bytes raises it): the default workload's largest
# binary is 79 KB and a 1024x1024 conv's 2.8 MB (docs/tiers.md), so 8 MiB is 100 times the first and holds the
# second, and a bomb declaring more is refused before any decompression.
MAX_ENTRY_BYTES = 8 * 1024 * 1024
# Real payloads decompress to at most 18.6 times their size (docs/tiers.md); one that declares more than this
# many times its size is a bomb, refused before any decompression.
MAX_COMPRESSION_RATIO = 64
# A writer's clock may run ahead of a reader's, not by a day: a later `created` would make an entry look used
# in the future to `inspect gc` and `warm`.
MAX_CLOCK_AHEAD = DAY
_SIGNED = 0x01
_WRITER_SIGNED = 0x02  # a writer key id and an Ed25519 signature of this entry follow the HMAC (cachestore.signatures)
_GROUP_SIGNED = 0x04 | 0x08  # earlier releases' group signatures (bit 3 only ever with bit 2): no longer read
_KNOWN_FLAGS = _SIGNED | _WRITER_SIGNED
_SUM_AT, _SUM_BYTES, _SIG_BYTES = len(MAGIC) + 2, 32, 32
_WRITER_BYTES = KEY_ID_BYTES + SIGNATURE_BYTES
# A real body holds about a hundred msgpack objects (the names and key components around one binary), nested
# four deep. These bounds are far above that and keep a hostile body's unpacked size to a few megabytes.
MAX_BODY_OBJECTS = 1 << 16
MAX_BODY_DEPTH = 32
MAX_STR_BYTES = 1 << 20  # a name or a key component
MAX_MAP_LEN = 1024
_BODY_FIELDS = (
    "binary",
    "input_names",
    "output_names",
    "format",
    "version_identifier",
    "key_components",
    "producer_host",
    "producer_worker",
    "created",
    "compile_seconds",
    "digest",
    "ref",
    "toolchain",
)
_REF_AT = _BODY_FIELDS.index("ref")  # nil in every entry this build writes (see the module's docstring)
_ENTRY_FIELDS = tuple(name for name in _BODY_FIELDS if name != "ref")


class TooLarge(msgspec.Struct, frozen=True):
    """An entry a store holds but did not hand over: `size` bytes stored, over the `limit` it was asked to
    read. It stands where the entry's bytes would, and its len() is the stored size, so listings and byte
    counts (du, gc) see the entry as it is stored."""

    size: int
    limit: int

    def __len__(self) -> int:
        return self.size


# A negative entry (bridge.failures): the kernel failed to compile with this toolchain, and its "binary" is the
# failure's one-line message. Signed, verified and keyed like any entry; it lives failure_ttl.
FAILED, MAX_FAILURE_BYTES = failures.FAILED, failures.MAX_FAILURE_BYTES


class Unreadable(TooLarge, frozen=True):
    """An entry a store holds but cannot read (a link, a FIFO, another user's file planted under its name):
    rejected with `reason`, as a corrupt entry is."""

    reason: str


class EntryRejected(Exception):
    """An entry failed to decode or verify; `reason` says why (for counters and `inspect verify`)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Entry(msgspec.Struct):
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
    toolchain: str = ""  # the id of the compiler that traced the binary
    signed: bool = False  # the signature verified with the reader's key
    unverified: bool = False  # signed, but the reader had no key to check it
    writer: str = ""  # the key id (hex) of the writer that signed it, if any
    # The bytes it was decoded from, as stored (None for an entry built here): a
    # stack's nearer level keeps a copy of them, with its writer's signature, instead of encoding it anew.
    stored: bytes | None = None

    def __post_init__(self) -> None:
        if not self.digest:
            self.digest = binary_digest(self.binary)

    def trace_result(self) -> dict:
        """The specification's trace-result dict, as the bridge would have returned it."""
        return {
            "binary": self.binary,
            "input_names": list(self.input_names),
            "output_names": list(self.output_names),
            "format": self.format,
        }

    def _fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _ENTRY_FIELDS}

    # Equal and shown by what the entry says, not by how this reader came by it (signed, unverified, writer,
    # stored).
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and self._fields() == other._fields()

    def __repr__(self) -> str:
        return f"Entry({', '.join(f'{name}={value!r}' for name, value in self._fields().items())})"


def binary_digest(binary: bytes) -> str:
    return hashlib.sha256(binary).hexdigest()


def encode_entry(
    entry: Entry,
    hmac_key: bytes | None = None,
    writer: WriterKey | None = None,
    cache_key: str = "",
) -> bytes:
    """The stored form: MAGIC, schema and flags, the SHA-256 of the payload, its HMAC when a key is given, the
    writer's key id and signature (over `cache_key`, the key it is stored under) when a writer key is given, then
    the payload (the body, compressed)."""
    values = [getattr(entry, name) for name in _ENTRY_FIELDS]
    values.insert(_REF_AT, None)
    payload = _compressor().compress(msgpack.packb(values, use_bin_type=True))
    digest = hashlib.sha256(payload).digest()
    signature = hmac.new(hmac_key, payload, hashlib.sha256).digest() if hmac_key else b""
    flags = (_SIGNED if signature else 0) | (_WRITER_SIGNED if writer is not None else 0)
    section = b""
    if writer is not None:
        section = writer.key_id + writer.sign(signed_message(SCHEMA_VERSION, flags, writer.key_id, cache_key, digest))
    return b"".join((MAGIC, bytes((SCHEMA_VERSION, flags)), digest, signature, section, payload))


class WriterSection(msgspec.Struct, frozen=True):
    """What an entry's header says of its writer (unverified): the key id and the signature."""

    key_id: bytes
    signature: bytes


class SignaturePolicy(msgspec.Struct, frozen=True):
    """How a reader treats signatures. With a key: a wrong signature is always rejected, an unsigned entry
    is rejected when `require_signed`. Without a key: a signed entry cannot be verified and is rejected
    when `reject_unverifiable`, else accepted on its digest alone."""

    hmac_key: bytes | None = None
    require_signed: bool = True
    reject_unverifiable: bool = False
    # With a trust policy, every entry must carry a writer signature by a key it trusts (over the cache key
    # the entry is read under); without one, a writer signature is not checked (an unverified entry).
    trust: TrustPolicy | None = None


def decode_entry(
    data: bytes | TooLarge, policy: SignaturePolicy, max_bytes: int = MAX_ENTRY_BYTES, cache_key: str | None = None
) -> Entry:
    """Decode and verify; raises EntryRejected with the reason on any problem.

    Nothing is built before it is known to be small, so a hostile entry costs a bounded time and memory
    whatever it declares: the stored size first, then the header, the digest and the signature over the
    stored (compressed) bytes, then the payload's declared size before it is decompressed, and only then the
    body, whose shape is bounded before msgpack builds it. A policy with a trust policy needs `cache_key`, the
    key the entry was read under, which the writer's signature covers. The EntryRejected raised holds its
    reason alone (`_rejection`). `decode_entries` of one entry."""
    (result,) = _decode_all([(cache_key, data)], policy, max_bytes)
    if isinstance(result, EntryRejected):
        raise result
    return result


def _rejection(exc: EntryRejected) -> EntryRejected:
    """`exc` anew, its reason alone: the rejection a reader keeps (one per entry of a read, until the read returns)
    then has no traceback or context through the frames of its checks, which held the payload and the
    decompressed body, so no rejected body outlives its check."""
    return EntryRejected(exc.reason)


def _intact(data: bytes | TooLarge, max_bytes: int) -> tuple[int, bytes | None, WriterSection | None, bytes, bytes]:
    """(flags, HMAC or None, writer section or None, payload, the payload's SHA-256) of stored bytes whose size,
    header and digest are checked; raises EntryRejected naming the first problem."""
    if isinstance(data, Unreadable):
        raise EntryRejected(f"entry cannot be read: {data.reason}")
    if isinstance(data, TooLarge):
        raise EntryRejected(f"entry of {data.size} bytes exceeds the {data.limit}-byte limit")
    if len(data) > max_bytes:
        raise EntryRejected(f"entry of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    flags, signature, section, payload = _open(data)
    digest = data[_SUM_AT : _SUM_AT + _SUM_BYTES]
    hasher = _SHA256.copy()
    hasher.update(payload)
    if not hmac.compare_digest(hasher.digest(), digest):
        raise EntryRejected("stored bytes do not match their digest")
    return flags, signature, section, payload, digest


# A copy of an empty hash costs less than a new one (OpenSSL looks the algorithm up for each new hash): 1 µs of a
# remote hit, which hashes its payload right after the reply's wait, caches cold. Never updated itself, so threads
# may copy it at once.
_SHA256 = hashlib.sha256()


class OpenedEntry(msgspec.Struct):
    """An entry whose size, header, digest and HMAC were checked (`open_entry`); its writer's signature and its
    body are still to be checked."""

    flags: int
    hmac: bytes | None
    signed: bool  # the HMAC verified with the reader's key
    section: WriterSection | None
    digest: bytes  # the payload's SHA-256, as the header states it and the payload hashes to
    payload: bytes
    writer: object = None  # `check_writers`'s verdict: the writer's key id, None, or an EntryRejected


def open_entry(data: bytes | TooLarge, policy: SignaturePolicy, max_bytes: int = MAX_ENTRY_BYTES) -> OpenedEntry:
    """A decode's checks up to the writer's signature: the stored size, the header, the digest and the HMAC.
    Raises EntryRejected naming the first problem."""
    flags, signature, section, payload, digest = _intact(data, max_bytes)
    signed = _check_signature(payload, signature, policy)
    return OpenedEntry(flags, signature, signed, section, digest, payload)


def _body(payload: bytes, max_bytes: int) -> Entry:
    """The entry `payload` holds, its declared size bounded before it is decompressed, its shape before msgpack
    builds it, then its fields checked."""
    fields = _unpack(
        _decompress(payload, max_bytes),
        "body",
        max_objects=MAX_BODY_OBJECTS,
        max_depth=MAX_BODY_DEPTH,
        max_str_len=MAX_STR_BYTES,
        max_array_len=MAX_BODY_OBJECTS,
        max_map_len=MAX_MAP_LEN,
    )
    return _entry_from_fields(fields)


def _accepted(entry: Entry, opened: OpenedEntry, writer: bytes | None, policy: SignaturePolicy) -> Entry:
    """`entry` as decode_entry marks it: what verified it (signed, unverified) and its writer."""
    entry.signed = opened.signed or (writer is not None and policy.trust is not None)
    entry.unverified = (opened.hmac is not None and not opened.signed) or (writer is not None and policy.trust is None)
    entry.writer = writer.hex() if writer is not None else ""
    return entry


def decode_entries(
    found: Mapping[str, bytes | TooLarge], policy: SignaturePolicy, max_bytes: int = MAX_ENTRY_BYTES
) -> dict[str, Entry | EntryRejected]:
    """`decode_entry` of each (cache key, stored bytes), in the order found: the EntryRejected stands for an
    entry refused."""
    return dict(zip(found, _decode_all(found.items(), policy, max_bytes), strict=True))


def _decode_all(
    items: Iterable[tuple[str | None, bytes | TooLarge]], policy: SignaturePolicy, max_bytes: int
) -> list[Entry | EntryRejected]:
    """The decode of every read: each entry opened (size, header, digest, HMAC), then the writers' signatures
    checked in one loop (`check_writers`: one call a read, not one an entry, on the compile path), then each
    body decompressed and checked, in that order."""
    results: list[OpenedEntry | EntryRejected] = []
    opened: list[tuple[str | None, OpenedEntry]] = []
    for key, data in items:
        try:
            entry = open_entry(data, policy, max_bytes)
        except EntryRejected as exc:
            results.append(_rejection(exc))
            continue
        results.append(entry)
        opened.append((key, entry))
    check_writers(opened, policy)
    return [_checked_body(entry, policy, max_bytes) if isinstance(entry, OpenedEntry) else entry for entry in results]


def _checked_body(opened: OpenedEntry, policy: SignaturePolicy, max_bytes: int) -> Entry | EntryRejected:
    writer = opened.writer
    if isinstance(writer, EntryRejected):
        return writer
    try:
        return _accepted(_body(opened.payload, max_bytes), opened, writer, policy)  # type: ignore[arg-type]
    except EntryRejected as exc:
        return _rejection(exc)


def check_writers(opened: Sequence[tuple[str | None, OpenedEntry]], policy: SignaturePolicy) -> None:
    """The writer check (`_check_writer`) of each opened entry (with the cache key it was read under), in one
    loop, its verdict in `entry.writer`: the writer's key id (None for none) or the EntryRejected saying why
    not."""
    for key, entry in opened:
        try:
            entry.writer = _check_writer(entry.flags, entry.section, entry.digest, policy, key)
        except EntryRejected as exc:
            entry.writer = _rejection(exc)  # (the original's traceback would tie `opened` and its payloads in a cycle)


def open_stored(data: bytes) -> tuple[bytes | None, bytes]:
    """(signature or None, payload) of an encoded entry, both as stored; raises EntryRejected when `data`
    is not an entry of this schema (an older schema's entry is rejected like any other: a miss)."""
    _, signature, _, payload = _open(data)
    return signature, payload


def _open(data: bytes) -> tuple[int, bytes | None, WriterSection | None, bytes]:
    """(flags, HMAC or None, writer section or None, payload) of an encoded entry: its header read once. Raises
    EntryRejected when `data` is not an entry of this schema or its header is truncated."""
    if not data.startswith(MAGIC):
        older = data[:1] and 0x80 <= data[0] <= 0x8F  # schema 1 and 2 were a msgpack map
        raise EntryRejected("an entry of an older schema (a msgpack map)" if older else "not an nkicache entry")
    if len(data) < _SUM_AT + _SUM_BYTES:
        raise EntryRejected("entry header is truncated")
    schema, flags = data[len(MAGIC)], data[len(MAGIC) + 1]
    if schema != SCHEMA_VERSION:
        raise EntryRejected(f"schema version {schema}, expected {SCHEMA_VERSION}")
    if flags & _GROUP_SIGNED and not flags & ~(_KNOWN_FLAGS | _GROUP_SIGNED):
        raise EntryRejected("entry is signed in a group (an earlier release's signature), no longer read")
    if flags & ~_KNOWN_FLAGS:
        raise EntryRejected(f"unknown header flags {flags:#04x}")
    start = _SUM_AT + _SUM_BYTES
    signature = section = None
    if flags & _SIGNED:
        if len(data) < start + _SIG_BYTES:
            raise EntryRejected("entry signature is truncated")
        signature, start = data[start : start + _SIG_BYTES], start + _SIG_BYTES
    if flags & _WRITER_SIGNED:
        if len(data) < start + _WRITER_BYTES:
            raise EntryRejected("entry writer signature is truncated")
        section = WriterSection(data[start : start + KEY_ID_BYTES], data[start + KEY_ID_BYTES : start + _WRITER_BYTES])
        start += _WRITER_BYTES
    return flags, signature, section, data[start:]


def writer_section(data: bytes) -> WriterSection | None:
    """The writer section of an encoded entry, unverified, or None when it carries none (or is no entry)."""
    try:
        return _open(data)[2]
    except EntryRejected:
        return None


def writer_of(data: bytes | TooLarge) -> str:
    """The key id (hex) of the writer that signed an encoded entry, unverified; "" when none (listings, gc)."""
    section = None if isinstance(data, TooLarge) else writer_section(data)
    return section.key_id.hex() if section else ""


def is_signed(data: bytes) -> bool:
    """Whether an encoded entry carries a signature (False for what is no entry of this schema)."""
    try:
        return open_stored(data)[0] is not None
    except EntryRejected:
        return False


def payload_problem(payload: bytes, max_bytes: int) -> str | None:
    """Why a reader refuses `payload` before decompressing it (`_declared_size`), or None. A writer asks too, so
    that it stores nothing its readers would refuse."""
    try:
        _declared_size(payload, max_bytes)
    except EntryRejected as exc:
        return exc.reason
    return None


def _declared_size(payload: bytes, max_bytes: int) -> int:
    """The size `payload` declares decompressed, refused unless it is one zstd frame that declares it, at most
    `max_bytes` and at most MAX_COMPRESSION_RATIO times the payload's own size."""
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError:
        raise EntryRejected("payload is not a zstd frame") from None
    if size < 0:
        raise EntryRejected("payload does not declare its decompressed size")
    if size > max_bytes:
        raise EntryRejected(f"payload declares {size} bytes decompressed, over the {max_bytes}-byte limit")
    if size > MAX_COMPRESSION_RATIO * len(payload):
        raise EntryRejected(
            f"payload of {len(payload)} bytes declares {size} decompressed, more than "
            f"{MAX_COMPRESSION_RATIO} times its size (no real entry compresses so well)"
        )
    return size


def _decompress(payload: bytes, max_bytes: int) -> bytes:
    """The payload decompressed, its declared size checked first (`_declared_size`: zstandard allocates what a
    frame declares, and max_output_size bounds only frames that declare nothing), and the frame holding
    exactly that."""
    size = _declared_size(payload, max_bytes)
    try:
        # Positional (max_output_size, read_across_frames, allow_extra_data): parsing keywords costs the C call
        # 0.7 µs, a third of a small entry's decompression. The declared size, checked above, is what is allocated.
        body = _decompressor().decompress(payload, max_bytes, False, False)
    except zstandard.ZstdError as exc:
        raise EntryRejected(f"payload cannot be decompressed: {exc}") from None
    if len(body) != size:
        raise EntryRejected(f"payload declares {size} bytes and holds {len(body)}")
    return body


def body_of(data: bytes, max_bytes: int = MAX_ENTRY_BYTES) -> bytes:
    """The decompressed body of an encoded entry, unchecked against its digest (training the dictionary,
    measurements); raises EntryRejected when it is no entry of this schema."""
    return _decompress(open_stored(data)[1], max_bytes)


_local = threading.local()  # zstd contexts are not thread-safe, and making one costs more than a small entry
_dictionary_lock = threading.Lock()
_dictionary: list[zstandard.ZstdCompressionDict] = []


def entry_dictionary() -> zstandard.ZstdCompressionDict:
    """The shipped dictionary, read once per process."""
    with _dictionary_lock:
        if not _dictionary:
            try:
                data = ENTRY_DICTIONARY_PATH.read_bytes()
            except OSError as exc:
                raise RuntimeError(f"{ENTRY_DICTIONARY_PATH}: cannot read the entry dictionary: {exc}") from None
            _dictionary.append(zstandard.ZstdCompressionDict(data))
        return _dictionary[0]


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "compressor"):
        # No zstd checksum and no dictionary id: the header's SHA-256 covers the payload, and the schema byte
        # names the dictionary.
        _local.compressor = zstandard.ZstdCompressor(
            level=COMPRESSION_LEVEL,
            dict_data=entry_dictionary(),
            write_checksum=False,
            write_content_size=True,
            write_dict_id=False,
        )
    return _local.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor(dict_data=entry_dictionary())
    return _local.decompressor


def _check_signature(payload: bytes, signature: bytes | None, policy: SignaturePolicy) -> bool:
    if policy.hmac_key is not None:
        if signature is None:
            if policy.require_signed:
                raise EntryRejected("entry is unsigned and this reader requires signatures")
            return False
        expected = hmac.new(policy.hmac_key, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, signature):
            raise EntryRejected("signature does not verify with this reader's key")
        return True
    if signature is not None and policy.reject_unverifiable:
        raise EntryRejected("entry is signed and this reader has no key to verify it")
    return False


def _check_writer(
    flags: int, section: WriterSection | None, digest: bytes, policy: SignaturePolicy, cache_key: str | None
) -> bytes | None:
    """The writer's key id when the entry carries a writer signature (`section`, checked against the trust
    policy when the reader holds one); raises EntryRejected unless its signature verifies with a key the
    policy trusts."""
    if policy.trust is None:
        if section is not None and policy.reject_unverifiable:
            raise EntryRejected("entry is signed by a writer and this reader has no trust policy to verify it")
        return None if section is None else section.key_id
    if section is None:
        raise EntryRejected("entry has no writer signature and this reader trusts signed entries only")
    if cache_key is None:
        raise EntryRejected("a writer signature cannot be checked without the cache key it was stored under")
    key_id = section.key_id
    message = signed_message(SCHEMA_VERSION, flags, key_id, cache_key, digest)
    problem = policy.trust.check(key_id, message, section.signature)
    if problem is not None:
        raise EntryRejected(problem)
    return key_id


def _unpack(
    data: bytes,
    what: str,
    *,
    max_objects: int,
    max_depth: int,
    max_str_len: int,
    max_array_len: int,
    max_map_len: int,
) -> object:
    """One msgpack object of at most `max_objects` objects nested at most `max_depth` deep. The shape of data
    longer than `max_objects` bytes is checked on the headers alone first: msgpack's own limits bound each
    container and string, not how many there are, and a few megabytes of one-byte empty lists unpack to
    gigabytes. Its limits are then bounded by the length of `data` too, so no header can make it allocate for
    more items than the bytes could hold."""
    # No shorter data can hold more objects than it has bytes, and msgpack then builds a few MiB at most: the walk
    # (about 0.2 µs an object, half the cost of decoding a small entry) is left to the longer.
    problem = _shape_problem(data, max_objects, max_depth) if len(data) > max_objects else None
    if problem is not None:
        raise EntryRejected(f"{what} cannot be decoded: {problem}")
    size = len(data)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=min(max_str_len, size),
            max_bin_len=size,
            max_array_len=min(max_array_len, size),
            max_map_len=min(max_map_len, size // 2),
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise EntryRejected(f"{what} cannot be decoded: {type(exc).__name__}") from None


# What the first byte of a msgpack object says about it (https://github.com/msgpack/msgpack/blob/master/spec.md):
# (kind, bytes of its header, count), where the count (bytes of a string or binary, items of a list, pairs of a
# map) is in the header's bytes after the first when the header has more than one, and for a plain scalar the
# header is the whole object.
_SCALAR, _RAW, _ARRAY, _MAP, _EXT, _UNUSED = range(6)


def _first_byte(byte: int) -> tuple[int, int, int]:
    if byte <= 0x7F or byte >= 0xE0 or byte in (0xC0, 0xC2, 0xC3):  # fixint, nil, false, true
        return _SCALAR, 1, 0
    if byte <= 0x8F:
        return _MAP, 1, byte & 0x0F
    if byte <= 0x9F:
        return _ARRAY, 1, byte & 0x0F
    if byte <= 0xBF:
        return _RAW, 1, byte & 0x1F
    sized = {
        0xC4: (_RAW, 2),
        0xC5: (_RAW, 3),
        0xC6: (_RAW, 5),
        0xD9: (_RAW, 2),
        0xDA: (_RAW, 3),
        0xDB: (_RAW, 5),
        0xDC: (_ARRAY, 3),
        0xDD: (_ARRAY, 5),
        0xDE: (_MAP, 3),
        0xDF: (_MAP, 5),
    }
    if byte in sized:
        return (*sized[byte], 0)
    numbers = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
    if byte in numbers:
        return _SCALAR, numbers[byte], 0
    return (_UNUSED if byte == 0xC1 else _EXT), 1, 0


_FIRST_BYTES = [_first_byte(byte) for byte in range(256)]


def _shape_problem(data: bytes, max_objects: int, max_depth: int) -> str | None:
    """Why `data` is not exactly one well-formed msgpack object of at most `max_objects` objects nested at most
    `max_depth` deep, or None. Reads the headers alone and builds nothing; it stops at the first object over
    the budget, so it costs at most `max_objects` steps whatever the headers declare (a binary is skipped by
    its length, not read)."""
    end, pos, objects = len(data), 0, 0
    pending = [1]  # objects still to read: at the top level, then in each open list or map, innermost last
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        objects += 1
        if objects > max_objects:
            return f"more than {max_objects} objects"
        if pos >= end:
            return "truncated"
        kind, header, count = _FIRST_BYTES[data[pos]]
        if kind == _EXT:
            return "extension types are not used in entries"
        if kind == _UNUSED:
            return "byte 0xc1 is never used in msgpack"
        if header > 1 and kind != _SCALAR:
            count = int.from_bytes(data[pos + 1 : pos + header], "big")
        pos += header
        if kind == _RAW:
            pos += count
        if pos > end:
            return "truncated"
        if kind in (_ARRAY, _MAP) and count:
            items = 2 * count if kind == _MAP else count
            if items > end - pos:  # every item takes a byte at least: the header lies about its size
                declared = f"a map declares {count} pairs" if kind == _MAP else f"a list declares {count} items"
                return f"{declared} in {end - pos} bytes"
            if len(pending) > max_depth:
                return f"nested more than {max_depth} deep"
            pending.append(items)
    if pos != end:
        return f"{end - pos} bytes after the object"
    return None


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "binary": (bytes,),
    "input_names": (list,),
    "output_names": (list,),
    "format": (str,),
    "version_identifier": (str,),
    "key_components": (dict,),
    "producer_host": (str,),
    "producer_worker": (str,),
    "created": (float, int),
    "compile_seconds": (float, int),
    "digest": (str,),
    "ref": (str, type(None)),
    "toolchain": (str,),
}


_KINDS = tuple(_FIELD_TYPES[name] for name in _BODY_FIELDS)  # in body order: one pass over the list, no dict


# The exact types of a body's fields (in body order) that passed the type checks: a body of a shape seen before
# skips them, one set lookup instead of a check a field (every remote hit decodes a body). msgpack builds only
# builtin types, so at most a few shapes ever pass (int or float twice, str or None): the set stays tiny.
_CHECKED_SHAPES: set[tuple[type, ...]] = set()


def _check_shape(values: list) -> None:
    shape = tuple(map(type, values))
    if shape in _CHECKED_SHAPES:
        return
    for name, value, kinds in zip(_BODY_FIELDS, values, _KINDS, strict=True):
        # A bool is an int to isinstance, and the only kinds a bool could pass for are numbers.
        if not isinstance(value, kinds) or isinstance(value, bool):
            raise EntryRejected(f"body field {name!r} has the wrong type")
    _CHECKED_SHAPES.add(shape)  # (set.add is atomic: decoding threads need no lock)


def _entry_from_fields(values: object) -> Entry:
    if not isinstance(values, list) or len(values) != len(_BODY_FIELDS):
        raise EntryRejected(f"body is not a list of the schema's {len(_BODY_FIELDS)} fields")
    _check_shape(values)
    _, inputs, outputs, form, _, _, _, _, created, compile_seconds, _, ref, _ = values
    if ref is not None:
        raise EntryRejected("entry is a reference to another key's binary (an older build's dedupe): not followed")
    # Each number within what this compiler can produce: a NaN, an infinity or a 1e300 would poison every sum it
    # enters (a pass's saved seconds past what a metrics batch may carry drop the pass from the fleet's report),
    # and a later `created` would make the entry look in use. A NaN fails every comparison.
    if not 0 <= compile_seconds <= MAX_COMPILE_SECONDS:
        raise EntryRejected(
            f"body field 'compile_seconds' is {compile_seconds!r}, not a number of seconds from 0 to "
            f"{MAX_COMPILE_SECONDS:g} (no trace takes a day)"
        )
    if not 0 <= created <= time.time() + MAX_CLOCK_AHEAD:
        raise EntryRejected(f"body field 'created' is {created!r}, not a time from 0 (1970) to a day from now")
    if form not in ("bir", "klir", FAILED):
        raise EntryRejected(f"unknown binary format {form!r}")
    try:  # str.join takes strings alone, and checks them in C: no loop of isinstance calls here
        "".join(inputs)
        "".join(outputs)
    except TypeError:
        raise EntryRejected("input/output names must be strings") from None
    del values[_REF_AT]
    return Entry(*values)
