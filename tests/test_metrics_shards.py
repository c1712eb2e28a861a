"""The Redis tier's fleet metrics in S shards: a pass's own counts go to the shard of its batch id, each cache
key's to the shard of the key (cachestore.keys). Every part applies exactly once, the readers sum the shards,
a namespace keeps the shard count its first batch fixed, and one written before sharding reads as 1 shard."""

from __future__ import annotations

import json
import uuid

import fakeredis
import msgspec
import pytest
from helpers_graphs import metrics_shards

from cachestore.api import KeyUsage, MetricsBatch
from cachestore.backends.redis import RedisBackend
from cachestore.keys import KeySpace, key_shard, pass_shard
from cachestore.settings import SettingsError, load_settings

KEYS = [f"{i:064x}" for i in range(40)]


def backend(server: fakeredis.FakeServer, namespace: str, shards: int = 8) -> RedisBackend:
    return RedisBackend(fakeredis.FakeRedis(server=server), KeySpace(namespace), metrics_shards=shards)


def a_pass(n: int, keys: list[str]) -> MetricsBatch:
    usage = {key: KeyUsage("softmax", 2, 100.0 + n, 200.0 + n) for key in keys}
    return MetricsBatch(f"pass-{n}", "host", "w", {"passes": 1, "kernels": 2 * len(keys)},
                        {"softmax": 2 * len(keys)}, usage, {"graph": f"g{n}", "finished": 1000.0 + n})  # fmt: skip


def test_a_batch_spreads_over_the_shards_and_reads_back_summed() -> None:
    tier = backend(fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}")
    for n in range(6):
        assert tier.apply_metrics(a_pass(n, KEYS[n * 5 : n * 5 + 10]))  # passes overlap by 5 keys
    shards = metrics_shards(tier.client, tier.keys)
    assert len(shards) == 8
    holding = {key: [i for i, s in enumerate(shards) if tier.client.hexists(s.key_usage, key)] for key in KEYS[:35]}
    assert all(found == [key_shard(key, 8)] for key, found in holding.items())  # each key in its one shard
    assert len({found[0] for found in holding.values()}) > 4
    assert tier.totals() == {"passes": 6, "kernels": 120}
    assert tier.key_count() == 35 and tier.kernels() == {"softmax": {"call_count": 120, "variants": 35}}
    assert dict(tier.key_usage())[KEYS[5]] == 4 and tier.key_records([KEYS[5]])[KEYS[5]].first_use == 100.0
    assert [record["graph"] for _, record in tier.pass_log(None)] == [f"g{n}" for n in range(6)]
    assert tier.pass_log_span(None) is not None


def test_a_batch_whose_apply_stopped_half_way_counts_each_part_once_when_retried() -> None:
    tier = backend(fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}")
    batch = a_pass(0, KEYS[:20])
    parts = tier._metrics_parts(batch, json.dumps(batch.pass_record), tier._shard_count(writing=True))
    assert len(parts) > 2
    for keys, args in parts[:2]:  # the process died after two of the parts reached Redis
        tier._apply_metrics(keys=keys, args=args)
    assert tier.apply_metrics(batch) is False  # its pass part was applied already
    assert tier.apply_metrics(batch) is False
    assert tier.totals() == {"passes": 1, "kernels": 40}
    assert dict(tier.key_usage()) == dict.fromkeys(KEYS[:20], 2)


def test_the_pass_part_goes_to_the_shard_of_the_batch_id() -> None:
    tier = backend(fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}", shards=16)
    tier.apply_metrics(a_pass(3, KEYS[:3]))
    home = tier.keys.metrics_shard(pass_shard("pass-3", 16))
    assert tier.client.hgetall(home.totals) == {b"passes": b"1", b"kernels": b"6"}
    assert [s for s in metrics_shards(tier.client, tier.keys) if tier.client.exists(s.totals)] == [home]


def test_the_first_batch_fixes_the_count_and_later_settings_do_not_move_it() -> None:
    server, namespace = fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}"
    backend(server, namespace, shards=4).apply_metrics(a_pass(0, KEYS[:10]))
    later = backend(server, namespace, shards=32)
    later.apply_metrics(a_pass(1, KEYS[:10]))
    assert later.client.get(later.keys.metrics_shard_count) == b"4"
    assert later.key_count() == 10 and dict(later.key_usage()) == dict.fromkeys(KEYS[:10], 4)


def test_a_namespace_from_before_sharding_stays_one_shard() -> None:
    server, namespace = fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}"
    old = backend(server, namespace)
    shard0 = old.keys.metrics_shard(0)
    assert shard0.tag == f"{{{namespace}:v1:metrics}}"  # the tag every key had before sharding
    old.client.hset(shard0.totals, mapping={"passes": 5, "kernels": 50})
    old.client.hset(shard0.key_usage, KEYS[0], 7)
    tier = backend(server, namespace, shards=16)
    tier.apply_metrics(a_pass(9, KEYS[:2]))
    assert tier.client.get(tier.keys.metrics_shard_count) == b"1"
    assert tier.totals() == {"passes": 6, "kernels": 54} and dict(tier.key_usage())[KEYS[0]] == 9


def test_a_reader_of_a_new_namespace_reads_one_shard_and_writes_nothing() -> None:
    tier = backend(fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}")
    assert tier.totals() == {} and tier.key_count() == 0 and list(tier.pass_log(None)) == []
    assert tier.client.keys("*") == []


def test_a_shard_count_that_is_no_count_is_the_setting_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 35: any writer of the key could fail every report and batch; the setting the fleet shares is used."""
    tier = backend(fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}")
    tier.client.set(tier.keys.metrics_shard_count, "lots")
    assert tier.apply_metrics(a_pass(0, KEYS[:20]))
    assert tier.totals() == {"passes": 1, "kernels": 40} and tier._shard_count() == 8
    assert dict(tier.key_usage()) == dict.fromkeys(KEYS[:20], 2)  # every key read back from its shard of 8
    warnings = [r.getMessage() for r in caplog.records if "metrics-shards holds 'lots'" in r.getMessage()]
    assert len(warnings) == 1 and "not a shard count from 1 to 1024; using the setting, 8" in warnings[0]


@pytest.mark.parametrize("value", ["0", "1025", "two"])
def test_the_setting_is_checked(value: str) -> None:
    with pytest.raises(SettingsError, match="metrics_shards"):
        load_settings(environ={"NKICACHE_METRICS_SHARDS": value})


def test_a_server_that_lost_the_script_gets_it_again_and_counts_each_part_once() -> None:
    tier = backend(fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}")
    tier.apply_metrics(a_pass(0, KEYS[:10]))
    tier.client.script_flush()  # a restarted server, or a failover to a replica that never ran it
    assert tier.apply_metrics(a_pass(1, KEYS[:10])) is True
    assert tier.totals() == {"passes": 2, "kernels": 40} and dict(tier.key_usage()) == dict.fromkeys(KEYS[:10], 4)


def test_one_round_trip_per_pass_however_many_variants_it_used() -> None:
    tier = backend(fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}", shards=64)
    tier.apply_metrics(a_pass(0, KEYS[:1]))  # fixes the shard count (two reads and a write, once per process)
    sent: list[int] = []
    execute = tier.client.pipeline

    def counting_pipeline(*args, **kwargs):
        pipe = execute(*args, **kwargs)
        run = pipe.execute
        pipe.execute = lambda *a, **k: (sent.append(len(pipe.command_stack)), run(*a, **k))[1]
        return pipe

    tier.client.pipeline = counting_pipeline
    for n, variants in enumerate((1, 10, 40), start=1):
        tier.apply_metrics(a_pass(n, KEYS[:variants]))
    assert len(sent) == 3  # one pipeline per pass: the shard count kept, then one script run per shard touched
    assert sent[0] <= 3 < sent[1] < sent[2]


def test_a_flushed_server_learns_the_shard_count_again_from_the_next_batch() -> None:
    tier = backend(fakeredis.FakeServer(), f"s-{uuid.uuid4().hex}", shards=16)
    tier.apply_metrics(a_pass(0, KEYS[:10]))
    tier.client.flushall()  # a restart without persistence: this process still writes 16 shards
    tier.apply_metrics(a_pass(1, KEYS[:10]))
    reader = backend(fakeredis.FakeServer(), "unused")
    reader.client, reader.keys = tier.client, tier.keys
    assert reader.key_count() == 10 and reader.totals() == {"passes": 1, "kernels": 20}


@pytest.mark.redis
def test_a_metric_another_tool_left_holding_no_number_counts_as_absent_and_stalls_nothing(redis_client) -> None:
    """A field holding a word (or a hash turned into a string) would fail HINCRBYFLOAT half-way through every
    batch to come, each failure turning the tier off for breaker_cooldown: it is taken as absent instead."""
    namespace = f"s-{uuid.uuid4().hex}"
    tier = RedisBackend(redis_client, KeySpace(namespace), metrics_shards=4)
    try:
        assert tier.apply_metrics(a_pass(0, KEYS[:4]))
        for shard in metrics_shards(redis_client, tier.keys):
            redis_client.hset(shard.totals, "passes", "a word")
            fraction = shard in [metrics_shards(redis_client, tier.keys)[pass_shard(f"pass-{n}", 4)] for n in (1, 2)]
            redis_client.hset(shard.kernel_calls, "softmax", "2.5" if fraction else "many")  # HINCRBY fails on both
        for key in KEYS[:4]:
            shard = metrics_shards(redis_client, tier.keys)[key_shard(key, 4)]
            redis_client.hset(shard.key_first, key, "never")
            redis_client.hset(shard.key_last, key, "nan?")
            redis_client.hset(shard.key_usage, key, "lots")
        for shard in metrics_shards(redis_client, tier.keys):
            redis_client.delete(shard.workers)
            redis_client.set(shard.worker_metrics("host", "w"), "a string where a hash was")
        assert tier.apply_metrics(a_pass(1, KEYS[:4]))
        assert tier.apply_metrics(a_pass(2, KEYS[:4]))
        assert tier.totals()["passes"] == 2  # the word counted as nothing; both batches counted
        assert tier.kernels()["softmax"]["call_count"] == 16
        assert dict(tier.key_usage()) == dict.fromkeys(KEYS[:4], 4)
        record = tier.key_records([KEYS[0]])[KEYS[0]]
        assert (record.first_use, record.last_use) == (101.0, 202.0)
        assert dict(((h, w), t) for h, w, t in tier.workers())[("host", "w")]["passes"] == 2
    finally:
        for pattern in tier.keys.namespace_patterns():
            for key in redis_client.scan_iter(match=pattern, count=1000):
                redis_client.delete(key)


def plant_other_types(redis_client, tier: RedisBackend, keys: list[str]) -> list[str]:
    """A string under every metrics name that is no hash of numbers: the sets, the pass log, a key's hashes."""
    names = []
    for shard in metrics_shards(redis_client, tier.keys):
        names += [shard.workers, shard.toolchains, shard.pass_log, shard.key_first, shard.key_last, shard.key_kernel,
                  shard.key_usage, *(shard.key_hosts(key) for key in keys)]  # fmt: skip
    for name in names:
        redis_client.delete(name)
        redis_client.set(name, "another tool's string")
    return names


@pytest.mark.redis
def test_another_type_under_a_metrics_name_fails_no_batch_and_no_report(redis_client) -> None:
    """A string where a set, the pass log or a key's hash stands made every batch fail half-way (its applied
    marker already set, so the retry counted nothing) and every report fail; each failure turned the tier off for
    breaker_cooldown and held the entries queued behind the batch. Reads now take such a key as empty, and the
    next batch replaces it."""
    from cachestore.report import build_report

    namespace = f"s-{uuid.uuid4().hex}"
    tier = RedisBackend(redis_client, KeySpace(namespace), metrics_shards=2)
    toolchain_pass = lambda n: msgspec.structs.replace(a_pass(n, KEYS[:4]), toolchain="tc")  # noqa: E731
    try:
        assert tier.apply_metrics(toolchain_pass(0))
        assert tier.zero_counters({"zeroed": 1.0}) is None
        plant_other_types(redis_client, tier, KEYS[:4])
        # Read past: empty, not an error.
        assert list(tier.workers()) == [] and tier.toolchains() == {} and tier.key_count() == 0
        assert tier.key_records(KEYS[:4]) == {} and tier.key_hosts(KEYS[:4]) == {} and list(tier.key_usage()) == []
        assert tier.pass_log_span(None) is None and list(tier.pass_log(None)) == []
        report = build_report(tier)
        assert report.totals["passes"] == 0 and report.per_host == {}
        tier.zero_counters({"zeroed": 2.0})  # the pass log under its name replaced, the record appended
        plant_other_types(redis_client, tier, KEYS[:4])
        # Written through: the batch applies whole, and its retry is still counted once.
        assert tier.apply_metrics(toolchain_pass(1)) and not tier.apply_metrics(toolchain_pass(1))
        assert tier.apply_metrics(toolchain_pass(2))
        assert tier.totals()["passes"] == 2 and set(tier.toolchains()) == {"tc"}
        assert [(h, w, t["passes"]) for h, w, t in tier.workers()] == [("host", "w", 2)]
        assert dict(tier.key_usage()) == dict.fromkeys(KEYS[:4], 4)
        assert tier.key_hosts(KEYS[:4]) == {key: ["host"] for key in KEYS[:4]}
        record = tier.key_records([KEYS[0]])[KEYS[0]]
        assert (record.kernel_name, record.first_use, record.last_use) == ("softmax", 101.0, 202.0)
        assert [r["graph"] for _, r in tier.pass_log(None)] == ["g1", "g2"]
        home = tier.keys.metrics_shard(pass_shard("pass-2", 2))
        assert [redis_client.type(name) for name in (home.workers, home.toolchains, home.pass_log)] == [
            b"set", b"set", b"stream"]  # fmt: skip
    finally:
        for pattern in tier.keys.namespace_patterns():
            for key in redis_client.scan_iter(match=pattern, count=1000):
                redis_client.delete(key)


@pytest.mark.redis
def test_a_client_whose_metrics_meet_another_type_keeps_the_tier_on_and_its_entries_flowing(
    redis_url: str, redis_client
) -> None:
    """The client's view of the case above: its batch is applied, its entries queued behind the batch are stored,
    and no tier error opens the breaker (which turned remote hits into misses for breaker_cooldown)."""
    from helpers_graphs import delete_namespace, unique_namespace
    from test_entry import make_entry

    from cachestore.settings import Settings
    from cachestore.stores import open_tier

    namespace = unique_namespace()
    client = open_tier(Settings(tier=redis_url, namespace=namespace, host="host", flush_interval=0.05))
    try:
        client.record(msgspec.structs.replace(a_pass(0, KEYS[:4]), toolchain="tc"))
        assert client.flush(10)
        plant_other_types(redis_client, client._backend, KEYS[:4])
        client.record(msgspec.structs.replace(a_pass(1, KEYS[:4]), toolchain="tc"))
        client.publish(KEYS[30], make_entry(binary=b"behind the batch"))
        assert client.flush(10)
        counts = client.counts()
        assert counts["tier_errors"] == counts["tier_dropped"] == 0 and client.available
        assert client.lookup(KEYS[30]).binary == b"behind the batch"
        assert client._backend.totals()["passes"] == 2
    finally:
        client.close()
        delete_namespace(redis_client, namespace)
