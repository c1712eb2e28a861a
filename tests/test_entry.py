"""The tier's entry format: msgpack with a versioned schema, a digest, an optional HMAC; never pickle."""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
from pathlib import Path

import msgpack
import pytest

from cachestore.entry import (
    SCHEMA_VERSION,
    Entry,
    EntryRejected,
    SignaturePolicy,
    binary_digest,
    decode_entry,
    encode_entry,
)

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


def envelope(body: bytes, schema: object = SCHEMA_VERSION, sig: bytes | None = None) -> bytes:
    return msgpack.packb({"schema": schema, "body": body, "sig": sig}, use_bin_type=True)


def body_of(entry: Entry, **overrides) -> bytes:
    return msgpack.packb({**entry._fields(), **overrides}, use_bin_type=True)


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


def test_round_trip_of_a_reference_entry() -> None:
    reference = make_entry().as_reference_to("holder-key")
    decoded = decode_entry(encode_entry(reference), UNSIGNED_OK)
    assert decoded.is_reference and decoded.ref == "holder-key"
    assert decoded.binary == b"" and decoded.digest == binary_digest(BINARY)
    assert decoded.with_binary(BINARY) == make_entry()


def test_the_encoding_is_plain_msgpack_with_the_schema_version() -> None:
    outer = msgpack.unpackb(encode_entry(make_entry()), raw=False)
    assert outer["schema"] == SCHEMA_VERSION and outer["sig"] is None
    body = msgpack.unpackb(outer["body"], raw=False)
    assert body["binary"] == BINARY and body["digest"] == binary_digest(BINARY)


# -- what a reader must reject ----------------------------------------------------------------------
def test_flipped_bytes_in_the_binary_fail_the_digest() -> None:
    data = encode_entry(make_entry())
    at = data.index(b"NKI-BINARY-MARKER")
    for offset in (0, 5, 16):
        forged = bytearray(data)
        forged[at + offset] ^= 0x01
        assert "digest" in rejected(bytes(forged))


def test_a_forged_binary_with_the_original_digest_is_rejected() -> None:
    entry = make_entry()
    forged = envelope(body_of(entry, binary=b"evil" + BINARY[4:]))
    assert "digest" in rejected(forged)


@pytest.mark.parametrize("signed", [False, True])
def test_every_truncation_is_rejected(signed: bool) -> None:
    data = encode_entry(make_entry(), KEY if signed else None)
    policy = SignaturePolicy(KEY) if signed else UNSIGNED_OK
    for length in range(len(data)):
        with pytest.raises(EntryRejected):
            decode_entry(data[:length], policy)
    assert decode_entry(data, policy) == make_entry()


@pytest.mark.parametrize("schema", [0, SCHEMA_VERSION + 1, "1", None, 1.0 + SCHEMA_VERSION])
def test_wrong_schema_version_is_rejected(schema: object) -> None:
    assert "schema" in rejected(envelope(body_of(make_entry()), schema=schema))


def test_missing_schema_is_rejected() -> None:
    data = msgpack.packb({"body": body_of(make_entry()), "sig": None}, use_bin_type=True)
    assert "schema" in rejected(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"\xc1",  # never used in msgpack
        b"garbage that is not msgpack at all \xff\xfe",
        os.urandom(64),
        msgpack.packb([1, 2, 3]),
        msgpack.packb("a string"),
        msgpack.packb(12345),
        msgpack.packb({"schema": SCHEMA_VERSION, "body": "not bytes", "sig": None}),
        msgpack.packb({"schema": SCHEMA_VERSION, "body": b"\x93\x01\x02\x03", "sig": None}, use_bin_type=True),
        msgpack.packb({"schema": SCHEMA_VERSION, "body": b"\xc1", "sig": None}, use_bin_type=True),
        msgpack.packb({"schema": SCHEMA_VERSION, "body": b"", "sig": 5}, use_bin_type=True),
        msgpack.packb({1: 2}),
        msgpack.packb(msgpack.ExtType(1, b"xx")),
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
    assert rejected(envelope(body_of(make_entry(), **change)))


@pytest.mark.parametrize("name", ["created", "compile_seconds"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0])
def test_numbers_that_are_not_finite_and_positive_are_rejected(name: str, value: float) -> None:
    assert "not a finite number" in rejected(envelope(body_of(make_entry(), **{name: value})))


def test_a_body_missing_a_field_is_rejected() -> None:
    fields = make_entry()._fields()
    del fields["digest"]
    rejected(envelope(msgpack.packb(fields, use_bin_type=True)))


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
    rejected(envelope(payload))  # as the body of a well-formed envelope
    rejected(envelope(payload, sig=hmac.new(KEY, payload, hashlib.sha256).digest()), SignaturePolicy(KEY))
    pickled_entry = pickle.dumps(make_entry(), protocol=protocol)
    rejected(pickled_entry)
    rejected(envelope(pickled_entry))
    assert not (tmp_path / "pwned").exists()
    pickle.loads(payload)  # the trap is armed: unpickling it would have left the file
    assert (tmp_path / "pwned").exists()


def test_oversize_entries_are_rejected_before_decoding() -> None:
    data = encode_entry(make_entry())
    assert "exceeds" in rejected(data, max_bytes=len(data) - 1)
    assert decode_entry(data, UNSIGNED_OK, max_bytes=len(data)) == make_entry()


def test_oversize_strings_inside_are_rejected() -> None:
    huge_name = "n" * ((1 << 20) + 1)
    assert "decoded" in rejected(encode_entry(make_entry(input_names=[huge_name])))


# -- signatures ---------------------------------------------------------------------------------------
def test_signed_entry_with_the_right_key_is_accepted() -> None:
    decoded = decode_entry(encode_entry(make_entry(), KEY), SignaturePolicy(KEY))
    assert decoded == make_entry() and decoded.signed is True


def test_the_signature_is_an_hmac_of_the_body() -> None:
    outer = msgpack.unpackb(encode_entry(make_entry(), KEY), raw=False)
    assert outer["sig"] == hmac.new(KEY, outer["body"], hashlib.sha256).digest()


def test_signed_entry_with_a_wrong_key_is_rejected() -> None:
    data = encode_entry(make_entry(), OTHER_KEY)
    assert "signature" in rejected(data, SignaturePolicy(KEY))
    assert "signature" in rejected(data, SignaturePolicy(KEY, require_signed=False))


def test_tampered_signed_entry_is_rejected() -> None:
    data = bytearray(encode_entry(make_entry(), KEY))
    data[data.index(b"NKI-BINARY-MARKER")] ^= 0x20
    assert "signature" in rejected(bytes(data), SignaturePolicy(KEY))
    # A body re-signed by someone without the key: still wrong.
    forged_body = body_of(make_entry(), binary=b"x" * 10, digest=binary_digest(b"x" * 10))
    assert "signature" in rejected(envelope(forged_body, sig=b"\x00" * 32), SignaturePolicy(KEY))


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
    tampered[tampered.index(b"NKI-BINARY-MARKER")] ^= 0x20
    assert "digest" in rejected(bytes(tampered), SignaturePolicy(None))
