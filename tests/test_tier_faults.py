"""Redis faults against real redis-servers of our own (never REDIS_URL's): a connection closed by the server or
inherited by a fork, not listening, killed and restarted mid-run, slow, out of memory, flushed. The compile
always finishes, correct and on time; errors and timeouts are counted; fleet totals equal what the passes
counted, exactly once."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from helpers_graphs import (
    MIXED_DISTINCT_KEYS,
    assert_outputs_correct,
    binary_digests,
    metrics_shards,
    mixed_graph,
    summed_metrics_hash,
    unique_namespace,
    wait_until,
)

from bench.dev_redis import die_with_parent, pings
from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from cachestore.api import TOTAL_COUNTERS, TierError, WriteItem
from cachestore.backends.redis import RedisBackend
from cachestore.client import TierClient
from cachestore.keys import KeySpace
from cachestore.settings import Settings
from cachestore.stores import open_tier

HOST = "fault-host"
STALL_BOUND_SECONDS = 3.0  # how much longer than `--tier off` a compile may take when Redis misbehaves


@pytest.fixture
def server(private_redis_server: Callable[[], Any]) -> Any:
    return private_redis_server()


@pytest.fixture
def admin(server: Any) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url, socket_timeout=10)
    yield client
    client.close()


def start_durable(server: Any) -> None:
    """(Re)start a private server on its port and folder with an fsync-always append-only file, so a
    SIGKILL loses nothing it acknowledged."""
    server.process = subprocess.Popen(
        ["redis-server", "--port", str(server.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
         "--appendfsync", "always", "--dir", server.dir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent,
    )  # fmt: skip
    probe = redis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        assert wait_until(lambda: pings(probe, close=False), timeout=10), "durable redis-server did not start"
    finally:
        probe.close()


def settings_for(server: Any, namespace: str, **changes: Any) -> Settings:
    return Settings(tier=server.url, namespace=namespace, host=HOST, worker="w1", **changes)


class RecordingClient:
    """Wraps TierClient.record_pass to keep what each pass counted (its batch's totals), for comparison."""

    def __init__(self, client: TierClient):
        self.client = client
        self.batches: list[dict[str, float]] = []
        record_pass = client.record_pass

        def recording(record: Any) -> None:
            self.batches.append(dict(record.counts))  # (no writer key here: nothing else joins the totals)
            record_pass(record)

        client.record_pass = recording  # type: ignore[method-assign]

    def summed(self) -> dict[str, float]:
        total: dict[str, float] = collections.defaultdict(float)
        for batch in self.batches:
            for name, value in batch.items():
                total[name] += value
        return dict(total)


def compile_pass(graph: dict, client: Any) -> tuple[BirCodeGenLoop, Any]:
    loop = BirCodeGenLoop(tier=client)
    return loop, loop.run(load_graph(graph))


def fleet_totals(url: str, namespace: str) -> dict[str, float]:
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return summed_metrics_hash(client, KeySpace(namespace), lambda shard: shard.totals)
    finally:
        client.close()


def assert_totals_equal(fleet: dict[str, float], expected: dict[str, float]) -> None:
    for name in TOTAL_COUNTERS:
        assert fleet.get(name, 0) == pytest.approx(expected.get(name, 0), abs=1e-6), name


# -- the Redis connection: forks and connections the server closed ------------------------------------------
@pytest.fixture
def backend(server: Any) -> Iterator[RedisBackend]:
    tier = RedisBackend(redis.Redis.from_url(server.url, socket_timeout=5), KeySpace(unique_namespace()), "faults")
    yield tier
    tier.close()


def test_a_forked_child_reads_on_a_connection_of_its_own(backend: RedisBackend) -> None:
    """A worker pool forks from a parent that already read: the child reads on a connection of its own (two
    processes on one socket would read each other's replies), and the parent's reads still work after it."""
    backend.put_entries([WriteItem("k", b"shared", None, 3600)])
    assert backend.fetch(["k"], None) == {"k": b"shared"}
    parent_connection = backend.client.client_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ok = backend.fetch(["k"], None) == {"k": b"shared"} and backend.client.client_id() != parent_connection
            os.write(write, b"ok" if ok else b"read on the parent's connection")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 100) == b"ok"
    os.close(read)
    assert backend.fetch(["k"], None) == {"k": b"shared"} and backend.client.client_id() == parent_connection


def test_reads_go_on_after_the_server_closes_the_connection(backend: RedisBackend, admin: redis.Redis) -> None:
    """The server closes the backend's connection (CLIENT KILL, as a restart or an idle timeout would): a read
    may fail once, as a TierError, and never returns another read's bytes; the next connects again."""
    backend.put_entries([WriteItem("k", b"v", None, 3600)])
    assert backend.fetch(["k"], None) == {"k": b"v"}
    assert admin.client_kill_filter(_id=backend.client.client_id()) == 1
    results: list[object] = []
    for _ in range(2):
        try:
            results.append(backend.fetch(["k"], None))
        except TierError:
            results.append("failed")
    assert results[-1] == {"k": b"v"} and all(result in ("failed", {"k": b"v"}) for result in results)


# -- not listening ------------------------------------------------------------------------------------
def test_redis_not_listening(server: Any) -> None:
    server.stop()  # its port is now closed
    graphs = [mixed_graph(f"g{i}", rows=32 * (i + 1)) for i in range(3)]

    started = time.perf_counter()
    offline = [compile_pass(graph, None) for graph in graphs]
    tier_off_seconds = time.perf_counter() - started

    started = time.perf_counter()
    client = open_tier(settings_for(server, unique_namespace()))
    online = [compile_pass(graph, client) for graph in graphs]
    undelivered = client.pending()
    client.close()
    tier_on_seconds = time.perf_counter() - started

    assert tier_on_seconds - tier_off_seconds < STALL_BOUND_SECONDS
    for graph, (loop_off, bb_off), (loop, bb) in zip(graphs, offline, online, strict=True):
        assert binary_digests(bb) == binary_digests(bb_off)
        assert (loop.traces, loop.remote_hits) == (loop_off.traces, 0)
        assert (loop.cache_hits, loop.cache_misses) == (loop_off.cache_hits, loop_off.cache_misses)
        assert_outputs_correct(graph, bb)
    assert online[0][0].tier_counts()["tier_errors"] > 0
    stats = client.stats.snapshot()
    assert stats["tier_errors"] > 0 and stats["tier_rejected"] == 0 and stats["metrics_applied"] == 0
    assert undelivered >= len(graphs) and stats["tier_dropped"] == undelivered  # counted, not lost silently


@pytest.mark.parametrize(
    "make_url",
    [lambda port: f"redis+cluster://127.0.0.1:{port}", lambda port: "redis://127.0.0.1:not-a-port/0"],
    ids=["cluster-unreachable", "malformed-url"],
)
def test_a_tier_that_cannot_be_opened_does_not_fail_the_compile(server: Any, make_url: Any) -> None:
    server.stop()
    graph = mixed_graph()
    _, bb_off = compile_pass(graph, None)
    client = open_tier(Settings(tier=make_url(server.port), namespace=unique_namespace(), host=HOST))
    started = time.monotonic()
    loop, bb = compile_pass(graph, client)
    client.close()
    assert time.monotonic() - started < STALL_BOUND_SECONDS
    assert binary_digests(bb) == binary_digests(bb_off)
    assert loop.tier_counts()["tier_errors"] >= 1


# -- killed and restarted -------------------------------------------------------------------------------
def test_killed_and_restarted_mid_run_metrics_arrive_exactly_once(server: Any) -> None:
    server.stop()
    start_durable(server)
    namespace = unique_namespace()
    settings = settings_for(server, namespace, breaker_cooldown=0.2, op_timeout=0.5, final_flush_timeout=0.5)
    client = open_tier(settings)
    recorder = RecordingClient(client)
    graphs = [mixed_graph(f"pass{i}", rows=32 * (1 + i % 3)) for i in range(6)]
    expected = [binary_digests(compile_pass(graph, None)[1]) for graph in graphs]
    loops = []

    def run(i: int) -> None:
        loop, bb = compile_pass(graphs[i], client)
        assert binary_digests(bb) == expected[i]
        loops.append(loop)

    run(0)
    run(1)
    assert client.flush(10) and client.pending() == 0  # the first passes were delivered
    server.kill()
    run(2)  # Redis is gone: the passes go on, their metrics wait in the outbox
    run(3)
    assert client.pending() >= 2
    assert loops[2].tier_counts()["tier_errors"] > 0
    start_durable(server)  # back, with what it had acknowledged
    run(4)
    run(5)
    client.close(timeout=30)

    stats = client.stats.snapshot()
    assert stats["tier_dropped"] == 0 and client.pending() == 0
    assert len(recorder.batches) == 6
    fleet = fleet_totals(server.url, namespace)
    assert_totals_equal(fleet, recorder.summed())
    assert fleet["passes"] == 6
    reader = redis.Redis.from_url(server.url, socket_timeout=5)
    shards = metrics_shards(reader, KeySpace(namespace))
    log = [json.loads(fields[b"pass"]) for shard in shards for _, fields in reader.xrange(shard.pass_log)]
    reader.close()
    assert sorted(record["graph"] for record in log) == [f"pass{i}" for i in range(6)]


# -- slow ---------------------------------------------------------------------------------------------
def test_slow_redis_times_out_and_the_compile_finishes(server: Any, admin: redis.Redis) -> None:
    namespace = unique_namespace()
    graph = mixed_graph()
    _, bb_off = compile_pass(graph, None)
    client = open_tier(settings_for(server, namespace, op_timeout=0.3, breaker_cooldown=1.0))
    recorder = RecordingClient(client)
    pause_seconds = 2.5
    admin.execute_command("CLIENT", "PAUSE", int(pause_seconds * 1000), "ALL")  # every command waits
    paused_at = time.monotonic()
    loop, bb = compile_pass(graph, client)
    assert time.monotonic() - paused_at < pause_seconds / 2  # the compile did not wait for Redis
    assert loop.tier_counts()["tier_timeouts"] >= 1
    assert loop.traces == MIXED_DISTINCT_KEYS
    assert binary_digests(bb) == binary_digests(bb_off)
    assert_outputs_correct(graph, bb)

    client.close(timeout=20)  # the pause ends: what was held is delivered
    stats = client.stats.snapshot()
    assert stats["tier_timeouts"] >= 1 and stats["tier_dropped"] == 0
    # Commands whose replies timed out may still have run when Redis resumed; nothing may count twice.
    assert_totals_equal(fleet_totals(server.url, namespace), recorder.summed())


# -- out of memory --------------------------------------------------------------------------------------
def fill_to_oom(admin: redis.Redis) -> None:
    used = admin.info("memory")["used_memory"]
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", max(1024 * 1024, used + 256 * 1024))
    for i in range(10_000):
        try:
            admin.set(f"filler:{i}", b"x" * 16 * 1024)
        except redis.exceptions.OutOfMemoryError:
            return
    raise AssertionError("redis-server never ran out of memory")


@pytest.mark.parametrize("single_flight", [False, True])
def test_out_of_memory_stores_fail_counted_and_the_compile_is_correct(
    server: Any, admin: redis.Redis, single_flight: bool
) -> None:
    fill_to_oom(admin)
    namespace = unique_namespace()
    graph = mixed_graph()
    _, bb_off = compile_pass(graph, None)
    client = open_tier(settings_for(server, namespace, single_flight=single_flight))
    started = time.monotonic()
    loop, bb = compile_pass(graph, client)
    client.close()
    assert time.monotonic() - started < STALL_BOUND_SECONDS
    assert binary_digests(bb) == binary_digests(bb_off)
    assert_outputs_correct(graph, bb)
    assert loop.traces == MIXED_DISTINCT_KEYS
    stats = client.stats.snapshot()
    assert stats["tier_errors"] >= 1 and stats["tier_timeouts"] == 0
    assert stats["tier_dropped"] >= 1  # the entries and metrics that could not be stored, counted
    assert list(admin.scan_iter(match=KeySpace(namespace).entry_pattern())) == []
    assert fleet_totals(server.url, namespace) == {}


# -- flushed --------------------------------------------------------------------------------------------
def test_flushed_mid_run_later_passes_still_work(server: Any, admin: redis.Redis) -> None:
    namespace = unique_namespace()
    graph = mixed_graph()
    client = open_tier(settings_for(server, namespace))
    recorder = RecordingClient(client)

    first, bb_first = compile_pass(graph, client)
    assert client.flush(10)  # the pass does not wait for its writes: stored before the tier is flushed
    assert first.traces == MIXED_DISTINCT_KEYS and client.pending() == 0
    admin.flushall()
    second, bb_second = compile_pass(graph, client)  # the tier forgot everything: trace again, no errors
    assert (second.traces, second.remote_hits) == (MIXED_DISTINCT_KEYS, 0)
    third, bb_third = compile_pass(graph, client)  # the second pass repopulated it
    assert (third.traces, third.remote_hits) == (0, MIXED_DISTINCT_KEYS)
    client.close(timeout=10)

    assert binary_digests(bb_first) == binary_digests(bb_second) == binary_digests(bb_third)
    for loop in (first, second, third):
        assert loop.tier_counts() == dict.fromkeys(loop.tier_counts(), 0)
    after_flush = collections.defaultdict(float)
    for batch in recorder.batches[1:]:
        for name, value in batch.items():
            after_flush[name] += value
    fleet = fleet_totals(server.url, namespace)
    assert_totals_equal(fleet, after_flush)
    assert fleet["passes"] == 2
