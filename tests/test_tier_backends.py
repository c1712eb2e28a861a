"""The shared backend suite: every tier backend honours the same contract (cachestore.api.Backend).

Each test runs three times: the embedded SQLite tier, the Redis tier on fakeredis, and the Redis tier on a
real redis-server (REDIS_URL, or a private server), each under a namespace of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis
from helpers_graphs import TierView, delete_namespace, wait_until

from cachestore.api import BatchRefused, KeyUsage, MetricsBatch, StoreRequest
from cachestore.backends.redis import FIRST_READ_BYTES, RedisBackend
from cachestore.backends.sqlite import SqliteBackend
from cachestore.client import TierClient
from cachestore.entry import Entry, SignaturePolicy, TooLarge, decode_entry, encode_entry
from cachestore.keys import KeySpace
from cachestore.settings import Settings

TTL = 3600


@contextlib.contextmanager
def backend_of(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqliteBackend | RedisBackend]:
    """A fresh backend: the embedded SQLite tier ("local"), Redis on fakeredis, or on a real redis-server
    under a namespace of its own (deleted afterwards)."""
    if kind == "local":
        tier = SqliteBackend(tmp_path / "tier.sqlite")
        yield tier
        tier.close()
    elif kind == "fakeredis":
        tier = RedisBackend(fakeredis.FakeRedis(server=fakeredis.FakeServer()), KeySpace(f"fake-{uuid.uuid4().hex}"))
        yield tier
        tier.close()
    else:
        namespace = request.getfixturevalue("redis_namespace").rstrip(":")
        client = redis.Redis.from_url(request.getfixturevalue("redis_url"), socket_timeout=5)
        tier = RedisBackend(client, KeySpace(namespace), "test redis")
        yield tier
        delete_namespace(client, namespace)  # the metrics keys start with '{', outside redis_namespace's prefix
        tier.close()


@pytest.fixture(params=["local", "fakeredis", pytest.param("redis", marks=pytest.mark.redis)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqliteBackend | RedisBackend]:
    with backend_of(request.param, request, tmp_path) as tier:
        yield tier


@pytest.fixture
def view(backend: SqliteBackend | RedisBackend) -> TierView:
    return TierView.of(backend)


def entry(binary: bytes, kernel: str = "softmax", shape: int = 8) -> Entry:
    return Entry(
        binary=binary,
        input_names=["x"],
        output_names=["out"],
        format="bir",
        version_identifier="bir-1",
        key_components={"kernel_name": kernel, "operands": {"shapes": [[shape, 4]], "dtypes": ["float32"]}},
        producer_host="host-a",
        producer_worker="w1",
        created=time.time(),
        compile_seconds=0.5,
    )


def request_for(cache_key: str, item: Entry) -> StoreRequest:
    return StoreRequest(
        cache_key,
        item.digest,
        encode_entry(item),
        str(item.key_components["kernel_name"]),
    )


def decoded(data: bytes) -> Entry:
    return decode_entry(data, SignaturePolicy())


# -- entries ------------------------------------------------------------------------------------------
def test_fetch_of_missing_keys_is_empty(backend) -> None:
    assert backend.fetch(["nope"], TTL) == {}
    assert backend.fetch(["a", "b", "c"], TTL) == {}
    assert list(backend.scan_entries()) == []


def test_store_and_fetch_round_trip(backend) -> None:
    items = {f"key-{i}": entry(b"binary-%d" % i, shape=i) for i in range(3)}
    backend.store([request_for(k, v) for k, v in items.items()], TTL)
    assert backend.fetch(["key-1"], TTL) == {"key-1": encode_entry(items["key-1"])}
    found = backend.fetch(["key-0", "missing", "key-2"], TTL)
    assert set(found) == {"key-0", "key-2"}
    assert decoded(found["key-2"]) == items["key-2"]


def test_storing_the_same_key_again_overwrites(backend) -> None:
    backend.store([request_for("k", entry(b"one"))], TTL)
    backend.store([request_for("k", entry(b"one"))], TTL)
    assert decoded(backend.fetch(["k"], TTL)["k"]).binary == b"one"
    assert [raw.cache_key for raw in backend.scan_entries()] == ["k"]


@pytest.mark.parametrize("one_call", [False, True], ids=["separate-stores", "one-store"])
def test_identical_binaries_under_two_keys_are_each_stored_whole(backend, one_call: bool) -> None:
    binary = b"the same binary" * 100
    first, second = entry(binary, shape=8), entry(binary, shape=16)  # two cache keys, one digest
    requests = [request_for("key-a", first), request_for("key-b", second)]
    if one_call:
        backend.store(requests, TTL)
    else:
        backend.store(requests[:1], TTL)
        backend.store(requests[1:], TTL)
    stored = backend.fetch(["key-a", "key-b"], TTL)
    assert stored == {"key-a": requests[0].full, "key-b": requests[1].full}

    client = TierClient(lambda: backend, Settings(tier="test", host="h", worker="w"))
    try:
        found = client.lookup("key-b")
        assert found is not None and found.binary == binary
        assert found.key_components == second.key_components
        assert client.stats.snapshot()["tier_rejected"] == 0
    finally:
        client.close()  # its flusher sends the read's TTL refresh before the fixture closes the store under it


def test_an_entry_over_the_limit_is_handed_over_as_its_size_and_every_other_read_whole(backend, view) -> None:
    """fetch, scan_entries and get_entries give an entry over the backend's max_entry_bytes as TooLarge(its
    stored size), without reading it, and every entry within it whole: small, larger than Redis's first read
    (a second, bounded round trip), exactly at the limit, and empty (stored: decoding rejects it)."""
    backend.max_entry_bytes = limit = FIRST_READ_BYTES + 1000
    values = {"small": b"s" * 100, "mid": b"m" * (FIRST_READ_BYTES + 500), "exact": b"e" * limit, "empty": b""}
    oversized = {"over": limit + 1, "far-over": 3 * limit}
    for key, data in values.items():
        view.put_raw(key, data)
    for key, size in oversized.items():
        view.put_raw(key, b"o" * size)
    expected = {**values, **{key: TooLarge(size, limit) for key, size in oversized.items()}}
    keys = [*expected, "missing"]
    assert backend.fetch(keys, TTL) == expected
    assert backend.get_entries(keys) == expected
    assert {raw.cache_key: raw.data for raw in backend.scan_entries()} == expected
    assert {raw.cache_key: raw.data for raw in backend.scan_entries(with_ttl=False)} == expected
    assert len(backend.fetch(["far-over"], TTL)["far-over"]) == 3 * limit  # its len() is the stored size


def test_a_fetch_without_a_ttl_refresh_reads_each_value_whole(backend, view) -> None:
    """The read a remote hit makes (no TTL refresh): values from a byte to a few hundred KiB, each alone and all
    at once, a missing key among them."""
    values = {f"k{size}": os.urandom(size) for size in (1, 1300, 70_000, 300_000)}
    for key, data in values.items():
        view.put_raw(key, data)
    for key, data in values.items():
        assert backend.fetch([key], None) == {key: data}
    assert backend.fetch([*values, "missing"], None) == values


# -- retention ----------------------------------------------------------------------------------------
def test_fetch_refreshes_the_ttl(backend, view) -> None:
    backend.store([request_for("k", entry(b"bin"))], TTL)
    assert TTL - 60 < view.ttl("k") <= TTL
    view.set_ttl("k", 30)
    assert view.ttl("k") <= 30
    assert backend.fetch(["k"], TTL)
    assert TTL - 60 < view.ttl("k") <= TTL
    view.set_ttl("k", 30)
    assert backend.fetch(["k"], 7200) and 7200 - 60 < view.ttl("k") <= 7200  # the reader's TTL counts


def test_entries_expire(backend, view) -> None:
    backend.store([request_for("short", entry(b"short-lived")), request_for("long", entry(b"long-lived"))], 1)
    backend.store([request_for("kept", entry(b"kept"))], TTL)
    assert 0 < view.ttl("short") <= 1 and view.raw("short") is not None
    # Poll without fetching: a fetch would refresh the TTL. Gone, or past its expiry: a Redis key whose PTTL
    # reads 0 still exists for up to a millisecond, and a GETEX then would bring it back.
    assert wait_until(lambda: all(expired(view.ttl(key)) for key in ("short", "long")), timeout=5)
    assert set(backend.fetch(["short", "long", "kept"], TTL)) == {"kept"}
    assert [raw.cache_key for raw in backend.scan_entries()] == ["kept"]


def expired(ttl: float | None) -> bool:
    return ttl is None or ttl < 0


# -- single flight ------------------------------------------------------------------------------------
def test_lease_is_exclusive_and_released_only_by_its_owner(backend) -> None:
    assert backend.lease_holder("k") is None
    assert backend.acquire_lease("k", "worker-1", 30) is True
    assert backend.acquire_lease("k", "worker-2", 30) is False
    assert backend.acquire_lease("k", "worker-1", 30) is False  # not re-entrant either
    assert backend.lease_holder("k") == "worker-1"
    assert backend.acquire_lease("other-key", "worker-2", 30) is True  # leases are per key

    backend.release_lease("k", "worker-2")  # not the owner: nothing happens
    assert backend.lease_holder("k") == "worker-1"
    backend.release_lease("k", "worker-1")
    assert backend.lease_holder("k") is None
    assert backend.acquire_lease("k", "worker-2", 30) is True
    assert backend.lease_holder("k") == "worker-2"
    assert backend.lease_holder("other-key") == "worker-2"


def test_lease_expires(backend) -> None:
    assert backend.acquire_lease("k", "dead-worker", 0.2)
    assert backend.acquire_lease("k", "worker-2", 30) is False
    assert wait_until(lambda: backend.lease_holder("k") is None, timeout=3)
    assert backend.acquire_lease("k", "worker-2", 30) is True
    backend.release_lease("k", "dead-worker")  # a late release by the dead holder must not free it
    assert backend.lease_holder("k") == "worker-2"


# -- fleet metrics ------------------------------------------------------------------------------------
def batch(batch_id: str, host: str, worker: str, keys: dict[str, KeyUsage], **totals: float) -> MetricsBatch:
    calls: dict[str, int] = {}
    for usage in keys.values():
        calls[usage.kernel_name] = calls.get(usage.kernel_name, 0) + usage.usage
    record = {"pass_id": batch_id, "graph": f"graph-{batch_id}", "host": host, **totals}
    return MetricsBatch(batch_id, host, worker, dict(totals), calls, keys, record)


def test_apply_metrics_exactly_once_and_summed(backend, view) -> None:
    first = batch(
        "pass-1",
        "host-a",
        "w1",
        {"k1": KeyUsage("softmax", 3, 100.0, 110.0), "k2": KeyUsage("matmul", 1, 101.0, 101.0)},
        passes=1,
        kernels=4,
        cache_hits=2,
        cache_misses=2,
        traces=2,
        compile_seconds=0.25,
    )
    assert backend.apply_metrics(first) is True
    assert backend.apply_metrics(first) is False  # a retried flush
    assert backend.apply_metrics(first) is False
    assert view.totals() == {"passes": 1, "kernels": 4, "cache_hits": 2, "cache_misses": 2, "traces": 2,
                             "compile_seconds": 0.25}  # fmt: skip

    second = batch(
        "pass-2",
        "host-b",
        "w7",
        {"k1": KeyUsage("softmax", 2, 90.0, 105.0), "k3": KeyUsage("softmax", 5, 120.0, 130.0)},
        passes=1,
        kernels=7,
        cache_hits=5,
        cache_misses=2,
        remote_hits=1,
        traces=1,
        compile_seconds=0.5,
    )
    assert backend.apply_metrics(second) is True
    assert backend.apply_metrics(first) is False
    assert backend.apply_metrics(second) is False

    assert view.totals() == pytest.approx(
        {
            "passes": 2,
            "kernels": 11,
            "cache_hits": 7,
            "cache_misses": 4,
            "remote_hits": 1,
            "traces": 3,
            "compile_seconds": 0.75,
        }
    )
    assert view.worker_totals("host-a", "w1") == pytest.approx(first.totals)
    assert view.worker_totals("host-b", "w7") == pytest.approx(second.totals)
    assert view.worker_totals("host-a", "w7") == {}

    assert view.kernel_calls() == {"softmax": 3 + 2 + 5, "matmul": 1}
    assert view.variants() == {"softmax": 2, "matmul": 1}  # k1 counted once across both batches

    assert view.key_usage("k1") == (5, 90.0, 110.0)  # usage summed, earliest first use, latest last use
    assert view.key_usage("k2") == (1, 101.0, 101.0)
    assert view.key_usage("k3") == (5, 120.0, 130.0)
    assert view.key_usage("never-used") is None
    assert view.key_hosts("k1") == {"host-a", "host-b"}
    assert view.key_hosts("k3") == {"host-b"}

    log = view.pass_log()
    assert [record["pass_id"] for record in log] == ["pass-1", "pass-2"]
    assert log[1] == second.pass_record


def test_batches_without_a_pass_record_leave_the_log_alone(backend, view) -> None:
    partial = MetricsBatch("partial-1", "h", "w", {"traces": 1}, {}, {}, None)
    assert backend.apply_metrics(partial) is True
    assert backend.apply_metrics(partial) is False
    assert view.totals() == {"traces": 1}
    assert view.pass_log() == []


def test_many_batches_sum_exactly(backend, view) -> None:
    batches = [
        batch(
            f"b{i}",
            f"host-{i % 3}",
            "w",
            {f"key-{i % 5}": KeyUsage("rmsnorm", i + 1, float(i), float(i + 1))},
            passes=1,
            kernels=i + 1,
            traces=i % 2,
            compile_seconds=0.125 * i,
        )
        for i in range(20)
    ]
    for item in batches + batches[::3]:  # some retried
        backend.apply_metrics(item)
    totals = view.totals()
    assert totals["passes"] == 20
    assert totals["kernels"] == sum(i + 1 for i in range(20))
    assert totals["traces"] == 10
    assert totals["compile_seconds"] == pytest.approx(0.125 * sum(range(20)))
    assert view.kernel_calls() == {"rmsnorm": sum(i + 1 for i in range(20))}
    assert view.variants() == {"rmsnorm": 5}
    assert view.key_usage("key-0") == (1 + 6 + 11 + 16, 0.0, 16.0)
    assert view.key_hosts("key-0") == {"host-0", "host-2", "host-1"}
    assert len(view.pass_log()) == 20


# -- invalid batches: applied wholly or not at all ----------------------------------------------------
def metrics_state(backend: SqliteBackend | RedisBackend) -> dict:
    """Everything the fleet metrics hold, applied-batch markers included, read from the store itself."""
    if isinstance(backend, SqliteBackend):
        db = sqlite3.connect(backend.path, timeout=5)
        try:
            tables = [name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                      if name not in ("entries", "digests", "leases", "meta", "sqlite_sequence")]  # fmt: skip
            return {table: sorted(map(repr, db.execute(f"SELECT * FROM {table}"))) for table in tables}
        finally:
            db.close()
    client = backend.client
    readers = {b"hash": client.hgetall, b"set": client.smembers, b"string": client.get, b"stream": client.xrange}
    return {key: readers[client.type(key)](key) for key in client.scan_iter(match=f"{{{backend.keys.prefix}:metrics*")}


def pass_batch(batch_id: str) -> MetricsBatch:
    usage = {"k1": KeyUsage("softmax", 3, 100.0, 110.0), "k2": KeyUsage("matmul", 1, 101.0, 101.0)}
    item = batch(batch_id, "host-a", "w1", usage, passes=1, kernels=4, cache_hits=2, traces=2, compile_seconds=0.25)
    item.toolchain = "0123456789abcdef"
    return item


NAN = float("nan")
# Each breaks one number of a batch, late in the order the Redis script used to write them, so a script that
# wrote first and failed later would leave the earlier writes (and the applied marker) behind.
POISONS = {
    "nan-compile-seconds": lambda b: b.totals.update(compile_seconds=NAN),
    "infinite-total": lambda b: b.totals.update(traces=float("inf")),
    "text-total": lambda b: b.totals.update(kernels="4"),
    "fractional-kernel-calls": lambda b: b.kernel_calls.update(matmul=1.5),
    "nan-first-use": lambda b: setattr(b.keys["k2"], "first_use", NAN),
    "infinite-last-use": lambda b: setattr(b.keys["k2"], "last_use", float("-inf")),
    "text-usage": lambda b: setattr(b.keys["k2"], "usage", "1"),
    "too-large-usage": lambda b: setattr(b.keys["k2"], "usage", 2**63),
    "nan-in-the-pass-record": lambda b: b.pass_record.update(started=NAN),
}


@pytest.mark.parametrize("poison", POISONS)
def test_an_invalid_batch_writes_nothing_and_its_id_applies_once_valid(backend, view, poison: str) -> None:
    earlier = pass_batch("pass-0")
    assert backend.apply_metrics(earlier) is True
    before = metrics_state(backend)
    assert before  # something to compare with

    invalid = pass_batch("pass-1")
    POISONS[poison](invalid)
    with pytest.raises(BatchRefused, match="refused"):
        backend.apply_metrics(invalid)
    assert metrics_state(backend) == before  # totals, workers, toolchains, keys, marker, pass log: untouched
    with pytest.raises(BatchRefused):  # refused again, not taken for applied
        backend.apply_metrics(invalid)

    valid = pass_batch("pass-1")
    assert backend.apply_metrics(valid) is True  # no marker was left behind
    assert backend.apply_metrics(valid) is False
    assert view.totals() == pytest.approx({name: 2 * value for name, value in earlier.totals.items()})
    assert view.key_usage("k2") == (2, 101.0, 101.0)
    assert [record["pass_id"] for record in view.pass_log()] == ["pass-0", "pass-1"]


# -- scanning -----------------------------------------------------------------------------------------
def test_scan_entries_streams_every_entry(backend) -> None:
    items = {f"key-{i:04d}": entry(b"binary-%d" % i, shape=i) for i in range(1234)}
    requests = [request_for(k, v) for k, v in items.items()]
    for start in range(0, len(requests), 300):
        backend.store(requests[start : start + 300], TTL)
    stream = backend.scan_entries()
    assert iter(stream) is stream  # a generator, not a list built up front
    scanned = {raw.cache_key: raw.data for raw in stream}
    assert scanned.keys() == items.keys()
    assert all(scanned[k] == encode_entry(v) for k, v in items.items())


# -- Redis alone -------------------------------------------------------------------------------------------
@pytest.fixture(params=["fakeredis", pytest.param("redis", marks=pytest.mark.redis)])
def redis_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RedisBackend]:
    with backend_of(request.param, request, tmp_path) as tier:
        yield tier


def test_a_read_without_ttls_tells_a_missing_key_from_an_empty_value(redis_backend: RedisBackend) -> None:
    """verify and du read one GETRANGE a key (no PTTL); an empty reply is asked again with EXISTS, so a key
    deleted since the SCAN is skipped and an empty value is still handed over (and reported as no entry)."""
    view = TierView.of(redis_backend)
    view.put_raw("empty", b"")
    view.put_raw("whole", b"w" * 300)
    keys = [redis_backend.keys.entry(redis_backend.partition, key) for key in ("empty", "gone", "whole")]
    assert redis_backend._read_entries(keys, with_ttl=False) == [(b"", None), (None, None), (b"w" * 300, None)]


# -- entry key names: the cache key in base64url (cachestore.keys.key_tag, issue 16) ---------------------
def test_an_entry_key_names_its_cache_key_in_43_characters_and_reads_back() -> None:
    from cachestore.keys import cache_key_of_tag, key_tag

    space = KeySpace("ns")
    for cache_key in (hashlib.sha256(b"%d" % i).hexdigest() for i in range(200)):
        tag = key_tag(cache_key)
        assert len(tag) == 43 and not set(tag) & set("{}*?[]\\\\=")  # no hash-tag, glob or marker character
        assert space.parse_entry(space.entry("0123456789abcdef", cache_key)) == ("0123456789abcdef", cache_key)
        assert space.entry("t", cache_key).endswith("{" + tag + "}") and space.lease("t", cache_key).endswith(
            "{" + tag + "}"
        )
    for text_key in ("k", "key-a", "A" * 64, "0" * 63, "=odd", "x" * 43):  # no SHA-256 hex: "=" and the text
        assert space.parse_entry(space.entry("t", text_key)) == ("t", text_key)
    # An older release's hex name and names by hand: read back as they are, never an exception.
    for tag in ("0" * 64, "!" * 43, "", "{", "\u00e9" * 43, "A" * 42 + "B"):  # B: bits past the 32 bytes
        assert cache_key_of_tag(tag) == tag


def test_an_entry_key_is_the_base64url_of_a_lowercase_sha256_hex_key_and_any_other_key_its_text() -> None:
    """key_tag tells a SHA-256 hex key by bytes.fromhex and hex() (every remote hit names its entry): exactly the keys
    of 64 lowercase hex digits are encoded; uppercase, spaces fromhex would skip, other lengths keep their text."""
    import base64

    from cachestore.keys import key_tag

    hex_key = hashlib.sha256(b"k").hexdigest()
    assert key_tag(hex_key) == base64.urlsafe_b64encode(bytes.fromhex(hex_key)).decode().rstrip("=")
    for other in (hex_key.upper(), " " + hex_key[1:], hex_key[:30] + " " + hex_key[31:], hex_key[:-2], hex_key + "00",
                  "", "k", "\u0661" * 64, "g" * 64):  # fmt: skip
        assert key_tag(other) == "=" + other


def test_find_keys_finds_every_prefix_length(redis_backend: RedisBackend) -> None:
    keys = [hashlib.sha256(b"find-%d" % i).hexdigest() for i in range(30)]
    redis_backend.store([request_for(k, entry(b"f-%d" % i, shape=i)) for i, k in enumerate(keys)], TTL)
    target = keys[7]
    for length in (1, 2, 5, 6, 7, 12, 13, 40, 64):
        found = redis_backend.find_keys(target[:length], limit=100)
        assert target in found and all(k.startswith(target[:length]) for k in found), length
        assert set(found) == {k for k in keys if k.startswith(target[:length])}
    absent = next(p for p in (f"{i:06x}" for i in range(1 << 12)) if not any(k.startswith(p) for k in keys))
    assert redis_backend.find_keys(absent) == []


def test_deleting_an_entry_removes_its_name_of_an_older_release_too(redis_backend: RedisBackend) -> None:
    """An upgraded tier still holds entries under the hex names (never read): gc's deletes take them along."""
    cache_key = hashlib.sha256(b"legacy").hexdigest()
    old_name = redis_backend.keys.legacy_entry(redis_backend.partition, cache_key)
    redis_backend.client.set(old_name, b"an entry of schema 3")
    listed = [raw.cache_key for raw in redis_backend.scan_entries()]
    assert listed == [cache_key]  # listed (and reported unreadable by verify), under its cache key
    assert redis_backend.fetch([cache_key], TTL) == {}  # never read by a compile
    redis_backend.delete_entries([cache_key])
    assert redis_backend.client.exists(old_name) == 0


def test_a_store_of_new_entries_is_one_round_trip_with_its_index(redis_backend: RedisBackend, monkeypatch) -> None:
    """The entries and their variant index in one pipeline (a round trip costs the writing process a wake-up,
    and a one-shot compile waits for the last store in close()), and no other key written."""
    executed: list[int] = []
    make = redis_backend.client.pipeline

    def counted(*args, **kwargs):
        pipe = make(*args, **kwargs)
        execute = pipe.execute

        def run(*a, **k):
            executed.append(len(pipe.command_stack))
            return execute(*a, **k)

        pipe.execute = run
        return pipe

    monkeypatch.setattr(redis_backend.client, "pipeline", counted)
    keys = [hashlib.sha256(b"rt%d" % i).hexdigest() for i in range(5)]
    redis_backend.store([request_for(k, entry(b"round-trip-%d" % i, shape=i)) for i, k in enumerate(keys)], TTL)
    assert len(executed) == 1
    monkeypatch.undo()
    assert set(redis_backend.fetch(keys, TTL)) == set(keys)
    written = {
        name.decode()
        for pattern in redis_backend.keys.namespace_patterns()
        for name in redis_backend.client.scan_iter(match=pattern, count=1000)
    }
    assert written == {redis_backend.keys.entry(redis_backend.partition, k) for k in keys}


def test_an_entry_write_the_server_refuses_fails_the_store(redis_backend: RedisBackend, monkeypatch) -> None:
    """Sent with its indexes, whose errors are only logged, an entry's own refused write still fails the store
    (the client then keeps it queued and retries), translated like any tier error."""
    from cachestore.api import TierError

    make = redis_backend.client.pipeline

    def refusing(*args, **kwargs):
        pipe = make(*args, **kwargs)
        set_command = pipe.set

        def refused_set(name, value, *a, **k):
            if name == redis_backend.keys.entry(redis_backend.partition, "refused"):
                return pipe.execute_command("INCRBY", name, "not a number")  # an error reply in the entry's place
            return set_command(name, value, *a, **k)

        pipe.set = refused_set
        return pipe

    monkeypatch.setattr(redis_backend.client, "pipeline", refusing)
    with pytest.raises(TierError):
        redis_backend.store([request_for("refused", entry(b"refused binary" * 10))], TTL)
