"""The tier's entry format (schema 4): a header with the SHA-256 and optional HMAC of a zstd payload (compressed
with the shipped dictionary) holding the msgpack body; old schemas, garbage and zstd bombs are rejected; never
pickle."""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import random
import time
from pathlib import Path

import msgpack
import pytest
import zstandard
from helpers_entries import body_of, compress, decompress, old_reference, payload_of, signature_of, stored

from cachestore.entry import (
    MAX_CLOCK_AHEAD,
    SCHEMA_VERSION,
    Entry,
    EntryRejected,
    SignaturePolicy,
    binary_digest,
    decode_entry,
    encode_entry,
)
from cachestore.value import MAX_COMPILE_SECONDS

KEY = b"k" * 32
OTHER_KEY = b"o" * 32
BINARY = bytes(range(256)) * 4 + b"NKI-BINARY-MARKER" + bytes(range(255, -1, -1))
UNSIGNED_OK = SignaturePolicy(hmac_key=None)


def make_entry(binary: bytes = BINARY, **changes) -> Entry:
    fields = dict(
        binary=binary,
        input_names=["lhsT", "rhs"],
        output_names=["out"],
        format="bir",
        version_identifier="bir-1",
        key_components={"kernel_name": "matmul_tiled", "operands": {"shapes": [[64, 32]], "dtypes": ["float32"]}},
        producer_host="host-a",
        producer_worker="w1",
        created=1_700_000_000.25,
        compile_seconds=0.125,
    )
    fields.update(changes)
    return Entry(**fields)


def rejected(data: bytes, policy: SignaturePolicy = UNSIGNED_OK, **kwargs) -> str:
    with pytest.raises(EntryRejected) as info:
        decode_entry(data, policy, **kwargs)
    return info.value.reason


# -- round trip -------------------------------------------------------------------------------------
def test_round_trip_keeps_every_field() -> None:
    entry = make_entry()
    decoded = decode_entry(encode_entry(entry), UNSIGNED_OK)
    assert decoded == entry
    assert decoded.digest == hashlib.sha256(BINARY).hexdigest()
    assert decoded.signed is False
    assert decoded.trace_result() == {
        "binary": BINARY,
        "input_names": ["lhsT", "rhs"],
        "output_names": ["out"],
        "format": "bir",
    }


def test_every_entry_holds_its_binary_and_an_older_builds_reference_is_rejected() -> None:
    """The body's `ref` field is nil in what this build writes; an entry naming another key there (a reference
    to that key's binary, which builds with content dedupe wrote) is rejected, whole and intact as it is."""
    from cachestore.entry import body_of as stored_body

    body = msgpack.unpackb(stored_body(encode_entry(make_entry())), raw=False)
    assert body[11] is None and body[0] == BINARY
    assert "reference to another key's binary" in rejected(old_reference(make_entry(), "holder-key"))
    assert "reference to another key's binary" in rejected(stored(body_of(make_entry(), ref="holder-key")))
    assert "body field 'ref'" in rejected(stored(body_of(make_entry(), ref=7)))


def test_the_stored_form_is_a_header_and_a_compressed_payload_its_digest_covers() -> None:
    binary = b"".join(b"load tile %d; matmul; store\n" % (i % 64) for i in range(4000))  # repetitive, like BIR
    data = encode_entry(make_entry(binary))
    assert data[:4] == b"NKC" + bytes([SCHEMA_VERSION]) and data[4] == 0  # unsigned
    payload = payload_of(data)
    assert data[5:37] == hashlib.sha256(payload).digest()  # a hit hashes this, not the binary
    assert len(data) < len(binary) / 5  # compressed
    body = msgpack.unpackb(decompress(payload), raw=False)
    assert body[0] == binary and body[10] == binary_digest(binary)


def test_a_schema_3_entry_compressed_without_the_dictionary_is_a_miss() -> None:
    """Schema 3 had the same header and a payload compressed without a dictionary: rejected by its schema byte."""
    plain = zstandard.ZstdCompressor(write_content_size=True).compress(body_of(make_entry()))
    assert "schema version 3, expected 4" in rejected(stored(payload=plain, schema=3))


@pytest.mark.parametrize("dictionary", ["none", "another"])
def test_a_payload_compressed_without_the_shipped_dictionary_is_rejected_not_misread(dictionary: str) -> None:
    """Another tool writing schema 4 with its own dictionary (or none), under a digest it computed: no crash, and
    never an entry with other contents than were written."""
    body = body_of(make_entry())
    other = zstandard.ZstdCompressionDict(os.urandom(4096), dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    options = {"dict_data": other} if dictionary == "another" else {}
    payload = zstandard.ZstdCompressor(write_content_size=True, **options).compress(body)
    try:
        decoded = decode_entry(stored(payload=payload), UNSIGNED_OK)
    except EntryRejected:
        return
    assert decoded == make_entry()  # a frame that needed no dictionary content decodes to what was written


def test_the_dictionary_makes_small_bodies_smaller() -> None:
    """What the dictionary is for: a small BIR-like body compresses better with it than alone."""
    from cachestore.entry import body_of as stored_body

    binary = b"".join(b"\x93\xa6buffer\x92@@\xa7float32\xa4sbuf%d" % i for i in range(40))
    data = encode_entry(make_entry(binary))
    alone = zstandard.ZstdCompressor(level=12, write_content_size=True).compress(stored_body(data))
    assert len(payload_of(data)) < len(alone)


def test_an_entry_of_the_previous_schema_is_rejected() -> None:
    """Schema 2 was a msgpack map {schema, body, sig}: a reader of schema 3 takes it as a miss."""
    old_body = msgpack.packb(make_entry()._fields(), use_bin_type=True)
    old = msgpack.packb({"schema": 2, "body": old_body, "sig": None}, use_bin_type=True)
    assert "older schema" in rejected(old)


# -- what a reader must reject ----------------------------------------------------------------------
def test_flipped_bytes_in_the_stored_form_fail_the_digest() -> None:
    data = encode_entry(make_entry())
    for at in (5, 20, len(data) - len(payload_of(data)), len(data) // 2, len(data) - 1):
        forged = bytearray(data)
        forged[at] ^= 0x01
        assert "digest" in rejected(bytes(forged))


def test_a_forged_payload_under_the_original_digest_is_rejected() -> None:
    original = encode_entry(make_entry())
    forged = stored(body_of(make_entry(), binary=b"evil" + BINARY[4:]), digest=original[5:37])
    assert "digest" in rejected(forged)


@pytest.mark.parametrize("signed", [False, True])
def test_every_truncation_is_rejected(signed: bool) -> None:
    data = encode_entry(make_entry(), KEY if signed else None)
    policy = SignaturePolicy(KEY) if signed else UNSIGNED_OK
    for length in range(len(data)):
        with pytest.raises(EntryRejected):
            decode_entry(data[:length], policy)
    assert decode_entry(data, policy) == make_entry()


@pytest.mark.parametrize("schema", [0, 1, 2, SCHEMA_VERSION + 1, 255])
def test_wrong_schema_version_is_rejected(schema: int) -> None:
    assert "schema" in rejected(stored(body_of(make_entry()), schema=schema))


def test_unknown_header_flags_are_rejected() -> None:
    data = bytearray(encode_entry(make_entry()))
    data[4] = 0x10  # bits 0 (HMAC) and 1 (writer signature) are known
    assert "unknown header flags" in rejected(bytes(data))
    data[4] = 0x12
    assert "unknown header flags" in rejected(bytes(data))


@pytest.mark.parametrize("flags", [0x04, 0x05, 0x0C, 0x0D])
def test_an_entry_an_earlier_release_signed_in_a_group_is_a_miss_with_its_reason(flags: int) -> None:
    """Bits 2 and 3 marked earlier releases' group (Merkle) signatures, which are no longer read: such an entry is
    rejected for what it is, before its section is parsed, as an entry of an older schema is."""
    data = bytearray(encode_entry(make_entry()))
    data[4] = flags
    assert "signed in a group" in rejected(bytes(data))


# -- zstd: bombs and frames that lie --------------------------------------------------------------------
def test_a_zstd_bomb_is_refused_by_its_declared_size_before_anything_is_allocated() -> None:
    """64 MiB + 1 of zeros compress to a few KiB: the frame declares its size and is refused on that alone."""
    limit = 64 * 1024 * 1024
    bomb = stored(payload=compress(b"\x00" * (limit + 1)))
    assert len(bomb) < 10_000
    assert "over the" in rejected(bomb, max_bytes=limit)
    small = stored(payload=compress(b"\x00" * 5000))
    assert "over the" in rejected(small, max_bytes=4096)  # the limit is the caller's max_entry_bytes


def test_zstd_frames_that_declare_nothing_or_lie_are_rejected() -> None:
    body = body_of(make_entry())
    streamed = zstandard.ZstdCompressor().compressobj()
    no_size = streamed.compress(body) + streamed.flush()
    assert zstandard.frame_content_size(no_size) == -1
    assert "declare" in rejected(stored(payload=no_size))
    frame = compress(body)
    assert "cannot be decompressed" in rejected(stored(payload=frame + frame))  # a second frame after it
    assert "cannot be decompressed" in rejected(stored(payload=frame + b"tail"))
    assert "not a zstd frame" in rejected(stored(payload=body))  # msgpack, not compressed
    assert "not a zstd frame" in rejected(stored(payload=b""))
    # A frame whose header says one byte more or less than it holds: the size field is the byte after the
    # frame descriptor, whose single-segment flag makes it the window too.
    for delta in (-1, 1):
        lying = bytearray(compress(b"z" * 200))
        assert lying[5] == 200
        lying[5] += delta
        rejected(stored(payload=bytes(lying)))
    assert decode_entry(stored(body), UNSIGNED_OK) == make_entry()


def test_a_garbage_payload_under_a_valid_digest_is_rejected() -> None:
    for payload in (os.urandom(1000), b"\x28\xb5\x2f\xfd" + os.urandom(200)):
        rejected(stored(payload=payload))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"\xc1",  # never used in msgpack
        b"garbage that is not msgpack at all \xff\xfe",
        random.Random(64).randbytes(64),  # seeded: every pytest-xdist worker must collect the same test ids
        msgpack.packb([1, 2, 3]),
        msgpack.packb("a string"),
        msgpack.packb(12345),
        msgpack.packb({1: 2}),
        msgpack.packb(msgpack.ExtType(1, b"xx")),
        b"NKC",
        b"NKC" + bytes([SCHEMA_VERSION, 0]) + b"\x00" * 31,
        b"NKC" + bytes([SCHEMA_VERSION, 1]) + b"\x00" * 40,
        stored(b"\x93\x01\x02\x03"),
        stored(b"\xc1"),
        stored(b""),
        stored(msgpack.packb({"binary": b"x"})),
        stored(msgpack.packb(msgpack.ExtType(1, b"xx"))),
    ],
)
def test_garbage_is_rejected(data: bytes) -> None:
    rejected(data)


@pytest.mark.parametrize(
    "change",
    [
        {"format": "elf"},
        {"binary": "text, not bytes"},
        {"input_names": "lhsT"},
        {"input_names": [1, 2]},
        {"created": True},
        {"compile_seconds": "fast"},
        {"ref": 7},
        {"extra": 1},
    ],
)
def test_bodies_that_do_not_match_the_schema_are_rejected(change: dict) -> None:
    assert rejected(stored(body_of(make_entry(), **change)))


@pytest.mark.parametrize("name", ["created", "compile_seconds"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0, 1e300])
def test_numbers_that_are_not_finite_and_positive_are_rejected(name: str, value: float) -> None:
    assert f"body field {name!r} is {value!r}, not a" in rejected(stored(body_of(make_entry(), **{name: value})))


def test_numbers_are_bounded_by_what_this_compiler_can_produce() -> None:
    """Compile seconds of a day at most, a creation time a day ahead of the reader's clock at most (issue 35:
    1e300 compile seconds made every pass reading the entry unrecordable in the fleet's metrics)."""
    for name, good, bad in (
        ("compile_seconds", MAX_COMPILE_SECONDS, MAX_COMPILE_SECONDS * 1.01),
        ("created", time.time() + MAX_CLOCK_AHEAD - 60, time.time() + MAX_CLOCK_AHEAD + 60),
    ):
        assert getattr(decode_entry(stored(body_of(make_entry(), **{name: good})), UNSIGNED_OK), name) == good
        assert f"body field {name!r}" in rejected(stored(body_of(make_entry(), **{name: bad})))
    assert decode_entry(stored(body_of(make_entry(), created=0, compile_seconds=0)), UNSIGNED_OK).created == 0


def test_a_body_missing_a_field_is_rejected() -> None:
    fields = list(make_entry()._fields().values())
    assert "fields" in rejected(stored(msgpack.packb(fields[:-1], use_bin_type=True)))
    assert "fields" in rejected(stored(msgpack.packb(make_entry()._fields(), use_bin_type=True)))  # schema 2's map


class _Trap:
    """Unpickling this creates a file: the proof that something ran pickle on tier data."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "unpickled"))


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_payload_is_rejected_and_never_unpickled(tmp_path: Path, protocol: int) -> None:
    payload = pickle.dumps(_Trap(tmp_path / "pwned"), protocol=protocol)
    rejected(payload)  # as the whole entry
    rejected(stored(payload))  # as the body of a well-formed entry
    rejected(stored(payload=payload))  # as its payload
    rejected(stored(payload, key=KEY), SignaturePolicy(KEY))
    pickled_entry = pickle.dumps(make_entry(), protocol=protocol)
    rejected(pickled_entry)
    rejected(stored(pickled_entry))
    assert not (tmp_path / "pwned").exists()
    pickle.loads(payload)  # the trap is armed: unpickling it would have left the file
    assert (tmp_path / "pwned").exists()


def test_oversize_entries_are_rejected_before_decoding() -> None:
    data = encode_entry(make_entry())
    assert "exceeds" in rejected(data, max_bytes=len(data) - 1)
    # The limit bounds the decompressed body too: max_entry_bytes is what a reader holds, in either form.
    body = len(body_of(make_entry()))
    assert len(data) < body and "over the" in rejected(data, max_bytes=body - 1)
    assert decode_entry(data, UNSIGNED_OK, max_bytes=body) == make_entry()


def test_oversize_strings_inside_are_rejected() -> None:
    huge_name = os.urandom(1 << 19).hex() + "n"  # random, so that it compresses less than MAX_COMPRESSION_RATIO
    assert "decoded" in rejected(encode_entry(make_entry(input_names=[huge_name])))


# -- signatures ---------------------------------------------------------------------------------------
def test_signed_entry_with_the_right_key_is_accepted() -> None:
    decoded = decode_entry(encode_entry(make_entry(), KEY), SignaturePolicy(KEY))
    assert decoded == make_entry() and decoded.signed is True


def test_the_signature_is_an_hmac_of_the_stored_payload() -> None:
    data = encode_entry(make_entry(), KEY)
    assert data[4] == 1 and signature_of(data) == hmac.new(KEY, payload_of(data), hashlib.sha256).digest()


def test_signed_entry_with_a_wrong_key_is_rejected() -> None:
    data = encode_entry(make_entry(), OTHER_KEY)
    assert "signature" in rejected(data, SignaturePolicy(KEY))
    assert "signature" in rejected(data, SignaturePolicy(KEY, require_signed=False))


def test_tampered_signed_entry_is_rejected() -> None:
    data = encode_entry(make_entry(), KEY)
    # Another body with its digest recomputed (what a writer without the key can do), the signature kept.
    forged_body = body_of(make_entry(), binary=b"x" * 10, digest=binary_digest(b"x" * 10))
    assert "signature" in rejected(stored(forged_body, signature=signature_of(data)), SignaturePolicy(KEY))
    assert "signature" in rejected(stored(forged_body, signature=b"\x00" * 32), SignaturePolicy(KEY))


def test_unsigned_entry_is_rejected_when_the_reader_requires_signatures() -> None:
    data = encode_entry(make_entry())
    assert "unsigned" in rejected(data, SignaturePolicy(KEY, require_signed=True))
    accepted = decode_entry(data, SignaturePolicy(KEY, require_signed=False))
    assert accepted == make_entry() and accepted.signed is False


def test_signed_entry_read_without_a_key() -> None:
    data = encode_entry(make_entry(), KEY)
    accepted = decode_entry(data, SignaturePolicy(None, reject_unverifiable=False))
    assert accepted == make_entry() and accepted.signed is False  # could not be verified
    assert "no key" in rejected(data, SignaturePolicy(None, reject_unverifiable=True))
    # The digest still protects a reader without a key.
    tampered = bytearray(data)
    tampered[-3] ^= 0x20
    assert "digest" in rejected(bytes(tampered), SignaturePolicy(None))
