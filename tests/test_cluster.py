"""The Redis tier and the fleet on a real 3-master Redis Cluster (no replicas), started by the fixtures.

The shared backend suite (tests/test_tier_backends.py) runs here once more against the cluster; then the
hash tags that make the multi-key operations legal, a fleet run (submit + two worker processes) and
`nkicache report` of it, and one master killed in the middle of a compile run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import test_readers as reader_suite
import test_tier_backends as shared
from click.testing import CliRunner
from helpers_graphs import (
    TierView,
    assert_outputs_correct,
    binary_digests,
    delete_namespace,
    metrics_shards,
    mixed_graph,
    slow_graph,
    stored_entries,
    summed_metrics_hash,
    unique_namespace,
    wait_until,
    write_graph,
)

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from bridge.identity import toolchain_id
from cachestore.api import TOTAL_COUNTERS
from cachestore.backends.redis import RedisBackend, connect
from cachestore.keys import KeySpace
from cachestore.settings import Settings
from cachestore.stores import open_tier
from workers.cli import main as nkicache
from workers.fleet import results_of

TC = toolchain_id()

# -- the shared backend and reader suites, on the cluster ----------------------------------------------
# Every test_* of both suites is collected here too, with `backend` and `reader` below: a RedisBackend on the
# cluster (the reader holding the reader suite's data set).
for _suite in (shared, reader_suite):
    for _name, _test in vars(_suite).items():
        if _name.startswith("test_") and callable(_test):
            globals()[_name] = _test


def cluster_client(url: str) -> Any:
    return connect(url, connect_timeout=2.0, op_timeout=5.0)


@pytest.fixture
def backend(redis_cluster: str) -> Iterator[RedisBackend]:
    namespace = unique_namespace()
    client = cluster_client(redis_cluster)
    tier = RedisBackend(client, KeySpace(namespace), "test cluster")
    yield tier
    delete_namespace(client, namespace)
    tier.close()


@pytest.fixture
def redis_backend(backend: RedisBackend) -> RedisBackend:
    """The Redis-only tests of the shared suite take the cluster's backend too."""
    return backend


@pytest.fixture
def view(backend: RedisBackend) -> TierView:
    return TierView.of(backend)


@pytest.fixture
def reader(backend: RedisBackend) -> RedisBackend:
    reader_suite.populate(backend)
    return backend


# -- hash tags: what must share a slot does ------------------------------------------------------------
def test_multi_key_operations_stay_in_one_slot(backend: RedisBackend) -> None:
    client, k = backend.client, backend.keys

    def slot(key: str) -> int:
        return client.cluster_keyslot(key)  # asked of the server, not computed here

    for cache_key in ("0" * 64, "f" * 64, "a3" * 32):
        assert slot(k.entry(TC, cache_key)) == slot(k.lease(TC, cache_key)) == slot(k.entry("b" * 16, cache_key))
    for m in (k.metrics_shard(0), k.metrics_shard(37)):  # every key of one metrics shard: one script's keys
        metrics = [m.applied_batch("b1"), m.totals, m.workers, m.worker_metrics("host", "w"), m.kernel_calls,
                   m.kernel_variants, m.key_usage, m.key_first, m.key_last, m.key_kernel, m.pass_log,
                   m.key_hosts("0" * 64), m.key_hosts("f" * 64), m.toolchains,
                   m.toolchain_metrics("0" * 16)]  # fmt: skip
        assert len({slot(key) for key in metrics}) == 1
    # Distinct tags, so nearly distinct slots: 64 random slots of 16,384 share one about one time in eight.
    assert len({slot(k.metrics_shard(i).totals) for i in range(64)}) >= 56
    # Every key of one job shard, every toolchain's stream in it too: one complete, fail or requeue script's keys.
    for j in (k.job_shard(0), k.job_shard(11)):
        jobs = [j.stream(TC), j.stream("b" * 16), j.dead_letters, j.result("b1-00000"), j.failures, j.counts]
        assert len({slot(key) for key in jobs}) == 1
    # Shard 0 is the slot of the queue before sharding, with its shared keys; the shards have a slot each.
    assert {slot(k.job_shard(0).counts)} == {
        slot(key) for key in (k.job_toolchains, k.worker_heartbeats, k.job_batch("b"))
    }
    assert len({slot(k.job_shard(i).counts) for i in range(16)}) >= 12
    # Artifacts (up to megabytes each) go where their job id hashes, not onto the jobs slot.
    assert len({slot(k.job_artifact(f"b1-{i:05d}")) for i in range(50)}) > 40
    # Entries spread over the masters by cache key; the metrics and jobs slots are whatever their tags hash to.
    assert len({slot(k.entry(TC, f"{i:064x}")) for i in range(50)}) > 40


def test_entries_spread_over_every_master_and_scan_finds_them_all(backend: RedisBackend) -> None:
    items = {f"{i:064x}": shared.entry(b"binary-%d" % i, shape=i) for i in range(300)}
    backend.store([shared.request_for(key, item) for key, item in items.items()], shared.TTL)
    per_master = {}
    for node in backend.client.get_primaries():
        direct = redis.Redis(host=node.host, port=node.port, socket_timeout=5)
        try:
            per_master[node.port] = sum(1 for _ in direct.scan_iter(match=backend.keys.entry_pattern(), count=1000))
        finally:
            direct.close()
    assert len(per_master) == 3
    assert all(count > 50 for count in per_master.values()), per_master
    assert sum(per_master.values()) == len(items)
    assert stored_entries(backend).keys() == items.keys()


def test_metrics_spread_over_every_master_and_read_back_summed(backend: RedisBackend) -> None:
    from cachestore.api import KeyUsage, MetricsBatch

    keys = [f"{i:064x}" for i in range(200)]
    for n in range(20):  # 20 passes of 10 variants each, every variant used twice a pass
        usage = {key: KeyUsage("softmax", 2, 100.0 + n, 100.0 + n) for key in keys[n * 10 : n * 10 + 10]}
        batch = MetricsBatch(f"pass-{n}", "host", f"w{n % 3}", {"passes": 1, "kernels": 20}, {"softmax": 20}, usage,
                             {"graph": f"g{n}", "finished": 1000.0 + n}, TC)  # fmt: skip
        assert backend.apply_metrics(batch)
        assert not backend.apply_metrics(batch)  # a retry counts once, in every shard it touched
    per_master = {}
    for node in backend.client.get_primaries():
        direct = redis.Redis(host=node.host, port=node.port, socket_timeout=5)
        try:
            per_master[node.port] = sum(1 for _ in direct.scan_iter(match=f"{{{backend.keys.prefix}:metrics*"))
        finally:
            direct.close()
    assert len(per_master) == 3 and all(count > 20 for count in per_master.values()), per_master
    assert backend.totals()["passes"] == 20 and backend.totals()["kernels"] == 400
    assert backend.key_count() == 200 and backend.kernels()["softmax"] == {"call_count": 400, "variants": 200}
    assert dict(backend.key_usage()) == dict.fromkeys(keys, 2)
    assert [record["graph"] for _, record in backend.pass_log(None)] == [f"g{n}" for n in range(20)]
    assert {worker for _, worker, _ in backend.workers()} == {"w0", "w1", "w2"}


# -- a fleet run: submit and two worker processes --------------------------------------------------------
def nkicache_argv(*args: str) -> list[str]:
    script = Path(sys.executable).parent / "nkicache"
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "workers.cli", *args]


def fleet_graphs(directory: Path) -> list[Path]:
    """Six graphs; pairs share kernel variants, so some are traced by one worker and hit by the other."""
    directory.mkdir()
    return [write_graph(directory, mixed_graph(f"fleet-{i}", rows=32 * (1 + i // 2))) for i in range(6)]


def read_fleet_totals(url: str, namespace: str) -> dict[str, float]:
    """The raw totals hashes summed over the metrics shards, to check the report against."""
    client = cluster_client(url)
    try:
        return summed_metrics_hash(client, KeySpace(namespace), lambda shard: shard.totals)
    finally:
        client.close()


def live_workers(env: dict[str, str]) -> list[str]:
    result = CliRunner().invoke(nkicache, ["queue", "--json"], env=env)
    assert result.exit_code == 0, result.output
    return [worker["name"] for worker in json.loads(result.output)["workers"]]


def exited(worker: subprocess.Popen) -> str:
    """A worker's stderr once it exits: by itself after its --max-jobs (a SIGTERM as it exits would end it with
    -15), else by SIGTERM after 30 s (a failed run)."""
    try:
        return worker.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        worker.send_signal(signal.SIGTERM)
        return worker.communicate(timeout=30)[1]


def test_fleet_run_on_the_cluster(redis_cluster: str, tmp_path: Path) -> None:
    namespace = unique_namespace()
    env = {**os.environ, "NKICACHE_TIER": redis_cluster, "NKICACHE_NAMESPACE": namespace,
           "NKICACHE_HEARTBEAT_INTERVAL": "0.5"}  # fmt: skip
    graphs = fleet_graphs(tmp_path / "graphs")
    # Half the jobs each: without a bound the first worker woken could take all six small jobs before the other
    # one looks.
    half = str(len(graphs) // 2)
    argv = [nkicache_argv("worker", "--name", f"cluster-w{i}", "--max-jobs", half) for i in range(2)]
    workers = [subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True) for args in argv]
    try:
        assert wait_until(lambda: len(live_workers(env)) == 2, timeout=30, interval=0.2)
        submit = subprocess.run(
            nkicache_argv("submit", str(tmp_path / "graphs"), "--wait", "--timeout", "60", "--json",
                          "--out", str(tmp_path / "out")),
            env=env, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        assert submit.returncode == 0, submit.stderr
        submitted = json.loads(submit.stdout)
        assert submitted["submitted"] == submitted["completed"] == len(graphs)
        assert submitted["dead_letter"] == submitted["unfinished"] == 0
        assert len(submitted["artifacts"]) == len(graphs)
    finally:
        errors = [exited(worker) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], errors

    checked = CliRunner().invoke(nkicache, ["run", "--check", "--json", str(tmp_path / "out")])
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.output)["ok"] is True

    client = cluster_client(redis_cluster)
    keys = KeySpace(namespace)
    try:
        results = list(results_of(client, keys, list(submitted["jobs"])).values())
        queue = json.loads(CliRunner().invoke(nkicache, ["queue", "--json"], env=env).output)
        # The report run: the fleet totals are what the workers' passes counted, summed, each pass once.
        reported = CliRunner().invoke(nkicache, ["report", "--json"], env=env)
        assert reported.exit_code == 0, reported.output
        report = json.loads(reported.output)
        fleet = report["totals"]
        assert {name: fleet[name] for name in TOTAL_COUNTERS} == pytest.approx(
            {name: read_fleet_totals(redis_cluster, namespace).get(name, 0) for name in TOTAL_COUNTERS}
        )
        assert {r["worker"] for r in results} == {"cluster-w0", "cluster-w1"}  # both workers took jobs
        assert queue["completed"] == len(graphs) and queue["pending"] == queue["in_flight"] == 0
        assert queue["workers"] == []  # both left
        assert fleet["passes"] == len(graphs)
        for name in TOTAL_COUNTERS:
            if name != "passes":
                expected = sum(r[name] for r in results)
                assert fleet.get(name, 0) == pytest.approx(expected, abs=1e-6), name
        assert fleet["remote_hits"] > 0  # variants traced by one worker were hit by the other (or a later job)
        assert fleet["tier_errors"] == fleet["tier_timeouts"] == 0
        per_worker = {w for host in report["per_host"].values() for w in host["workers"]}
        assert per_worker == {"cluster-w0", "cluster-w1"}
        shards = metrics_shards(client, keys)
        workers_seen = {member.decode() for shard in shards for member in client.smembers(shard.workers)}
        assert {member.rsplit(":", 1)[1] for member in workers_seen} == {"cluster-w0", "cluster-w1"}
        # report --zero: one script per metrics shard, every key it touches declared.
        zeroed = CliRunner().invoke(nkicache, ["report", "--zero", "--json"], env=env)
        assert zeroed.exit_code == 0, zeroed.output
        assert json.loads(zeroed.output)["previous"]["passes"] == len(graphs)
        after = json.loads(CliRunner().invoke(nkicache, ["report", "--json"], env=env).output)
        assert after["totals"]["passes"] == 0 and after["per_host"] == {} and after["per_toolchain"] == {}
        assert len(after["zeroed"]) == 1 and sum(b["passes"] for b in after["timeline"]) == len(graphs)
    finally:
        delete_namespace(client, namespace)
        client.close()


def test_every_key_the_fleet_writes_is_in_the_documented_layout(redis_cluster: str, tmp_path: Path) -> None:
    """After compiles and fleet jobs, every key of the namespace is an entry, a lease, a variant index or one
    of the two tagged families; the job shards (and the jobs' results) and the metrics shards each spread over
    several masters."""
    namespace = unique_namespace()
    keys = KeySpace(namespace)
    settings = Settings(tier=redis_cluster, namespace=namespace, host="layout-host", heartbeat_interval=0.5)
    graph = write_graph(tmp_path, mixed_graph("layout"))
    from workers import fleet

    client = fleet.fleet_client(settings)
    try:
        # 8 jobs over 16 shards: all on one of 3 masters has a chance of 3 in 3**8 for a random namespace.
        jobs = fleet.submit(client, keys, [str(graph)] * 8, settings.entry_ttl).job_ids
        assert fleet.Worker(settings, "layout-worker", max_jobs=8).run() == 8
        assert len(fleet.results_of(client, keys, jobs)) == 8
        by_family: dict[str, set[int]] = {}
        for node in client.get_primaries():
            direct = redis.Redis(host=node.host, port=node.port, socket_timeout=5)
            try:
                for key in direct.scan_iter(match=f"*{namespace}*", count=1000):
                    key = key.decode()
                    family = key_family(key, keys)
                    by_family.setdefault(family, set()).add(node.port)
            finally:
                direct.close()
        assert set(by_family) == {"entry", "variants", "metrics", "jobs", "job-result", "artifact"}, by_family
        # The queue and the metrics are sharded: the streams, the results and even one pass spread over masters.
        assert len(by_family["jobs"]) > 1 and len(by_family["job-result"]) > 1 and len(by_family["metrics"]) > 1
    finally:
        delete_namespace(client, namespace)
        client.close()


def key_family(key: str, keys: KeySpace) -> str:
    partitioned = key.startswith(f"{keys.prefix}:tc:")
    toolchain, _, rest = key.removeprefix(f"{keys.prefix}:tc:").partition(":")
    for family in ("entry", "lease"):
        if partitioned and len(toolchain) == 16 and rest.startswith(f"{family}:{{") and key.endswith("}"):
            return family
    if key == keys.metrics_shard_count or re.match(rf"\{{{re.escape(keys.prefix)}:metrics(:\d+)?\}}:", key):
        return "metrics"
    if key == keys.job_shard_count or re.match(rf"\{{{re.escape(keys.prefix)}:jobs(:\d+)?\}}:", key):
        return "job-result" if ":result:" in key else "jobs"
    if re.fullmatch(rf"{re.escape(keys.prefix)}:variants:\{{[^{{}}]+\}}", key):
        return "variants"
    if re.fullmatch(rf"{re.escape(keys.prefix)}:artifact:\{{[^{{}}]+\}}", key):
        return "artifact"
    raise AssertionError(f"{key} is not in the documented key layout (docs/tiers.md)")


# -- one master killed mid-run -------------------------------------------------------------------------------
def compile_passes(
    settings: Settings, graphs: list[Any], kill_before_pass: int | None = None, kill: Any = None
) -> dict:
    """Compile `graphs` one pass after another with one tier client, as `nkicache compile` does in a process;
    with `kill_before_pass`, `kill()` runs as that pass (0-based) starts, before it reads the tier."""
    tier = open_tier(settings)
    if kill_before_pass is not None:
        find_many, calls = tier.find_many, []

        def kill_then_find_many(cache_keys: list[str]) -> Any:
            calls.append(cache_keys)
            if len(calls) == kill_before_pass + 1:
                kill()
            return find_many(cache_keys)

        tier.find_many = kill_then_find_many
    started = time.monotonic()
    passes = []
    for graph in graphs:
        loop = BirCodeGenLoop(tier=tier)
        bb = loop.run(graph)
        passes.append({"digests": binary_digests(bb), "bb": bb, "summary": loop.pass_summary()})
    seconds = time.monotonic() - started
    if tier is not None:
        tier.close()
    totals = {name: sum(p["summary"][name] for p in passes) for name in ("traces", "remote_hits", "tier_errors")}
    return {"passes": passes, "seconds": seconds, "totals": totals, "stats": tier.stats.snapshot() if tier else {}}


def test_a_master_killed_mid_run_fails_fast_and_counts_while_the_compile_succeeds(
    private_redis_cluster: Any,
) -> None:
    cluster = private_redis_cluster
    namespace = unique_namespace()
    documents = [slow_graph(f"kill-{i}", variants=6, base_rows=1024 * (i + 1)) for i in range(3)]
    graphs = [load_graph(document) for document in documents]
    settings = Settings(tier=cluster.url, namespace=namespace, host="kill-host")

    untiered = compile_passes(settings.replace(tier="off"), graphs)  # the normal time: every variant traced
    cold = compile_passes(settings, graphs)
    assert cold["totals"]["traces"] == 18 and cold["stats"]["tier_errors"] == 0
    digests = [p["digests"] for p in cold["passes"]]

    client = cluster_client(cluster.url)
    keys = KeySpace(namespace)
    stored = [raw.cache_key for raw in RedisBackend(client, keys).scan_entries()]
    entry_ports = {key: cluster.port_of_slot(client.keyslot(keys.entry(TC, key))) for key in stored}
    client.close()
    assert len(entry_ports) == 18
    counts = {port: list(entry_ports.values()).count(port) for port in cluster.ports}
    victim = max(counts, key=counts.get)  # the master holding most entries
    assert 0 < counts[victim] < 18

    # The first pass reads its six kernels from the tier; the victim dies as the second pass starts.
    warm = compile_passes(settings, graphs, kill_before_pass=1, kill=cluster.node(victim).kill)
    assert not cluster.node(victim).running
    assert [p["digests"] for p in warm["passes"]] == digests  # the compile succeeds, byte for byte
    for document, result in zip(documents, warm["passes"], strict=True):
        assert_outputs_correct(document, result["bb"])
    first, second = (p["summary"] for p in warm["passes"][:2])
    assert first["remote_hits"] == 6 and first["tier_errors"] == 0
    assert second["traces"] > 0 and second["tier_errors"] + second["tier_timeouts"] > 0  # counted in the pass
    assert warm["totals"]["traces"] + warm["totals"]["remote_hits"] == 18
    # Fail fast: connection refused, then the breaker, never an operation timeout waited out (a count, not a
    # time: under load a compile's seconds say little). The time bound only catches a hang.
    assert warm["stats"]["tier_timeouts"] <= 1, warm["stats"]  # (the kill may land mid-command)
    assert warm["seconds"] < 3 * untiered["seconds"] + 10, (warm["seconds"], untiered["seconds"])

    # With the breaker closing at once, only the dead master's slots fail: the other masters still hit.
    again = compile_passes(settings.replace(breaker_cooldown=0.001), graphs)
    assert [p["digests"] for p in again["passes"]] == digests
    assert again["totals"]["remote_hits"] > 0 and again["totals"]["tier_errors"] > 0
    assert again["totals"]["traces"] >= counts[victim]
    assert again["stats"]["tier_timeouts"] == 0, again["stats"]  # each failure a refused connection
    assert again["seconds"] < 3 * untiered["seconds"] + 10, (again["seconds"], untiered["seconds"])


# -- a scan split over processes (cachestore.scan_split) ------------------------------------------------
def test_du_and_verify_split_over_processes_on_a_cluster(backend: RedisBackend, ci: Any, laptop: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """The forked processes read through the cluster client they inherit (its pipelines)."""
    from test_scan_split import HMAC_KEY, fill_mixed, previous_disk_usage

    from cachestore import scan_split
    from cachestore.entry import SignaturePolicy
    from cachestore.inspect import disk_usage
    from workers.verify import verify_entries

    monkeypatch.setattr(scan_split, "PAGE", 3)
    monkeypatch.setattr(scan_split, "SPLIT_AFTER_PAGES", 2)
    bad = fill_mixed(backend, ci, laptop)
    assert disk_usage(backend, processes=2) == previous_disk_usage(backend)
    policy = SignaturePolicy(hmac_key=HMAC_KEY, require_signed=False)
    split, alone = verify_entries(backend, policy, processes=2), verify_entries(backend, policy, processes=1)
    assert split.checked == alone.checked and {i["key"] for i in split.bad} == {i["key"] for i in alone.bad}
    assert {item["key"] for item in split.bad} == set(bad.values())
