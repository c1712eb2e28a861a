"""Writer checkpoints (issue 22, cachestore.checkpoint): a writer signs the list of what it stored (cache key,
payload SHA-256), chunk by chunk; a reader that verified a chunk checks the entries it lists by a lookup alone, and
any entry the chunk does not vouch for (a forged, stale, garbage, missing or old-format chunk) falls back to its
own group signature. A writer's latest chunk comes with a fresh reader's first read."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers_graphs import delete_namespace, unique_namespace
from helpers_trust import trust_of as trusting
from test_entry import make_entry

import cachestore.checkpoint as checkpoint_module
import cachestore.entry as entry_module
import cachestore.trust as trust_module
from bridge.identity import toolchain_id
from cachestore.backends.redis import RedisBackend
from cachestore.checkpoint import (
    MAX_CHECKPOINT_BYTES,
    REF_BYTES,
    CheckpointLog,
    CheckpointReader,
    CheckpointRejected,
    chunk_ref,
    decode_checkpoint,
    encode_checkpoint,
    listing_id,
)
from cachestore.client import TierClient, open_tier
from cachestore.entry import (
    SCHEMA_VERSION,
    Entry,
    EntryRejected,
    SignaturePolicy,
    decode_entries,
    decode_entry,
    seal,
    unsealed_entry,
    writer_section,
)
from cachestore.inspect import collect_garbage
from cachestore.keys import KeySpace
from cachestore.merkle import leaf_hash
from cachestore.settings import Settings
from cachestore.trust import TrustPolicy, WriterKey, entry_leaf, signed_message, write_writer_key

KEYS = [hashlib.sha256(b"checkpoint %d" % n).hexdigest() for n in range(64)]
PARTITION = "tc-test"
INSTANCE = b"\x01" * 8
SCHEMA = SCHEMA_VERSION


def pair(cache_key: str, payload: bytes) -> bytes:
    return listing_id(cache_key) + hashlib.sha256(payload).digest()


class Store:
    """Checkpoint chunks by (key id hex, instance hex, chunk), as a backend would hand them over; counts fetches."""

    def __init__(self) -> None:
        self.chunks: dict[tuple[str, str, int], object] = {}
        self.fetches = 0

    def put(self, log: CheckpointLog) -> None:
        for record in log.records():
            self.chunks[(record.key_id_hex, record.instance_hex, record.chunk)] = record.data
        log.written(log.records())

    def fetch(self, key_id_hex: str, instance_hex: str, chunk: int) -> object:
        self.fetches += 1
        return self.chunks.get((key_id_hex, instance_hex, chunk))


def written(writer: WriterKey, log: CheckpointLog | None, groups: list[list[str]]) -> dict[str, bytes]:
    """Entries stored by `writer`, a group per list of cache keys, listed in `log` when one is given."""
    stored = {}
    for keys in groups:
        items = [unsealed_entry(make_entry(binary=key.encode()), None, writer, key, log is not None) for key in keys]
        refs = log.place([item.listed for item in items]) if log is not None else None
        stored.update(zip(keys, seal(items, writer, refs), strict=True))
    return stored


def reading(trust: TrustPolicy, store: Store, partition: str = PARTITION) -> SignaturePolicy:
    return SignaturePolicy(trust=trust, checkpoints=CheckpointReader(store.fetch, trust, partition, SCHEMA))


def read_all(entries: dict[str, bytes], policy: SignaturePolicy) -> dict[str, str]:
    """cache key -> "ok" or the reason the entry was rejected."""
    result = {}
    for key, data in entries.items():
        try:
            decode_entry(data, policy, cache_key=key)
            result[key] = "ok"
        except EntryRejected as exc:
            result[key] = exc.reason
    return result


# -- the format -------------------------------------------------------------------------------------------------
def test_an_entrys_leaf_is_the_merkle_leaf_of_its_signed_message(ci: WriterKey) -> None:
    digest = hashlib.sha256(b"payload").digest()
    message = signed_message(3, 0x0C, ci.key_id, KEYS[0], digest)
    assert entry_leaf(3, 0x0C, ci.key_id, KEYS[0], digest) == leaf_hash(message)


def test_a_chunk_verifies_once_and_lists_its_pairs(ci: WriterKey) -> None:
    pairs = [pair(KEYS[n], b"%d" % n) for n in range(5)]
    data = encode_checkpoint(ci, PARTITION, SCHEMA, INSTANCE, 7, pairs)
    trust = trusting(ci)
    assert decode_checkpoint(data, ci.key_id, PARTITION, SCHEMA, chunk_ref(INSTANCE, 7), trust) == b"".join(pairs)
    assert trust.verifies == 1
    assert len(data) == 37 + 64 * 5 + 64  # header, pairs, signature


def test_a_listing_id_is_a_hex_keys_raw_bytes_and_any_other_keys_hash() -> None:
    assert listing_id(KEYS[0]) == bytes.fromhex(KEYS[0])
    assert listing_id("k1") == hashlib.sha256(b"k1").digest()
    # An upper-case or spaced spelling of a listed key is another key: it is hashed, never read as the same bytes.
    assert listing_id(KEYS[0].upper()) == hashlib.sha256(KEYS[0].upper().encode()).digest() != listing_id(KEYS[0])
    assert listing_id(" ".join(KEYS[0][i : i + 2] for i in range(0, 64, 2))) != listing_id(KEYS[0])
    assert len(listing_id("\ud800 a lone surrogate")) == 32  # any str a caller names a key with


@pytest.mark.parametrize("changed", ["version 1", "another schema"])
def test_a_chunk_of_another_format_or_entry_schema_is_rejected_without_a_verify(ci: WriterKey, changed: str) -> None:
    """A version-1 chunk (leaf hashes, as written before) or one listing entries of another schema: its entries
    are not read through it (they verify by their own group signatures)."""
    data = bytearray(encode_checkpoint(ci, PARTITION, SCHEMA, INSTANCE, 0, [pair(KEYS[0], b"p")]))
    data[3 if changed == "version 1" else 4] = 1 if changed == "version 1" else SCHEMA + 1
    trust = trusting(ci)
    with pytest.raises(CheckpointRejected, match="version" if changed == "version 1" else "schema"):
        decode_checkpoint(bytes(data), ci.key_id, PARTITION, SCHEMA, chunk_ref(INSTANCE, 0), trust)
    assert trust.verifies == 0


def test_a_chunk_signed_by_an_untrusted_key_is_rejected(ci: WriterKey, laptop: WriterKey) -> None:
    data = encode_checkpoint(laptop, PARTITION, SCHEMA, INSTANCE, 0, [b"\x00" * 64])
    with pytest.raises(CheckpointRejected, match="does not trust"):
        decode_checkpoint(data, laptop.key_id, PARTITION, SCHEMA, chunk_ref(INSTANCE, 0), trusting(ci))


def test_a_chunk_of_one_key_claiming_anothers_id_is_rejected(ci: WriterKey, laptop: WriterKey) -> None:
    """laptop signs a chunk whose header names ci's key id: it is fetched for ci's entries and verified with ci's
    key, and fails. Fetched for laptop's own ref it names the wrong writer."""
    own = encode_checkpoint(laptop, PARTITION, SCHEMA, INSTANCE, 0, [b"\x01" * 64])
    claimed = own[:5] + ci.key_id + own[5 + 16 :]
    with pytest.raises(CheckpointRejected, match="does not verify"):
        decode_checkpoint(claimed, ci.key_id, PARTITION, SCHEMA, chunk_ref(INSTANCE, 0), trusting(ci, laptop))
    with pytest.raises(CheckpointRejected, match="names writer"):
        decode_checkpoint(claimed, laptop.key_id, PARTITION, SCHEMA, chunk_ref(INSTANCE, 0), trusting(ci, laptop))


def test_a_chunk_copied_to_another_partition_chunk_or_altered_is_rejected(ci: WriterKey) -> None:
    data = encode_checkpoint(ci, PARTITION, SCHEMA, INSTANCE, 3, [b"\x02" * 64, b"\x03" * 64])
    trust = trusting(ci)
    with pytest.raises(CheckpointRejected, match="does not verify"):  # another toolchain or scope
        decode_checkpoint(data, ci.key_id, "tc-test:scope:w-x", SCHEMA, chunk_ref(INSTANCE, 3), trust)
    with pytest.raises(CheckpointRejected, match="names writer"):  # stored where another chunk goes
        decode_checkpoint(data, ci.key_id, PARTITION, SCHEMA, chunk_ref(INSTANCE, 4), trust)
    for at in (40, 37 + 64 + 40):  # a cache key's listing id; a payload digest
        altered = bytearray(data)
        altered[at] ^= 1
        with pytest.raises(CheckpointRejected, match="does not verify"):
            decode_checkpoint(bytes(altered), ci.key_id, PARTITION, SCHEMA, chunk_ref(INSTANCE, 3), trust)


@pytest.mark.parametrize(
    "garbage",
    [b"", b"NKK", b"garbage" * 20, "a string", 12345, ["a", "list"], None, b"\x00" * (MAX_CHECKPOINT_BYTES + 1)],
    ids=["empty", "magic", "garbage", "str", "int", "list", "none", "huge"],
)
def test_garbage_under_a_chunks_name_is_rejected_without_a_verify(ci: WriterKey, garbage: object) -> None:
    trust = trusting(ci)
    with pytest.raises(CheckpointRejected):
        decode_checkpoint(garbage, ci.key_id, PARTITION, SCHEMA, chunk_ref(INSTANCE, 0), trust)
    assert trust.verifies == 0


def test_a_truncated_extended_or_lying_chunk_is_rejected(ci: WriterKey) -> None:
    data = encode_checkpoint(ci, PARTITION, SCHEMA, INSTANCE, 0, [b"\x04" * 64, b"\x05" * 64])
    trust, ref = trusting(ci), chunk_ref(INSTANCE, 0)
    lying_count = data[:33] + (1000).to_bytes(4, "big") + data[37:]
    for bad in (data[:-1], data + b"\x00", data[: -64 - 32] + data[-64:], data[: -64 - 64] + data[-64:], lying_count):
        with pytest.raises(CheckpointRejected):
            decode_checkpoint(bad, ci.key_id, PARTITION, SCHEMA, ref, trust)
    assert trust.verifies == 0


def test_the_log_freezes_a_full_chunk_and_begins_another(ci: WriterKey, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_module, "MAX_CHUNK_PAIRS", 3)
    log = CheckpointLog(ci, PARTITION, SCHEMA)
    listed = [(KEYS[n], hashlib.sha256(b"%d" % n).digest()) for n in range(7)]
    refs = log.place(listed[:2] + listed[:1])  # the same entry again is listed once
    assert refs == [chunk_ref(log.instance, 0)] * 3
    refs = log.place(listed[2:])
    assert [ref[-4:] for ref in refs] == [(n).to_bytes(4, "big") for n in (0, 1, 1, 1, 2)]
    records = log.records()
    assert [(r.chunk, r.count) for r in records] == [(0, 3), (1, 3), (2, 1)]
    log.written(records)
    assert log.records() == []
    log.place([(KEYS[9], b"\x09" * 32)])
    assert [(r.chunk, r.count) for r in log.records()] == [(2, 2)]  # only the current chunk, grown, is rewritten


# -- a reader ---------------------------------------------------------------------------------------------------
def test_a_reader_verifies_one_chunk_for_many_groups(ci: WriterKey) -> None:
    log, store = CheckpointLog(ci, PARTITION, SCHEMA), Store()
    entries = written(ci, log, [KEYS[0:5], KEYS[5:12], KEYS[12:13], KEYS[13:20]])
    store.put(log)
    policy = reading(trusting(ci), store)
    assert set(read_all(entries, policy).values()) == {"ok"}
    assert (policy.trust.verifies, store.fetches) == (1, 1)  # four groups: four verifies without the checkpoint


def test_a_forged_entry_and_a_forged_chunk_listing_it_are_both_rejected(ci: WriterKey, laptop: WriterKey) -> None:
    """laptop forges an entry claiming ci as its writer, and a chunk (its own signature, ci's id) listing the
    forged entry's key and payload: the chunk is rejected, the entry falls back to its group signature, and is
    rejected."""
    log, store = CheckpointLog(ci, PARTITION, SCHEMA), Store()
    honest = written(ci, log, [KEYS[0:3]])
    store.put(log)
    forger_log = CheckpointLog(laptop, PARTITION, SCHEMA)
    forged = written(laptop, forger_log, [KEYS[3:4]])[KEYS[3]]
    forged = forged[:37] + ci.key_id + forged[37 + 16 :]  # the header names ci
    section = writer_section(forged)
    assert section is not None and section.key_id == ci.key_id
    planted = encode_checkpoint(laptop, PARTITION, SCHEMA, forger_log.instance, 0, [listing_id(KEYS[3]) + forged[5:37]])
    planted = planted[:5] + ci.key_id + planted[5 + 16 :]
    store.chunks[(ci.key_id_hex, forger_log.instance.hex(), 0)] = planted
    policy = reading(trusting(ci), store)
    result = read_all({**honest, KEYS[3]: forged}, policy)
    assert [result[key] for key in KEYS[0:3]] == ["ok"] * 3
    assert "does not verify" in result[KEYS[3]]
    assert policy.checkpoints.rejected == 1


def test_a_chunk_replaced_by_an_older_version_leaves_the_newer_entries_to_their_group_signatures(
    ci: WriterKey,
) -> None:
    log, store = CheckpointLog(ci, PARTITION, SCHEMA), Store()
    first = written(ci, log, [KEYS[0:4]])
    store.put(log)
    older = dict(store.chunks)
    later = written(ci, log, [KEYS[4:8], KEYS[8:10]])
    store.put(log)
    store.chunks.update(older)  # a stale copy put back (a restore, a replica, a hand)
    policy = reading(trusting(ci), store)
    assert set(read_all({**first, **later}, policy).values()) == {"ok"}
    assert policy.trust.verifies == 3  # the chunk, then each of the two later groups by its own signature
    assert store.fetches == 1  # the later entries do not make the reader fetch the chunk again at once


@pytest.mark.parametrize("stored", ["missing", "garbage", "wrong type"])
def test_entries_of_a_missing_or_garbage_chunk_verify_by_their_group_signature(ci: WriterKey, stored: str) -> None:
    """What a reader finds when the writer was killed between its entries and its checkpoint, or something else
    stands under the chunk's name."""
    log, store = CheckpointLog(ci, PARTITION, SCHEMA), Store()
    entries = written(ci, log, [KEYS[0:4], KEYS[4:6]])
    if stored != "missing":
        key = (ci.key_id_hex, log.instance.hex(), 0)
        store.chunks[key] = b"NKK garbage" if stored == "garbage" else {"a": "hash"}
    policy = reading(trusting(ci), store)
    assert set(read_all(entries, policy).values()) == {"ok"}
    assert policy.trust.verifies == 2 and store.fetches == 1


def test_entries_of_a_verified_group_fetch_no_missing_chunk_again(
    ci: WriterKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once an entry's group signature verified (its chunk missing: the writer died before writing it), reading
    it again asks the tier for nothing, however long after."""
    log, store = CheckpointLog(ci, PARTITION, SCHEMA), Store()
    entries = written(ci, log, [KEYS[0:4]])
    policy = reading(trusting(ci), store)
    assert set(read_all(entries, policy).values()) == {"ok"}
    assert (policy.trust.verifies, store.fetches) == (1, 1)
    monkeypatch.setattr(checkpoint_module, "REFETCH_SECONDS", 0.0)  # as if long after
    assert set(read_all(entries, policy).values()) == {"ok"}
    assert set(read_all_at_once(entries, policy).values()) == {"ok"}
    assert (policy.trust.verifies, store.fetches) == (1, 1)


def test_a_chunk_ref_pointing_elsewhere_costs_the_fallback_only(ci: WriterKey) -> None:
    """The ref is a hint the signature does not cover: changed, the entry still verifies by its group."""
    log, store = CheckpointLog(ci, PARTITION, SCHEMA), Store()
    entries = written(ci, log, [KEYS[0:2]])
    store.put(log)
    data = entries[KEYS[0]]
    ref_at = 37 + 16 + 64 + 4
    assert data[ref_at : ref_at + REF_BYTES] == chunk_ref(log.instance, 0)
    moved = data[:ref_at] + chunk_ref(log.instance, 99) + data[ref_at + REF_BYTES :]
    policy = reading(trusting(ci), store)
    assert read_all({KEYS[0]: moved}, policy) == {KEYS[0]: "ok"}
    assert policy.trust.verifies == 1 and policy.checkpoints.loaded == 0


def test_an_untrusted_writers_chunk_is_never_fetched(ci: WriterKey, laptop: WriterKey) -> None:
    log, store = CheckpointLog(laptop, PARTITION, SCHEMA), Store()
    entries = written(laptop, log, [KEYS[0:3]])
    store.put(log)
    policy = reading(trusting(ci), store)
    assert all("does not trust" in reason for reason in read_all(entries, policy).values())
    assert store.fetches == 0 and policy.trust.verifies == 0


def test_a_listed_entry_moved_under_another_listed_key_is_rejected(ci: WriterKey) -> None:
    """A transplant: KEYS[0]'s honest entry copied under KEYS[1], which the verified chunk lists with another
    payload. The lookup does not match, and its own group signature covers KEYS[0], not KEYS[1]."""
    log, store = CheckpointLog(ci, PARTITION, SCHEMA), Store()
    entries = written(ci, log, [KEYS[0:2]])
    store.put(log)
    policy = reading(trusting(ci), store)
    assert read_all(entries, policy) == {KEYS[0]: "ok", KEYS[1]: "ok"}
    moved = read_all({KEYS[1]: entries[KEYS[0]]}, policy)
    assert "does not verify" in moved[KEYS[1]]


def test_the_listings_start_again_past_their_bound_and_their_entries_still_verify(
    ci: WriterKey, laptop: WriterKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound is over every trusted writer's listing together: many writers cannot grow a reader's memory."""
    monkeypatch.setattr(trust_module, "VERIFIED_MEMO_SIZE", 6)
    monkeypatch.setattr(checkpoint_module, "MAX_CHUNK_PAIRS", 4)
    log, laptop_log, store = CheckpointLog(ci, PARTITION, SCHEMA), CheckpointLog(laptop, PARTITION, SCHEMA), Store()
    entries = written(ci, log, [KEYS[0:4], KEYS[4:8]])
    entries.update(written(laptop, laptop_log, [KEYS[8:12]]))
    store.put(log)
    store.put(laptop_log)
    trust = trusting(ci, laptop)
    policy = reading(trust, store)
    assert set(read_all(entries, policy).values()) == {"ok"}
    assert sum(len(listing) for listing in trust.listings.values()) <= 6  # three chunks of four loaded
    assert (trust.verifies, policy.checkpoints.loaded) == (3, 3)
    assert set(read_all(entries, policy).values()) == {"ok"}  # the earlier chunks' entries by their groups again


def test_a_first_read_asks_for_a_bounded_number_of_latest_chunks_once(tmp_path: Path) -> None:
    keys = [write_writer_key(tmp_path / f"w{n}.key", f"w{n}") for n in range(checkpoint_module.LATEST_WRITERS + 3)]
    trust = trusting(*keys)
    reader = CheckpointReader(Store().fetch, trust, PARTITION, SCHEMA)
    assert reader.latest_wanted() == [key.key_id_hex for key in keys[: checkpoint_module.LATEST_WRITERS]]
    assert reader.latest_wanted() == []


def test_an_offered_chunk_of_an_untrusted_writer_or_over_the_size_is_not_kept(ci: WriterKey, laptop: WriterKey) -> None:
    reader = CheckpointReader(Store().fetch, trusting(ci), PARTITION, SCHEMA)
    reader.offer(laptop.key_id, encode_checkpoint(laptop, PARTITION, SCHEMA, INSTANCE, 0, [b"\x01" * 64]))
    reader.offer(ci.key_id, b"\x00" * (MAX_CHECKPOINT_BYTES + 1))
    reader.offer(ci.key_id, {"not": "bytes"})
    assert reader._offered == {}


# -- on Redis ---------------------------------------------------------------------------------------------------
@pytest.fixture
def redis_settings(redis_url: str, tmp_path: Path, ci: WriterKey) -> Iterator[Settings]:
    namespace = unique_namespace()
    policy = tmp_path / "trust.toml"
    policy.write_text(ci.policy_entry("ci"))
    yield Settings(tier=redis_url, namespace=namespace, host="h", flush_interval=0.05, trust_policy=str(policy))
    client = redis.Redis.from_url(redis_url)
    delete_namespace(client, namespace)
    client.close()


def publish_all(writer: TierClient, keys: list[str]) -> None:
    for n, key in enumerate(keys):
        writer.publish(key, make_entry(binary=b"checkpointed " + key.encode()))
        if n % 4 == 3:
            assert writer.flush(10)  # several flushes: several groups, one chunk
    assert writer.flush(10)


def checkpoint_keys(settings: Settings, key_id_hex: str | None = None) -> list[bytes]:
    client = redis.Redis.from_url(settings.tier)
    try:
        return list(client.scan_iter(match=KeySpace(settings.namespace).checkpoint_pattern(key_id_hex), count=1000))
    finally:
        client.close()


@contextlib.contextmanager
def read_cleanly(settings: Settings, keys: list[str]) -> Iterator[TierClient]:
    """A fresh read-only reader that read `keys` at once: every entry found, none rejected, no tier error."""
    reader = open_tier(settings.replace(tier_mode="read-only"))
    try:
        found, _ = reader.find_many(keys)
        counts = reader.counts()
        assert len(found) == len(keys) and counts["tier_rejected"] == counts["tier_errors"] == 0 and reader.available
        yield reader
    finally:
        reader.close()


def latest_key(settings: Settings, key_id_hex: str) -> str:
    return KeySpace(settings.namespace).checkpoint_latest(toolchain_id(), key_id_hex)


def test_on_redis_a_fresh_reader_verifies_the_writers_chunk_once_from_its_first_read(
    redis_settings: Settings, tmp_path: Path, ci: WriterKey
) -> None:
    """The writer's chunk, and its copy under the key's latest, which the reader's first read brings along."""
    writer = open_tier(redis_settings.replace(writer_key_file=str(tmp_path / "ci.key")))
    publish_all(writer, KEYS[:12])
    writer.close()
    keys = checkpoint_keys(redis_settings)
    latest = latest_key(redis_settings, ci.key_id_hex)
    assert len(keys) == 2 and latest.encode() in keys
    client = redis.Redis.from_url(redis_settings.tier)
    assert all(0 < client.ttl(key) <= redis_settings.entry_ttl for key in keys)
    assert client.get(latest) == client.get(next(key for key in keys if key != latest.encode()))
    client.close()
    reader = open_tier(redis_settings.replace(tier_mode="read-only"))
    try:
        found, _ = reader.find_many(KEYS[:12])
        assert len(found) == 12 and reader.counts()["tier_rejected"] == 0
        assert len({writer_section(e.stored).signature for e in found.values()}) >= 3  # groups
        assert (reader.policy.trust.verifies, reader.checkpoints.fetches, reader.checkpoints.loaded) == (1, 0, 1)
    finally:
        reader.close()


def test_on_redis_only_a_processs_first_read_brings_the_latest_chunks(
    redis_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = open_tier(redis_settings.replace(writer_key_file=str(tmp_path / "ci.key")))
    publish_all(writer, KEYS[:8])
    writer.close()
    reader = open_tier(redis_settings.replace(tier_mode="read-only"))
    asked: list[list[str]] = []
    inner = RedisBackend.fetch_with_latest
    monkeypatch.setattr(
        RedisBackend, "fetch_with_latest", lambda self, keys, ttl, w: asked.append(list(w)) or inner(self, keys, ttl, w)
    )
    try:
        assert reader.lookup(KEYS[0]) is not None  # a lookup of one key brings them too
        assert len(reader.find_many(KEYS[1:8])[0]) == 7 and reader.lookup(KEYS[0]) is not None
        assert asked == [[key_id.hex() for key_id in reader.policy.trust.writers]]
        assert (reader.policy.trust.verifies, reader.checkpoints.fetches) == (1, 0)
    finally:
        reader.close()


@pytest.mark.parametrize("planted", ["garbage", "wrong type", "forged", "huge", "another process's"])
def test_on_redis_a_bad_or_other_latest_chunk_costs_the_named_chunks_fetch_only(
    redis_settings: Settings, tmp_path: Path, ci: WriterKey, laptop: WriterKey, planted: str
) -> None:
    """Whatever stands under a writer's latest (garbage, another type, a chunk the laptop signed naming ci's id
    and chunk, more than a chunk's bytes, or the chunk of another process of the same key, which wrote last): the
    reader's entries verify, by the chunk they name, fetched; no tier error, no rejection."""
    writer = open_tier(redis_settings.replace(writer_key_file=str(tmp_path / "ci.key")))
    publish_all(writer, KEYS[:8])
    ref = writer._checkpoint_log.instance + bytes(4)  # type: ignore[union-attr]
    writer.close()
    latest = latest_key(redis_settings, ci.key_id_hex)
    client = redis.Redis.from_url(redis_settings.tier)
    client.delete(latest)
    if planted == "wrong type":
        client.hset(latest, mapping={"not": "a chunk"})
    elif planted == "forged":
        chunk = encode_checkpoint(laptop, PARTITION, SCHEMA, ref[:8], 0, [b"\x07" * 64])
        client.set(latest, chunk[:5] + ci.key_id + chunk[21:])
    else:
        other = {"garbage": b"NKK garbage", "huge": b"\x00" * (MAX_CHECKPOINT_BYTES + 1)}
        if planted == "another process's":
            second = open_tier(redis_settings.replace(writer_key_file=str(tmp_path / "ci.key")))
            publish_all(second, KEYS[20:22])
            second.close()
        else:
            client.set(latest, other[planted])
    client.close()
    with read_cleanly(redis_settings, KEYS[:8]) as reader:
        assert reader.checkpoints.fetches == 1 and reader.checkpoints.loaded == 1
        assert reader.policy.trust.verifies == (2 if planted == "forged" else 1)  # the forgery's own, refused
        if planted == "another process's":  # kept, it serves the entries of the process that wrote it
            assert len(reader.find_many(KEYS[20:22])[0]) == 2
            assert (reader.checkpoints.fetches, reader.checkpoints.loaded) == (1, 2)


def test_on_redis_a_reference_is_listed_in_the_checkpoint_too(redis_settings: Settings, tmp_path: Path) -> None:
    """An entry whose binary another key holds is stored as a reference, sealed in the backend's store: it is
    listed in the chunk as well, so its first hit costs no verify of its own."""
    writer = open_tier(redis_settings.replace(writer_key_file=str(tmp_path / "ci.key")))
    writer.publish(KEYS[0], make_entry(binary=b"shared"))
    assert writer.flush(10)
    writer.publish(KEYS[1], make_entry(binary=b"shared"))
    writer.close()
    reader = open_tier(redis_settings.replace(tier_mode="read-only"))
    try:
        found, _ = reader.find_many(KEYS[:2])
        assert found[KEYS[1]].binary == b"shared" and reader.counts()["tier_rejected"] == 0
        raw = reader._backend.fetch([KEYS[1]], None)[KEYS[1]]
        assert decode_entry(raw, SignaturePolicy(), cache_key=KEYS[1]).is_reference
        assert writer_section(raw).chunk and (reader.policy.trust.verifies, reader.checkpoints.loaded) == (1, 1)
    finally:
        reader.close()


def test_on_redis_a_wrong_type_under_the_chunk_costs_no_tier_error(redis_settings: Settings, tmp_path: Path) -> None:
    writer = open_tier(redis_settings.replace(writer_key_file=str(tmp_path / "ci.key")))
    publish_all(writer, KEYS[:8])
    writer.close()
    client = redis.Redis.from_url(redis_settings.tier)
    for key in checkpoint_keys(redis_settings):  # the chunk and the key's latest
        client.delete(key)
        client.hset(key, mapping={"not": "a chunk"})
    client.close()
    with read_cleanly(redis_settings, KEYS[:8]) as reader:
        assert reader.policy.trust.verifies == 2  # the two groups, by their own signatures


def test_on_redis_a_writer_killed_before_its_checkpoint_leaves_entries_that_verify(
    redis_settings: Settings, tmp_path: Path
) -> None:
    """The entries went out and the checkpoint never did (as if the writer died between them)."""
    writer = open_tier(redis_settings.replace(writer_key_file=str(tmp_path / "ci.key")))
    writer.publish(KEYS[0], make_entry())  # the log exists once the first entry is prepared
    assert writer.flush(10)
    writer._checkpoint_log.records = list  # type: ignore[union-attr,method-assign]
    client = redis.Redis.from_url(redis_settings.tier)
    for key in checkpoint_keys(redis_settings):
        client.delete(key)
    client.close()
    publish_all(writer, KEYS[1:6])
    writer.close()
    assert checkpoint_keys(redis_settings) == []
    reader = open_tier(redis_settings.replace(tier_mode="read-only"))
    try:
        found, _ = reader.find_many(KEYS[:6])
        assert len(found) == 6 and reader.counts()["tier_rejected"] == 0
        assert reader.checkpoints.loaded == 0 and reader.policy.trust.verifies >= 2
    finally:
        reader.close()


def test_on_redis_gc_by_writer_removes_its_checkpoints(redis_settings: Settings, tmp_path: Path, ci: WriterKey) -> None:
    writer = open_tier(redis_settings.replace(writer_key_file=str(tmp_path / "ci.key")))
    publish_all(writer, KEYS[:4])
    writer.close()
    other = write_writer_key(tmp_path / "other.key", "other")
    (tmp_path / "both.toml").write_text(ci.policy_entry("ci") + other.policy_entry("other"))
    both = redis_settings.replace(trust_policy=str(tmp_path / "both.toml"))
    second = open_tier(both.replace(writer_key_file=str(tmp_path / "other.key")))
    publish_all(second, KEYS[4:6])
    second.close()
    assert len(checkpoint_keys(redis_settings, ci.key_id_hex)) == 2  # its process's chunk and its latest
    from cachestore.api import open_backend

    reader = open_backend(both, reading=True)
    try:
        dry = collect_garbage(reader, SignaturePolicy(), writer=ci.key_id_hex, dry_run=True)
        assert dry["checkpoints_evicted"] == 2 and len(checkpoint_keys(redis_settings, ci.key_id_hex)) == 2
        done = collect_garbage(reader, SignaturePolicy(), writer=ci.key_id_hex)
        assert done["checkpoints_evicted"] == 2 and done["evicted"] == 4
    finally:
        reader.close()
    assert checkpoint_keys(redis_settings, ci.key_id_hex) == []
    assert len(checkpoint_keys(redis_settings, other.key_id_hex)) == 2  # another writer's stay


def test_a_local_tier_keeps_no_checkpoints_and_its_entries_verify(tmp_path: Path, ci: WriterKey) -> None:
    policy = tmp_path / "trust.toml"
    policy.write_text(ci.policy_entry("ci"))
    settings = Settings(tier=f"local:{tmp_path / 'tier.sqlite'}", host="h", flush_interval=0.05,
                        trust_policy=str(policy))  # fmt: skip
    writer = open_tier(settings.replace(writer_key_file=str(tmp_path / "ci.key")))
    publish_all(writer, KEYS[:4])
    writer.close()
    reader = open_tier(settings.replace(tier_mode="read-only"))
    try:
        found, _ = reader.find_many(KEYS[:4])
        assert len(found) == 4 and reader.checkpoints is None
        assert all(not writer_section(entry.stored).chunk for entry in found.values())
    finally:
        reader.close()


# -- a read's entries checked in one loop (cachestore.entry.decode_entries, check_writers) ------------------------
def read_all_at_once(entries: dict[str, bytes], policy: SignaturePolicy) -> dict[str, str]:
    results = decode_entries(entries, policy)
    assert list(results) == list(entries)
    return {key: "ok" if isinstance(result, Entry) else result.reason for key, result in results.items()}


def _scenario(name: str, ci: WriterKey, laptop: WriterKey) -> tuple[dict[str, bytes], Store]:
    """Entries and the chunks a store holds, for each case a reader must fall back or reject in."""
    log, store = CheckpointLog(ci, PARTITION, SCHEMA), Store()
    entries = written(ci, log, [KEYS[0:4], KEYS[4:6]])
    if name == "listed":
        store.put(log)
    elif name in ("garbage", "wrong type"):
        store.chunks[(ci.key_id_hex, log.instance.hex(), 0)] = b"NKK garbage" if name == "garbage" else {"a": "b"}
    elif name == "stale":
        first = written(ci, log, [KEYS[6:9]])
        store.put(log)
        older = dict(store.chunks)
        entries.update(first)
        entries.update(written(ci, log, [KEYS[9:12], KEYS[12:14]]))
        store.put(log)
        store.chunks.update(older)
    elif name == "ref elsewhere":
        store.put(log)
        ref_at = 37 + 16 + 64 + 4
        data = entries[KEYS[0]]
        entries[KEYS[0]] = data[:ref_at] + chunk_ref(log.instance, 99) + data[ref_at + REF_BYTES :]
    elif name == "forged":
        store.put(log)
        forger_log = CheckpointLog(laptop, PARTITION, SCHEMA)
        forged = written(laptop, forger_log, [KEYS[20:21]])[KEYS[20]]
        forged = forged[:37] + ci.key_id + forged[37 + 16 :]
        listed = listing_id(KEYS[20]) + forged[5:37]
        planted = encode_checkpoint(laptop, PARTITION, SCHEMA, forger_log.instance, 0, [listed])
        store.chunks[(ci.key_id_hex, forger_log.instance.hex(), 0)] = planted[:5] + ci.key_id + planted[21:]
        entries[KEYS[20]] = forged
    elif name == "untrusted":
        laptop_log = CheckpointLog(laptop, PARTITION, SCHEMA)
        entries.update(written(laptop, laptop_log, [KEYS[30:33]]))
        store.put(laptop_log)
        store.put(log)
    elif name == "corrupt":
        store.put(log)
        entries[KEYS[1]] = entries[KEYS[1]][:-3] + b"bad"  # the digest no longer matches
        entries[KEYS[2]] = b"not an entry"
    return entries, store


@pytest.mark.parametrize(
    "case", ["listed", "missing", "garbage", "wrong type", "stale", "ref elsewhere", "forged", "untrusted", "corrupt"]
)
def test_a_reads_entries_checked_in_one_loop_are_accepted_rejected_and_fall_back_as_one_by_one(
    ci: WriterKey, laptop: WriterKey, case: str
) -> None:
    """The same entries accepted, the others rejected for the same reasons, with the same fetches and verifies,
    whatever the chunk an entry names holds (nothing, garbage, another type, an older version, a forgery, an
    untrusted writer's list) and whatever the entries are."""
    entries, store = _scenario(case, ci, laptop)
    one_by_one = reading(trusting(ci), store)
    expected = read_all(entries, one_by_one)
    expected_counts = [one_by_one.trust.verifies, store.fetches, one_by_one.checkpoints.loaded,
                       one_by_one.checkpoints.rejected]  # fmt: skip
    store.fetches = 0
    at_once = reading(trusting(ci), store)
    assert read_all_at_once(entries, at_once) == expected
    counts = [at_once.trust.verifies, store.fetches, at_once.checkpoints.loaded, at_once.checkpoints.rejected]
    assert counts == expected_counts
    assert "ok" in expected.values()
    if case in ("forged", "untrusted", "corrupt"):
        assert set(expected.values()) != {"ok"}


def test_a_hundred_crafted_entries_of_an_untrusted_key_read_at_once_are_refused_before_any_fetch_or_decompression(
    ci: WriterKey, laptop: WriterKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    laptop_log = CheckpointLog(laptop, PARTITION, SCHEMA)
    keys = [hashlib.sha256(b"crafted %d" % n).hexdigest() for n in range(100)]
    crafted = written(laptop, laptop_log, [keys[n : n + 10] for n in range(0, 100, 10)])
    store = Store()
    store.put(laptop_log)
    decompressed: list[bytes] = []
    inner = entry_module._decompress
    monkeypatch.setattr(entry_module, "_decompress", lambda *args: decompressed.append(args[0]) or inner(*args))
    policy = reading(trusting(ci), store)
    results = read_all_at_once(crafted, policy)
    assert len(results) == 100 and all("does not trust" in reason for reason in results.values())
    assert store.fetches == 0 and decompressed == [] and policy.trust.verifies == 0


def test_on_redis_a_reads_entries_are_checked_in_one_loop_and_a_lookup_of_one_as_before(
    redis_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass's prefetch: one call checks every entry of the read (a lookup each, no call per entry once the
    writer's chunk is loaded); a read of one entry is decoded by decode_entry, one `_check_writer` call, as
    before."""
    writer = open_tier(redis_settings.replace(writer_key_file=str(tmp_path / "ci.key")))
    publish_all(writer, KEYS[:12])
    writer.close()
    calls: list[str] = []
    loop, one = entry_module.check_writers, entry_module._check_writer
    monkeypatch.setattr(entry_module, "check_writers", lambda *a: calls.append("loop") or loop(*a))
    monkeypatch.setattr(entry_module, "_check_writer", lambda *a: calls.append("one") or one(*a))
    reader = open_tier(redis_settings.replace(tier_mode="read-only"))
    try:
        assert len(reader.find_many(KEYS[:6])[0]) == 6
        assert calls == ["loop", "one"]  # the first entry loads the chunk (its first read brought it): then lookups
        assert (reader.policy.trust.verifies, reader.checkpoints.loaded) == (1, 1)
        calls.clear()
        assert len(reader.find_many(KEYS[6:12])[0]) == 6 and calls == ["loop"]
        calls.clear()
        assert reader.lookup(KEYS[0]) is not None and calls == ["one"]
        assert reader.counts()["tier_rejected"] == 0
    finally:
        reader.close()
