"""Value-ranked retention (issue 21): an entry's value is the compile seconds its reuse saves per stored byte.
The rules (cachestore/value.py), the Redis TTL that grows with it, and the pass-log replay that compares it
with LRU (bench/replay.py)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from helpers_graphs import delete_namespace, local_or_fake_backend, unique_namespace

from bench.replay import LoggedEntry, LoggedPass, ReplayError, compare, replay, scaled_log
from cachestore.client import TierClient
from cachestore.entry import Entry
from cachestore.settings import Settings
from cachestore.stores import tier_client
from cachestore.value import (
    HALF_LIFE,
    MAX_COMPILE_SECONDS,
    MAX_TTL_FACTOR,
    MEDIAN_MIN_SAMPLES,
    ValueMedian,
    entry_value,
    retention_score,
    ttl_factor,
)

BASE_TTL = 3600


# -- the rules ---------------------------------------------------------------------------------------------
def test_value_is_compile_seconds_saved_per_stored_byte() -> None:
    assert entry_value(3.5, 10, 1000) == pytest.approx(0.035)
    assert entry_value(3.5, 10, 1000) > entry_value(0.005, 1, 1000)  # the 3.5 s entry used by every model
    assert entry_value(1.0, 1, 2000) == entry_value(1.0, 1, 1000) / 2  # twice the room for the same saving
    assert entry_value(0.0, 1, 1000) > 0  # an entry with no recorded time still saves a little
    assert entry_value(1.0, 0, 0) == 0.0  # never used: worth nothing; no division by zero
    assert entry_value(1e300, 1, 1000) == entry_value(MAX_COMPILE_SECONDS, 1, 1000)  # a planted time is capped


def test_the_retention_score_halves_per_half_life_unused_and_counts_one_use_at_least() -> None:
    fresh = retention_score(1.0, 4, 1000, 0.0)
    assert retention_score(1.0, 4, 1000, HALF_LIFE) == pytest.approx(fresh / 2)
    assert retention_score(1.0, 0, 1000, 0.0) == retention_score(1.0, 1, 1000, 0.0)
    assert retention_score(1.0, 1, 1000, -5.0) == retention_score(1.0, 1, 1000, 0.0)  # a clock behind: no boost


def test_the_ttl_factor_is_value_over_median_clamped_to_one_and_eight() -> None:
    assert ttl_factor(5.0, None) == 1.0
    assert ttl_factor(0.1, 1.0) == 1.0  # a cheap entry never lives shorter than entry_ttl
    assert ttl_factor(3.0, 1.0) == 3.0
    assert ttl_factor(1000.0, 1.0) == MAX_TTL_FACTOR


def test_the_median_waits_for_enough_values_then_ranks_against_them() -> None:
    median = ValueMedian()
    assert median.ttl(BASE_TTL, 100.0) == BASE_TTL  # nothing to compare with yet
    for _ in range(MEDIAN_MIN_SAMPLES):
        median.add(1.0)
    assert median.ttl(BASE_TTL, 4.0) == 4 * BASE_TTL
    assert median.ttl(BASE_TTL, 0.5) == BASE_TTL
    assert median.ttl(BASE_TTL, 1e9) == int(MAX_TTL_FACTOR * BASE_TTL)


# -- Redis: an entry's TTL grows with its value ---------------------------------------------------------------
def entry(compile_seconds: float, size: int = 2000, key: str = "k") -> Entry:
    import os

    binary = os.urandom(size)  # incompressible: every entry stores about `size` bytes
    return Entry(binary, ["x"], ["out"], "bir", "bir-1", {"kernel_name": "k", "key": key},
                 compile_seconds=compile_seconds)  # fmt: skip


def redis_client_of(backend: Any, **changes: Any) -> Any:
    settings = Settings(tier="redis://127.0.0.1:1/0", entry_ttl=BASE_TTL, flush_interval=0.01, **changes)
    return tier_client(lambda: backend, settings, "redis")


def ttl_of(backend: Any, cache_key: str) -> float:
    return backend.client.ttl(backend._entry(cache_key))


@pytest.fixture
def redis_backend(tmp_path: Path) -> Any:
    backend = local_or_fake_backend("fakeredis", tmp_path)
    yield backend
    backend.close()


def test_redis_ttl_grows_with_value_and_a_read_keeps_it(redis_backend: Any) -> None:
    writer = redis_client_of(redis_backend)
    for i in range(MEDIAN_MIN_SAMPLES):  # the usual entry: 10 ms
        writer.publish(f"usual-{i}", entry(0.01, key=f"usual-{i}"))
    writer.flush(timeout=10)
    writer.publish("costly", entry(0.05, key="costly"))  # 5 times the usual saving per byte
    writer.publish("cheap", entry(0.001, key="cheap"))
    writer.close(timeout=10)
    assert ttl_of(redis_backend, "cheap") == pytest.approx(BASE_TTL, abs=5)
    assert ttl_of(redis_backend, "costly") == pytest.approx(5 * BASE_TTL, rel=0.05)

    reader = redis_client_of(redis_backend)  # another process: it learns the median from what it reads
    keys = [f"usual-{i}" for i in range(MEDIAN_MIN_SAMPLES)]
    assert len(reader.find_many(keys)[0]) == MEDIAN_MIN_SAMPLES
    assert set(reader.find_many(["costly"])[0]) == {"costly"}  # the read sets entry_ttl...
    reader.close(timeout=10)
    assert ttl_of(redis_backend, "costly") == pytest.approx(5 * BASE_TTL, rel=0.05)  # ...then its own back
    assert ttl_of(redis_backend, "usual-0") == pytest.approx(BASE_TTL, abs=5)


@pytest.mark.parametrize("mode", ["mirror", "read-through"])
@pytest.mark.parametrize("tier", ["test", "local:/nowhere.sqlite"])  # the URL says nothing: the store does
def test_a_clients_first_store_gives_its_entries_value_ttls(redis_backend: Any, mode: str, tier: str) -> None:
    """The store's `value_ttls` decides the TTLs, asked of the backend once open: a client that has read nothing
    yet opens it before it prepares its first send's entries, which all go out in that send."""
    opened: list[Any] = []
    settings = Settings(tier=tier, tier_mode=mode, entry_ttl=BASE_TTL, flush_interval=30)
    writer = TierClient(lambda: opened.append(redis_backend) or redis_backend, settings, "redis")
    for i in range(MEDIAN_MIN_SAMPLES):
        writer.publish(f"usual-{i}", entry(0.01, key=f"usual-{i}"))
    writer.publish("costly", entry(0.05, key="costly"))
    assert opened == []  # nothing sent yet
    writer.close(timeout=10)
    assert opened == [redis_backend]
    assert ttl_of(redis_backend, "usual-0") == pytest.approx(BASE_TTL, abs=5)
    assert ttl_of(redis_backend, "costly") == pytest.approx(5 * BASE_TTL, rel=0.05)


def test_a_store_without_value_ttls_gets_entry_ttl_whatever_its_url(tmp_path: Path) -> None:
    local = local_or_fake_backend("local", tmp_path)
    assert local.value_ttls is False
    writer = TierClient(lambda: local, Settings(tier="redis://127.0.0.1:1/0", entry_ttl=BASE_TTL), "local")
    for i in range(MEDIAN_MIN_SAMPLES):
        writer.publish(f"usual-{i}", entry(0.01, key=f"usual-{i}"))
    writer.publish("costly", entry(0.05, key="costly"))
    writer.close(timeout=10)
    left = {raw.cache_key: raw.ttl for raw in local.scan_entries()}
    assert left["costly"] == pytest.approx(BASE_TTL, abs=5) and left["usual-0"] == pytest.approx(BASE_TTL, abs=5)
    local.close()


def test_a_read_only_client_refreshes_no_ttl(redis_backend: Any) -> None:
    writer = redis_client_of(redis_backend)
    for i in range(MEDIAN_MIN_SAMPLES):
        writer.publish(f"usual-{i}", entry(0.01, key=f"usual-{i}"))
    writer.publish("costly", entry(0.05, key="costly"))
    writer.close(timeout=10)
    redis_backend.client.expire(redis_backend._entry("costly"), 100)
    reader = redis_client_of(redis_backend, tier_mode="read-only")
    reader.find_many([f"usual-{i}" for i in range(MEDIAN_MIN_SAMPLES)] + ["costly"])
    reader.close(timeout=10)
    assert reader.pending() == 0 and ttl_of(redis_backend, "costly") <= 100


def test_the_local_tier_keeps_the_base_ttl(tmp_path: Path) -> None:
    """The local tier ranks what it keeps by value itself (its max_size trim): its TTLs do not grow."""
    backend = local_or_fake_backend("local", tmp_path)
    client = TierClient(lambda: backend, Settings(tier=f"local:{tmp_path}/tier.sqlite", entry_ttl=BASE_TTL), "local")
    for i in range(MEDIAN_MIN_SAMPLES + 1):
        client.publish(f"k{i}", entry(0.01 * (i + 1), key=f"k{i}"))
    client.close(timeout=10)
    expiries = backend._db().execute("SELECT expires - used FROM entries").fetchall()
    assert all(abs(left - BASE_TTL) < 5 for (left,) in expiries)
    backend.close()


# -- the replay ------------------------------------------------------------------------------------------
ENTRIES = {
    "costly": LoggedEntry(2.0, 1000),  # traced in 2 s
    **{f"cheap-{i}": LoggedEntry(0.01, 1000) for i in range(6)},
}


def test_replay_counts_hits_misses_and_saved_seconds() -> None:
    passes = [LoggedPass(0, {"costly": 3, "cheap-0": 1}), LoggedPass(1, {"costly": 1, "cheap-0": 2})]
    for policy in ("lru", "value"):
        result = replay(passes, ENTRIES, 10_000, policy)  # everything fits
        assert (result.hits, result.misses, result.evictions) == (2, 2, 0)
        assert result.saved_seconds == pytest.approx(2.01) and result.traced_seconds == pytest.approx(2.01)


def test_under_a_tight_budget_value_keeps_the_costly_entry_lru_does_not() -> None:
    """A costly entry used every few passes between bursts of cheap ones: LRU evicts it each time; value keeps it."""
    passes = []
    for round_ in range(5):
        passes.append(LoggedPass(round_ * 10, {"costly": 1}))
        for i in range(6):
            passes.append(LoggedPass(round_ * 10 + 1 + i, {f"cheap-{i}": 1}))
    results = compare(passes, ENTRIES, budget_bytes=3000)
    assert results["value"].saved_seconds == pytest.approx(4 * 2.0)  # every costly use after the first
    assert results["lru"].saved_seconds < 2.0
    for result in results.values():
        assert result.hits + result.misses == sum(len(p.uses) for p in passes)


def test_equal_values_fall_back_to_recency() -> None:
    """With every entry alike, value-ranked retention evicts exactly as LRU does."""
    entries = {f"k{i}": LoggedEntry(0.1, 1000) for i in range(8)}
    passes = [LoggedPass(t, {f"k{(t * 3) % 8}": 1, f"k{(t * 5) % 8}": 1}) for t in range(40)]
    results = compare(passes, entries, budget_bytes=4000)
    assert results["value"].as_json() | {"policy": "lru"} == results["lru"].as_json()


def test_a_scaled_log_is_seeded_skewed_and_factor_times_longer() -> None:
    recorded = [LoggedPass(0, {f"k{i}": 1}) for i in range(10)]
    log = scaled_log(recorded, 10, seed=4)
    assert len(log) == 100 and log == scaled_log(recorded, 10, seed=4) and log != scaled_log(recorded, 10, seed=5)
    assert [p.time for p in log] == sorted(p.time for p in log)
    counts = sorted((sum(1 for p in log if p.uses == r.uses) for r in recorded), reverse=True)
    assert counts[0] > 3 * counts[-1]  # a few passes far more often than the rest


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: replay([LoggedPass(0, {"nope": 1})], ENTRIES, 100, "lru"), "names key nope"),
        (lambda: replay([], ENTRIES, 0, "lru"), "budget must be a positive"),
        (lambda: replay([], ENTRIES, 100, "lfu"), "unknown retention policy 'lfu'"),
        (lambda: scaled_log([], 10, 0), "needs recorded passes"),
    ],
)
def test_a_replay_it_cannot_run_is_one_clear_error(call: Any, message: str) -> None:
    with pytest.raises(ReplayError, match=message):
        call()


def test_the_bench_measurement_replays_the_recorded_workload(tmp_path: Path) -> None:
    from bench import figures as bench

    config = bench.BenchConfig(models=3, seed=1, repeats=1, quick=True)
    graphs = bench.workload_graphs(tmp_path / "graphs", config)
    started = time.perf_counter()
    measured = bench.value_retention(graphs, config, tmp_path)
    assert time.perf_counter() - started < 120
    assert measured["passes"] == 10 * measured["recorded_passes"] == 30
    assert measured["budget_bytes"] > 0 and measured["value_retention_ratio"] > 0
    for policy in ("lru", "value"):
        result = measured[policy]
        assert result["hits"] + result["misses"] > 0 and result["evictions"] > 0


def test_value_ttls_on_a_cluster(redis_cluster: str) -> None:
    """The background TTL refresh is one pipeline over the masters the keys live on."""
    from cachestore.settings import load_settings

    namespace = unique_namespace()
    settings = load_settings({"tier": redis_cluster, "namespace": namespace, "entry_ttl": BASE_TTL}, environ={})
    writer = TierClient(lambda: _cluster_backend(settings), settings, "cluster")
    keys = [f"usual-{i}" for i in range(MEDIAN_MIN_SAMPLES)] + ["costly"]
    for key in keys[:-1]:
        writer.publish(key, entry(0.01, key=key))
    writer.flush(timeout=10)
    writer.publish("costly", entry(0.05, key="costly"))
    writer.close(timeout=10)
    reader = TierClient(lambda: _cluster_backend(settings), settings, "cluster")
    assert set(reader.find_many(keys)[0]) == set(keys)
    reader.close(timeout=10)
    backend = _cluster_backend(settings)
    try:
        assert ttl_of(backend, "costly") > 3 * BASE_TTL and ttl_of(backend, "usual-3") <= BASE_TTL
        assert reader.counts()["tier_errors"] == 0
    finally:
        delete_namespace(backend.client, namespace)
        backend.close()


def _cluster_backend(settings: Settings) -> Any:
    from cachestore.stores import open_backend

    return open_backend(settings)
