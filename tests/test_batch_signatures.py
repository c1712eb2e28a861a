"""Batch writer signatures (issue 22): one Ed25519 signature over the RFC 9162 Merkle root of a group of entries,
each entry carrying its leaf index, the group's size and its audit path. Forgeries of every part of that
section are rejected; a reader verifies one signature per group it reads."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from helpers_trust import fresh_tier, trusting
from test_entry import make_entry, rejected

from cachestore.entry import (
    MAGIC,
    SCHEMA_VERSION,
    decode_entry,
    seal,
    unsealed_entry,
    writer_of,
    writer_section,
)
from cachestore.merkle import inclusion_paths, leaf_hash, path_length, root_from_path, tree_root
from cachestore.settings import Settings
from cachestore.signatures import MAX_GROUP, signed_message
from cachestore.stores import open_tier
from cachestore.trust import WriterKey

KEYS = [hashlib.sha256(b"%d" % n).hexdigest() for n in range(MAX_GROUP + 40)]
SECTION_AT = len(MAGIC) + 2 + 32  # the writer section follows MAGIC, schema, flags and the digest (no HMAC)
PLACE_AT = SECTION_AT + 16 + 64  # leaf index (2 bytes), group size (2 bytes), then the path


def group(writer: WriterKey, size: int, first: int = 0) -> list[bytes]:
    keys = KEYS[first : first + size]
    return seal([unsealed_entry(make_entry(binary=b"bin %d" % n), None, writer, key) for n, key in enumerate(keys)],
                writer)  # fmt: skip


def with_digest(data: bytes, payload_at: int) -> bytes:
    """`data` with its header's SHA-256 recomputed over what follows `payload_at`: what any forger can do."""
    digest = hashlib.sha256(data[payload_at:]).digest()
    return data[: len(MAGIC) + 2] + digest + data[len(MAGIC) + 2 + 32 : payload_at] + data[payload_at:]


# -- the tree ----------------------------------------------------------------------------------------------
def test_tree_hashes_match_the_certificate_transparency_test_vectors() -> None:
    """RFC 6962/9162 roots of the reference inputs (certificate-transparency's merkle tests)."""
    inputs = [b"", b"\x00", b"\x10", b"\x20\x21", b"\x30\x31", b"\x40\x41\x42\x43",
              bytes(range(0x50, 0x58)), bytes(range(0x60, 0x70))]  # fmt: skip
    leaves = [leaf_hash(data) for data in inputs]
    assert leaves[0].hex() == "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
    assert tree_root(leaves[:2]).hex() == "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"
    assert tree_root(leaves[:3]).hex() == "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77"
    assert tree_root(leaves).hex() == "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, 64, 65])
def test_every_leaf_proves_the_root_and_no_other_index_or_path_length_does(size: int) -> None:
    leaves = [leaf_hash(b"%d" % n) for n in range(size)]
    root, paths = tree_root(leaves), inclusion_paths(leaves)
    for index, path in enumerate(paths):
        assert len(path) == path_length(index, size) <= (size - 1).bit_length()
        assert root_from_path(leaves[index], index, size, path) == root
        assert root_from_path(leaves[index], index, size, [*path, root]) != root  # extended
        assert all(root_from_path(leaves[index], other, size, path) != root for other in range(size) if other != index)
        if path:
            assert root_from_path(leaves[index], index, size, path[:-1]) != root  # truncated
    assert root_from_path(leaves[0], size, size, paths[0]) is None  # an index past the tree


# -- entries of one group ------------------------------------------------------------------------------------
def test_a_group_shares_one_signature_and_each_entry_decodes_under_its_own_key(ci: WriterKey) -> None:
    entries = group(ci, 13)
    sections = [writer_section(data) for data in entries]
    assert len({section.signature for section in sections}) == 1
    assert [(s.index, s.size, len(s.path)) for s in sections] == [(n, 13, path_length(n, 13)) for n in range(13)]
    policy = trusting(ci)
    for n, data in enumerate(entries):
        assert decode_entry(data, policy, cache_key=KEYS[n]).binary == b"bin %d" % n
        assert writer_of(data) == ci.key_id_hex
    assert policy.trust.verifies == 1  # one Ed25519 verify for the 13 entries


def test_a_fresh_reader_verifies_again_and_a_group_of_one_has_no_path(ci: WriterKey) -> None:
    entries = group(ci, 4)
    for _ in range(2):  # two processes: two fresh policies, each verifies its group once
        policy = trusting(ci)
        for n, data in enumerate(entries):
            decode_entry(data, policy, cache_key=KEYS[n])
        assert policy.trust.verifies == 1
    alone = group(ci, 1)[0]
    assert writer_section(alone).path == () and decode_entry(alone, trusting(ci), cache_key=KEYS[0]).signed


def test_an_entry_altered_after_signing_is_rejected_and_the_rest_of_its_group_still_verifies(ci: WriterKey) -> None:
    entries = group(ci, 8)
    payload_at = PLACE_AT + 4 + 32 * path_length(3, 8)
    altered = bytearray(entries[3])
    altered[-1] ^= 1  # a byte of the compressed body, and its digest made to match
    forged = with_digest(bytes(altered), payload_at)
    policy = trusting(ci)
    assert "does not verify" in rejected(forged, policy, cache_key=KEYS[3])
    for n in (0, 1, 2, 4, 5, 6, 7):
        assert decode_entry(entries[n], policy, cache_key=KEYS[n]).signed
    assert "does not verify" in rejected(forged, policy, cache_key=KEYS[3])  # still, with its group verified


def test_a_path_from_another_group_or_a_swapped_index_does_not_verify(ci: WriterKey) -> None:
    first, second = group(ci, 8), group(ci, 8, first=8)
    policy = trusting(ci)
    for n, data in enumerate(second):
        decode_entry(data, policy, cache_key=KEYS[8 + n])  # the second group's nodes are known to this reader
    grafted = first[5][:SECTION_AT] + second[5][SECTION_AT : PLACE_AT + 4 + 96] + first[5][PLACE_AT + 4 + 96 :]
    assert "does not verify" in rejected(grafted, policy, cache_key=KEYS[5])
    swapped = bytearray(first[5])
    swapped[PLACE_AT + 1] = 6  # leaf 6 of 8: the same path length, walked the other way
    assert "does not verify" in rejected(bytes(swapped), trusting(ci), cache_key=KEYS[5])


def test_a_truncated_extended_or_impossible_path_is_rejected(ci: WriterKey) -> None:
    data = group(ci, 4)[1]  # a path of 2 hashes
    assert "truncated" in rejected(data[: PLACE_AT + 4 + 40], trusting(ci), cache_key=KEYS[1])
    assert "truncated" in rejected(data[: PLACE_AT + 2], trusting(ci), cache_key=KEYS[1])
    # Claimed to be of a group of 8 (3 hashes), a hash added before the payload: the digest still matches.
    extended = data[:PLACE_AT] + (1).to_bytes(2, "big") + (8).to_bytes(2, "big") + data[PLACE_AT + 4 : PLACE_AT + 68]
    extended += b"\x07" * 32 + data[PLACE_AT + 68 :]  # the payload unchanged: only the signature can catch it
    assert "does not verify" in rejected(extended, trusting(ci), cache_key=KEYS[1])
    for index, size in ((4, 4), (0, 0), (9, 2)):
        bad = data[:PLACE_AT] + index.to_bytes(2, "big") + size.to_bytes(2, "big") + data[PLACE_AT + 4 :]
        assert f"leaf {index} of a group of {size}" in rejected(bad, trusting(ci), cache_key=KEYS[1])


def test_an_untrusted_writers_group_or_its_root_under_a_trusted_key_id_is_rejected(
    ci: WriterKey, laptop: WriterKey
) -> None:
    entries = group(laptop, 5)
    assert "does not trust" in rejected(entries[2], trusting(ci), cache_key=KEYS[2])
    claims_ci = entries[2][:SECTION_AT] + ci.key_id + entries[2][SECTION_AT + 16 :]
    both = trusting(ci, laptop)
    decode_entry(entries[2], both, cache_key=KEYS[2])  # the laptop's group is verified (and trusted) here
    assert "does not verify" in rejected(claims_ci, both, cache_key=KEYS[2])


def test_a_valid_entry_copied_under_another_key_does_not_verify_even_once_its_group_is(ci: WriterKey) -> None:
    entries = group(ci, 6)
    policy = trusting(ci)
    for n, data in enumerate(entries):
        decode_entry(data, policy, cache_key=KEYS[n])
    assert "does not verify" in rejected(entries[0], policy, cache_key=KEYS[1])
    assert "does not verify" in rejected(entries[0], trusting(ci), cache_key=KEYS[1])


def test_an_entry_signed_alone_before_batch_signatures_still_verifies(ci: WriterKey) -> None:
    """Flag bit 1: the writer signed the entry's own message (what writers wrote before batch signatures)."""
    batch = group(ci, 1)[0]
    digest, payload = batch[len(MAGIC) + 2 : SECTION_AT], batch[PLACE_AT + 4 :]
    signature = ci.sign(signed_message(SCHEMA_VERSION, 0x02, ci.key_id, KEYS[0], digest))
    alone = MAGIC + bytes((SCHEMA_VERSION, 0x02)) + digest + ci.key_id + signature + payload
    decoded = decode_entry(alone, trusting(ci), cache_key=KEYS[0])
    assert decoded.signed and decoded.writer == ci.key_id_hex and writer_section(alone).size == 0
    assert "does not verify" in rejected(alone, trusting(ci), cache_key=KEYS[1])
    both_kinds = alone[: len(MAGIC) + 1] + b"\x06" + alone[len(MAGIC) + 2 :]
    assert "two kinds" in rejected(both_kinds, trusting(ci), cache_key=KEYS[0])


def test_an_entry_of_an_earlier_writer_with_flag_bit_3_verifies_by_its_group_signature(ci: WriterKey) -> None:
    """Earlier writers set flag bit 3 and put 12 bytes no signature covers after the group size (a hint to
    their checkpoint chunk): a reader skips them, and the entry verifies by its group signature, forgeries
    still refused."""
    items = [unsealed_entry(make_entry(binary=b"bin %d" % n), None, ci, key) for n, key in enumerate(KEYS[:3])]
    flagged = [msgspec.structs.replace(item, head=item.head[: len(MAGIC) + 1] + b"\x0c" + item.head[len(MAGIC) + 2 :])
               for item in items]  # fmt: skip
    stored = [data[: PLACE_AT + 4] + b"\x07" * 12 + data[PLACE_AT + 4 :] for data in seal(flagged, ci)]
    policy = trusting(ci)
    for n, data in enumerate(stored):
        decoded = decode_entry(data, policy, cache_key=KEYS[n])
        assert decoded.signed and decoded.writer == ci.key_id_hex and decoded.binary == b"bin %d" % n
    assert policy.trust.verifies == 1
    assert "does not verify" in rejected(stored[0], trusting(ci), cache_key=KEYS[1])
    cleared = stored[0][: len(MAGIC) + 1] + b"\x04" + stored[0][len(MAGIC) + 2 :]  # bit 3 off: read as a path
    assert rejected(cleared, trusting(ci), cache_key=KEYS[0])


def test_seal_refuses_a_group_too_large_or_prepared_for_another_key(ci: WriterKey, laptop: WriterKey) -> None:
    items = [unsealed_entry(make_entry(), None, ci, key) for key in KEYS[: MAX_GROUP + 1]]
    with pytest.raises(ValueError, match="1 to 64"):
        seal(items, ci)
    with pytest.raises(ValueError, match="another writer key"):
        seal(items[:2], laptop)


# -- the client -----------------------------------------------------------------------------------------------
@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    yield from fresh_tier(request, tmp_path)


def test_a_writers_flush_signs_its_entries_in_groups_of_at_most_max_group(
    base: Settings, tmp_path: Path, ci: WriterKey
) -> None:
    """On every tier a fresh trusted reader verifies one signature a group, not one an entry."""
    policy = tmp_path / "trust.toml"
    policy.write_text(ci.policy_entry("ci"))
    # A long gathering time: close() ends it, so the entries go out in one send.
    settings = base.replace(flush_interval=30)
    writer = open_tier(settings.replace(writer_key_file=str(tmp_path / "ci.key"), trust_policy=str(policy)))
    count = MAX_GROUP + 36  # one send: two groups of 50, not 64 and 36
    for n, key in enumerate(KEYS[:count]):
        writer.publish(key, make_entry(binary=b"published %d" % n))
    writer.close(timeout=10)
    reader = open_tier(settings.replace(trust_policy=str(policy), tier_mode="read-only"))
    try:
        found, _ = reader.find_many(KEYS[:count])
        assert len(found) == count and reader.counts()["tier_rejected"] == 0
        sections = [writer_section(entry.stored) for entry in found.values()]
        assert sorted({s.size for s in sections}) == [50] and len({s.signature for s in sections}) == 2
        assert reader.policy.trust.verifies == 2
    finally:
        reader.close()
