"""The codegen loop with a tier, compiling real graphs: a kernel variant traced anywhere is not traced again,
bad entries are rejected and re-traced, and racing processes trace each key once."""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers_entries import payload_of
from helpers_graphs import (
    MIXED_DISTINCT_KEYS,
    MIXED_KERNEL_OPS,
    TierView,
    assert_outputs_correct,
    binary_digests,
    compile_process_result,
    fresh_tier_backend,
    mixed_graph,
    slow_graph,
    start_compile_process,
    stored_entries,
    wait_until,
    write_graph,
)

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from bridge.limits import Limits
from bridge.parallel import key_variants, trace_task
from cachestore.api import TOTAL_COUNTERS
from cachestore.backends.sqlite import SqliteBackend
from cachestore.client import TierClient
from cachestore.entry import SignaturePolicy, decode_entry, encode_entry
from cachestore.settings import Settings
from cachestore.stores import open_tier
from workers.passes import compile_graph

HOST = "test-host"
KEY = b"fleet-signing-key-for-tests-0001"
OTHER_KEY = b"someone-elses-signing-key-00002"


@dataclass
class Tier:
    url: str
    namespace: str
    backend: Any  # a backend of our own on the same store, to look inside

    def settings(self, **changes: Any) -> Settings:
        return Settings(tier=self.url, namespace=self.namespace, host=HOST, **changes)

    def process_settings(self, **changes: Any) -> dict:
        return {"tier": self.url, "namespace": self.namespace, "host": HOST, **changes}

    @property
    def view(self) -> TierView:
        return TierView.of(self.backend)


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    for url, namespace, backend in fresh_tier_backend(request, tmp_path):
        yield Tier(url, namespace, backend)


def summed(batches: list[dict]) -> dict[str, float]:
    total: dict[str, float] = collections.defaultdict(float)
    for batch in batches:
        for name, value in batch.items():
            total[name] += value
    return dict(total)


def assert_fleet_totals(tier: Tier, batches: list[dict]) -> None:
    fleet = tier.view.totals()
    expected = summed(batches)
    assert set(expected) == set(TOTAL_COUNTERS)
    for name in TOTAL_COUNTERS:
        assert fleet.get(name, 0) == pytest.approx(expected[name], abs=1e-6), name


def compile_in_process(graph: dict, tier_client: Any = None) -> tuple[BirCodeGenLoop, Any]:
    loop = BirCodeGenLoop(tier=tier_client)
    return loop, loop.run(load_graph(graph))


# -- a second process -----------------------------------------------------------------------------------
def test_a_second_process_hits_what_the_first_traced(tier: Tier, tmp_path: Path) -> None:
    graph = mixed_graph()
    graph_path = write_graph(tmp_path, graph)
    first = compile_process_result(start_compile_process(tmp_path, graph_path, tier.process_settings(worker="w1")))
    second = compile_process_result(start_compile_process(tmp_path, graph_path, tier.process_settings(worker="w2")))

    assert first["summary"]["traces"] == MIXED_DISTINCT_KEYS
    assert first["summary"]["remote_hits"] == 0
    assert second["summary"]["remote_hits"] == first["summary"]["traces"]
    assert second["summary"]["traces"] == 0
    assert second["digests"] == first["digests"]  # byte-identical binaries
    # The specification's counters keep their local meaning.
    for run in (first, second):
        assert run["summary"]["cache_hits"] == MIXED_KERNEL_OPS - MIXED_DISTINCT_KEYS
        assert run["summary"]["cache_misses"] == MIXED_DISTINCT_KEYS
        for counter in ("tier_errors", "tier_timeouts", "tier_rejected", "tier_dropped", "lease_waits"):
            assert run["summary"][counter] == 0, counter
        assert run["stats"]["metrics_applied"] == 1
    assert second["summary"]["tier_saved_seconds"] > 0

    # The same binaries as a compile without any tier.
    _, bb = compile_in_process(graph)
    assert binary_digests(bb) == first["digests"]

    # Fleet totals in the tier equal the sums of what the passes counted.
    assert len(first["batches"]) == len(second["batches"]) == 1
    assert_fleet_totals(tier, first["batches"] + second["batches"])
    assert tier.view.totals()["passes"] == 2
    assert tier.view.worker_totals(HOST, "w1") == pytest.approx(first["batches"][0])
    assert tier.view.worker_totals(HOST, "w2") == pytest.approx(second["batches"][0])
    assert sum(tier.view.kernel_calls().values()) == 2 * MIXED_KERNEL_OPS
    assert tier.view.kernel_calls() == {"matmul_tiled": 6, "rmsnorm": 4, "softmax": 6}
    assert tier.view.variants() == {"matmul_tiled": 2, "rmsnorm": 2, "softmax": 2}
    assert [record["worker"] for record in tier.view.pass_log()] == ["w1", "w2"]


# -- bad entries ----------------------------------------------------------------------------------------
def _forged(data: bytes, policy: SignaturePolicy) -> bytes:
    forged = bytearray(data)
    forged[-len(payload_of(data)) // 2] ^= 0x01  # in the compressed payload, where the binary is
    return bytes(forged)


def _wrong_version(data: bytes, policy: SignaturePolicy) -> bytes:
    return data[:3] + bytes([data[3] + 1]) + data[4:]


def _wrongly_signed(data: bytes, policy: SignaturePolicy) -> bytes:
    return encode_entry(decode_entry(data, policy), OTHER_KEY)


def _resigned(data: bytes, policy: SignaturePolicy, **changes: Any) -> bytes:
    """The entry with `changes`, signed again with the writer's own key: intact by digest and signature."""
    entry = decode_entry(data, policy)
    for name, value in changes.items():
        setattr(entry, name, value)
    return encode_entry(entry, policy.hmac_key)


CORRUPTIONS = {
    "forged": _forged,
    "truncated": lambda data, policy: data[: len(data) * 2 // 3],
    "wrong-version": _wrong_version,
    "wrongly-signed": _wrongly_signed,
    # The bridge only ever emits 'bir'; a 'klir' entry (the dormant beta2 leaf's format) is not its output.
    "klir": lambda data, policy: _resigned(data, policy, format="klir"),
    # NaN compile seconds would poison tier_saved_seconds, the fleet metrics and every --json output.
    "nan-seconds": lambda data, policy: _resigned(data, policy, compile_seconds=float("nan")),
}


@pytest.mark.parametrize("hmac_key", [None, KEY], ids=["unsigned", "signed"])
def test_bad_entries_are_rejected_counted_and_retraced(tier: Tier, hmac_key: bytes | None) -> None:
    # Without a key, the reader refuses signed entries it cannot verify (so the wrongly signed one counts too).
    settings = tier.settings(hmac_key=hmac_key, reject_unverifiable=hmac_key is None, worker="w1")
    policy = SignaturePolicy(hmac_key)
    graph = mixed_graph()

    client = open_tier(settings)
    first, first_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    assert first.traces == MIXED_DISTINCT_KEYS
    stored = stored_entries(tier.backend)
    assert len(stored) == MIXED_DISTINCT_KEYS
    assert all(decode_entry(data, policy).binary for data in stored.values())

    corrupted = dict(zip(sorted(stored), CORRUPTIONS, strict=False))
    for cache_key, corruption in corrupted.items():
        tier.view.put_raw(cache_key, CORRUPTIONS[corruption](stored[cache_key], policy))

    client = open_tier(settings.replace(worker="w2"))
    second, second_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    assert second.tier_counts()["tier_rejected"] == len(CORRUPTIONS)
    assert second.traces == len(CORRUPTIONS)  # each bad entry re-traced
    assert second.remote_hits == MIXED_DISTINCT_KEYS - len(CORRUPTIONS)
    assert second.tier_counts()["tier_errors"] == 0
    assert binary_digests(second_bb) == binary_digests(first_bb)
    assert_outputs_correct(graph, second_bb)

    # The re-traced entries replaced the bad ones: a third pass takes everything from the tier.
    client = open_tier(settings.replace(worker="w3"))
    third, third_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    assert (third.traces, third.remote_hits, third.tier_counts()["tier_rejected"]) == (0, MIXED_DISTINCT_KEYS, 0)
    assert binary_digests(third_bb) == binary_digests(first_bb)
    assert tier.view.totals()["tier_rejected"] == len(CORRUPTIONS)


@pytest.mark.parametrize("hmac_key", [None, KEY], ids=["unsigned", "signed"])
def test_entries_swapped_between_keys_are_rejected_counted_and_retraced(tier: Tier, hmac_key: bytes | None) -> None:
    """Anyone who can write to the store can move intact, even signed, entries between keys: the digest and
    the signature still verify, but the entry's key components hash to another key."""
    settings = tier.settings(hmac_key=hmac_key, worker="w1")
    graph = mixed_graph()
    client = open_tier(settings)
    _, first_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    off_loop, off_bb = compile_in_process(graph)  # what a compile without any tier produces
    stored = stored_entries(tier.backend)
    by_kernel = collections.defaultdict(list)
    for cache_key, data in stored.items():
        by_kernel[decode_entry(data, SignaturePolicy(hmac_key)).key_components["kernel_name"]].append(cache_key)
    a, b = next(keys for keys in by_kernel.values() if len(keys) >= 2)[:2]  # same kernel, other shapes
    tier.view.put_raw(a, stored[b])
    tier.view.put_raw(b, stored[a])

    batches: list[dict] = []
    client = open_tier(settings.replace(worker="w2"))
    record_pass = client.record_pass
    client.record_pass = lambda record: (batches.append(dict(record.counts)), record_pass(record))
    second, second_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    assert second.tier_counts()["tier_rejected"] == 2
    assert (second.traces, second.remote_hits) == (2, MIXED_DISTINCT_KEYS - 2)
    assert binary_digests(second_bb) == binary_digests(off_bb) == binary_digests(first_bb)
    assert off_loop.traces == MIXED_DISTINCT_KEYS
    assert_outputs_correct(graph, second_bb)
    assert batches[0]["tier_rejected"] == 2 and tier.view.totals()["tier_rejected"] == 2
    # The re-traced entries replaced the swapped ones.
    assert (
        decode_entry(tier.view.raw(a), SignaturePolicy(hmac_key)).digest
        != decode_entry(stored[b], SignaturePolicy(hmac_key)).digest
    )


@pytest.mark.parametrize("hmac_key", [None, KEY], ids=["unsigned", "signed"])
def test_another_toolchains_entry_in_this_partition_is_rejected(tier: Tier, hmac_key: bytes | None) -> None:
    """An intact entry of another compiler copied into this compiler's partition (by a writer of the store,
    signed with the fleet's key) is that compiler's binary: refused, counted and traced again."""
    settings = tier.settings(hmac_key=hmac_key, worker="w1")
    graph = mixed_graph()
    client = open_tier(settings)
    _, first_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    stored = stored_entries(tier.backend)
    planted = sorted(stored)[0]
    tier.view.put_raw(planted, _resigned(stored[planted], SignaturePolicy(hmac_key), toolchain="0" * 16))
    client = open_tier(settings.replace(worker="w2"))
    second, second_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    assert second.tier_counts()["tier_rejected"] == 1
    assert (second.traces, second.remote_hits) == (1, MIXED_DISTINCT_KEYS - 1)
    assert binary_digests(second_bb) == binary_digests(first_bb)


def test_garbage_under_every_key_still_compiles_correctly(tier: Tier) -> None:
    graph = mixed_graph(rows=96)
    client = open_tier(tier.settings(worker="w1"))
    _, first_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    for cache_key in list(stored_entries(tier.backend)):
        tier.view.put_raw(cache_key, hashlib.sha256(cache_key.encode()).digest() * 3)
    client = open_tier(tier.settings(worker="w2"))
    second, second_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    assert second.tier_counts()["tier_rejected"] == MIXED_DISTINCT_KEYS
    assert (second.traces, second.remote_hits) == (MIXED_DISTINCT_KEYS, 0)
    assert binary_digests(second_bb) == binary_digests(first_bb)
    assert_outputs_correct(graph, second_bb, seed=1)


# -- racing processes -----------------------------------------------------------------------------------
def test_racing_processes_trace_each_key_once(tier: Tier, tmp_path: Path) -> None:
    variants = 10
    graph = slow_graph(variants=variants)
    graph_path = write_graph(tmp_path, graph)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    processes = [
        start_compile_process(
            tmp_path, graph_path, tier.process_settings(worker=f"racer-{i}", single_flight=True), (barrier, str(i), 2)
        )
        for i in range(2)
    ]
    results = [compile_process_result(process, timeout=90) for process in processes]

    traces = [r["summary"]["traces"] for r in results]
    remote_hits = [r["summary"]["remote_hits"] for r in results]
    assert sum(traces) == variants, f"traces {traces}, remote hits {remote_hits}"
    assert sum(remote_hits) == variants
    assert results[0]["digests"] == results[1]["digests"]
    for r in results:
        assert r["summary"]["tier_errors"] == r["summary"]["tier_timeouts"] == r["summary"]["tier_rejected"] == 0
    # They really raced: both compiles were running at once, and one waited on the other's leases.
    assert max(r["started"] for r in results) < min(r["finished"] for r in results)
    assert sum(r["summary"]["lease_waits"] for r in results) >= 1

    _, bb = compile_in_process(graph)
    assert binary_digests(bb) == results[0]["digests"]
    assert_fleet_totals(tier, results[0]["batches"] + results[1]["batches"])
    assert tier.view.totals()["traces"] == variants


def test_single_flight_waits_for_the_lease_holder(tier: Tier) -> None:
    """Deterministically, in one process: a key another worker holds the lease on is waited for, not traced."""
    graph = mixed_graph(rows=32)
    producer = open_tier(tier.settings(worker="producer"))
    _, reference_bb = compile_in_process(graph, producer)
    producer.close(timeout=10)
    entries = stored_entries(tier.backend)
    busy_key = sorted(entries)[0]
    tier.view.delete(busy_key)
    assert tier.backend.acquire_lease(busy_key, "other-worker", 30)  # tracing it, not yet published

    client = open_tier(tier.settings(worker="waiter", lease_wait=10))
    loop = BirCodeGenLoop(tier=client)

    def other_worker_publishes() -> None:
        if wait_until(lambda: loop.lease_waits == 1, timeout=10):  # once the waiter is waiting
            tier.view.put_raw(busy_key, entries[busy_key])
            tier.backend.release_lease(busy_key, "other-worker")

    other = threading.Thread(target=other_worker_publishes)
    other.start()
    bb = loop.run(load_graph(graph))
    other.join()
    client.close(timeout=10)
    assert loop.lease_waits == 1
    assert (loop.traces, loop.remote_hits) == (0, MIXED_DISTINCT_KEYS)
    assert binary_digests(bb) == binary_digests(reference_bb)


def test_a_dead_lease_holder_is_not_waited_for_beyond_lease_wait(tier: Tier) -> None:
    graph = mixed_graph(rows=32)
    client = open_tier(tier.settings(worker="w1"))
    _, reference_bb = compile_in_process(graph, client)
    client.close(timeout=10)
    keys = sorted(stored_entries(tier.backend))
    for cache_key in keys:
        tier.view.delete(cache_key)
    assert tier.backend.acquire_lease(keys[0], "dead-worker", 60)  # it will never publish

    client = open_tier(tier.settings(worker="w2", lease_wait=0.5))
    started = time.monotonic()
    loop, bb = compile_in_process(graph, client)
    client.close(timeout=10)
    assert time.monotonic() - started < 5
    assert loop.lease_waits == 1 and loop.traces == MIXED_DISTINCT_KEYS
    assert binary_digests(bb) == binary_digests(reference_bb)


def test_a_variant_traced_ahead_is_taken_without_a_lease_while_another_holds_one(tier: Tier, tmp_path: Path) -> None:
    """`compile --workers N` hands a pass the variants its processes traced ahead: the pass takes them without
    asking for a lease (two round trips each), so another worker holding the lease on one costs it no wait,
    and what it traced is stored all the same."""
    path = write_graph(tmp_path, mixed_graph(rows=32))
    plan = key_variants([str(path)], shared=False, target_name=None, limits=Limits())
    ahead = {task.cache_key: trace_task(task, None, Limits()).traced for task in plan.tasks}
    keys = sorted(ahead)  # (the pass takes what it uses out of the dict)
    busy_key = keys[0]
    assert tier.backend.acquire_lease(busy_key, "other-worker", 60)  # tracing it, and never done
    client = open_tier(tier.settings(worker="pool", lease_wait=30))
    started = time.monotonic()
    try:
        result, artifact = compile_graph(str(path), tier=client, traced_ahead=ahead)
        client.flush()
    finally:
        client.close(timeout=10)
    assert time.monotonic() - started < 10  # not the lease's 30 s
    assert result.error is None, result.error
    assert (result.counts["lease_waits"], result.counts["traces"]) == (0, MIXED_DISTINCT_KEYS), result.counts
    assert sorted(stored_entries(tier.backend)) == keys
    assert artifact == compile_graph(str(path))[1]


# -- modes ----------------------------------------------------------------------------------------------
def test_mirror_mode_writes_but_never_reads(tier: Tier) -> None:
    graph = mixed_graph()
    loops = []
    for worker in ("w1", "w2"):
        client = open_tier(tier.settings(tier_mode="mirror", worker=worker))
        loop, _ = compile_in_process(graph, client)
        client.close(timeout=10)
        loops.append(loop)
    for loop in loops:
        assert (loop.traces, loop.remote_hits, loop.lease_waits) == (MIXED_DISTINCT_KEYS, 0, 0)
    assert len(stored_entries(tier.backend)) == MIXED_DISTINCT_KEYS
    assert tier.view.totals()["passes"] == 2 and tier.view.totals()["traces"] == 2 * MIXED_DISTINCT_KEYS


def test_tier_off_is_the_specification_alone(tmp_path: Path) -> None:
    assert open_tier(Settings(tier="off")) is None
    assert open_tier(Settings(tier=f"local:{tmp_path / 'tier.sqlite'}", tier_mode="off")) is None
    assert not (tmp_path / "tier.sqlite").exists()


class _PublishesBeforeEachLease:
    """A backend through which another worker publishes every key (and lets its lease go) in the instant
    between this worker's lookup and its lease: the race single flight must not lose to."""

    def __init__(self, inner: Any, entries: dict[str, bytes]):
        self.inner = inner
        self.entries = entries

    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        TierView.of(self.inner).put_raw(cache_key, self.entries[cache_key])
        return self.inner.acquire_lease(cache_key, owner, ttl)

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_an_entry_published_between_lookup_and_lease_is_used_not_retraced(tier: Tier) -> None:
    graph = mixed_graph()
    producer = open_tier(tier.settings(worker="producer"))
    _, reference_bb = compile_in_process(graph, producer)
    producer.close(timeout=10)
    entries = stored_entries(tier.backend)
    for cache_key in entries:
        tier.view.delete(cache_key)

    client = TierClient(lambda: _PublishesBeforeEachLease(tier.backend, entries), tier.settings(worker="late"))
    loop, bb = compile_in_process(graph, client)
    client.close(timeout=10)
    assert (loop.traces, loop.remote_hits) == (0, MIXED_DISTINCT_KEYS)
    assert binary_digests(bb) == binary_digests(reference_bb)
    assert all(tier.backend.lease_holder(cache_key) is None for cache_key in entries)  # leases given back


def test_two_passes_with_one_pass_id_count_once_in_the_fleet(tmp_path: Path) -> None:
    """A fleet job compiled to the end twice (reclaimed from a slow worker) is one pass in the metrics."""
    from workers.passes import compile_graph

    backend = SqliteBackend(tmp_path / "tier.sqlite")
    client = TierClient(lambda: backend, Settings(tier="test", flush_interval=0.05), "test")
    for _ in range(2):
        result, _ = compile_graph(mixed_graph(), tier=client, pass_id="job-abc-00001")
        assert result.error is None
    client.close()
    totals = dict(backend._read("SELECT name, value FROM totals"))
    assert totals["passes"] == 1 and totals["kernels"] == MIXED_KERNEL_OPS
