"""The fleet's job queue in J shards (cachestore.keys.JobKeys): a batch's jobs spread over the shards by job id,
a worker takes one job at a time from all of them, each job is done once, and a queue from before sharding
(everything in shard 0, no shard count stored) still drains."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from bridge.identity import toolchain_id
from cachestore.keys import KeySpace, job_shard
from cachestore.settings import Settings, SettingsError, load_settings
from workers import fleet as fleet_module
from workers.fleet import GROUP, Worker, job_shards, results_of, submit_texts
from workers.fleet_ops import job_info
from workers.workload import generate_workload


def test_a_batch_spreads_over_the_shards_by_job_id_with_a_group_in_each() -> None:
    client, keys = fakeredis.FakeRedis(), KeySpace(f"js{uuid.uuid4().hex[:8]}")
    submission = submit_texts(client, keys, [(f"g{i}.json", "{}") for i in range(40)], 60, shards=16)
    assert client.get(keys.job_shard_count) == b"16" and job_shards(client, keys) == 16
    holding: dict[int, list[str]] = {}
    for shard in range(16):
        stream = keys.job_shard(shard).stream(toolchain_id())
        assert [g["name"] for g in client.xinfo_groups(stream)] == [GROUP.encode()]  # even an empty shard's
        holding[shard] = [json.loads(fields[b"job"])["id"] for _, fields in client.xrange(stream)]
    assert sorted(job for jobs in holding.values() for job in jobs) == sorted(submission.job_ids)
    assert all(job_shard(job, 16) == shard for shard, jobs in holding.items() for job in jobs)
    assert sum(1 for jobs in holding.values() if jobs) > 8  # 40 jobs over 16 shards


def test_the_first_submitter_fixes_the_count_and_later_ones_keep_it() -> None:
    client, keys = fakeredis.FakeRedis(), KeySpace(f"js{uuid.uuid4().hex[:8]}")
    assert job_shards(client, keys) == 1  # nothing fixed yet: only shard 0, the layout before sharding
    submit_texts(client, keys, [("a.json", "{}")], 60, shards=4)
    later = submit_texts(client, keys, [(f"b{i}.json", "{}") for i in range(20)], 60, shards=64)
    assert job_shards(client, keys) == 4
    streams = [keys.job_shard(i).stream(toolchain_id()) for i in range(64)]
    assert sum(client.xlen(stream) for stream in streams[:4]) == 21 and not any(map(client.exists, streams[4:]))
    assert all(job_shard(job, 4) < 4 for job in later.job_ids)


def test_job_shards_is_validated() -> None:
    assert Settings().job_shards == 16
    for bad in ("0", "1025"):
        with pytest.raises(SettingsError, match=rf"NKICACHE_JOB_SHARDS: job_shards must be from 1 to 1024, got {bad}"):
            load_settings(environ={"NKICACHE_JOB_SHARDS": bad})


class CountingClient:
    """A client that records each XREADGROUP's stream and BLOCK and each BLPOP's keys and timeout, and passes
    every call on."""

    def __init__(self, client: Any):
        self.client = client
        self.reads: list[tuple[str, int | float | None]] = []

    def xreadgroup(self, group: str, consumer: str, streams: dict, count: int, block: int | None = None) -> Any:
        [stream] = streams
        self.reads.append((stream, block))
        return self.client.xreadgroup(group, consumer, streams, count=count, block=block)

    def blpop(self, keys: list[str], timeout: float) -> Any:
        [key] = keys
        self.reads.append((key, timeout))
        return self.client.blpop(keys, timeout=timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def reading_worker(client: Any, keys: KeySpace, shards: int) -> Worker:
    worker = Worker(Settings(tier="redis://127.0.0.1:1/0", namespace=keys.namespace), "w1")
    worker.client = CountingClient(client)
    worker.shards = [keys.job_shard(i) for i in range(shards)]
    fleet_module.ensure_group(client, keys, worker.toolchain, shards)
    return worker


def test_an_idle_worker_reads_each_shard_once_then_blocks_for_a_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    client, keys = fakeredis.FakeRedis(), KeySpace(f"js{uuid.uuid4().hex[:8]}")
    worker = reading_worker(client, keys, 8)
    monkeypatch.setattr(fleet_module, "BLOCK_MS", 10)
    assert worker._read_new() is None and worker._read_new() is None
    streams = [keys.job_shard(i).stream(worker.toolchain) for i in range(8)]
    first, second = worker.client.reads[:9], worker.client.reads[9:]
    # Non-blocking over all 8 from a rotating start, then one short block on the wake-ups: 9 commands per BLOCK_MS.
    wake = (keys.job_wake(worker.toolchain), 0.01)
    assert first == [(s, None) for s in streams] + [wake]
    assert second == [(s, None) for s in streams[1:] + streams[:1]] + [wake]


def test_a_worker_takes_one_job_at_a_time_from_every_shard_in_turn() -> None:
    client, keys = fakeredis.FakeRedis(), KeySpace(f"js{uuid.uuid4().hex[:8]}")
    submission = submit_texts(client, keys, [(f"g{i}.json", "{}") for i in range(12)], 60, shards=4)
    worker = reading_worker(client, keys, 4)
    taken = []
    for _ in range(12):
        shard, message_id, fields = worker._read_new()
        job = json.loads(fields[b"job"])
        assert shard == keys.job_shard(job_shard(job["id"], 4))
        # Exactly one message pending for this worker: it never holds a job it is not compiling.
        pending = sum(client.xpending(s.stream(worker.toolchain), GROUP)["pending"] for s in worker.shards)
        assert pending == 1
        taken.append(job["id"])
        client.xack(shard.stream(worker.toolchain), GROUP, message_id)
    assert sorted(taken) == sorted(submission.job_ids)
    shards_in_order = [job_shard(job, 4) for job in taken[:4]]
    assert len(set(shards_in_order)) > 1  # turns: not all of one shard before the next


# -- with real workers on a private redis-server --------------------------------------------------------------
def test_two_workers_do_every_job_of_a_sharded_batch_exactly_once(fleet, tmp_path: Path) -> None:
    f = fleet(job_shards=8)
    graphs = generate_workload(tmp_path / "graphs", 12, seed=41)
    # Six jobs each at most: both must take jobs (the first to wake could otherwise take them all); a job done
    # twice would leave another undone.
    f.start_worker("w1", "--max-jobs", "6")
    f.start_worker("w2", "--max-jobs", "6")
    f.wait_live("w1", "w2")
    report = f.submit(*graphs)
    assert report["completed"] == 12 and report["dead_letter"] == report["unfinished"] == 0, report
    assert len({job_shard(job, 8) for job in report["jobs"]}) > 3
    # Both exit by themselves after their six jobs (a SIGTERM as a worker exits would end it with -15).
    assert f.workers["w1"].wait(timeout=30) == 0 and f.workers["w2"].wait(timeout=30) == 0
    results = f.results()
    assert set(results) == set(report["jobs"])
    assert {r["worker"] for r in results.values()} == {"w1", "w2"}  # both took jobs
    # Once each: one completion counted per job, one compile (one metrics pass) per job, nothing left pending.
    assert f.counts() == {"completed": 12} and f.totals()["passes"] == 12
    assert f.in_flight() == 0 and f.queue()["pending"] == 0


def test_a_queue_from_before_sharding_drains_and_its_jobs_are_found(private_redis_server, tmp_path: Path) -> None:
    """Jobs on the old layout's stream (shard 0, no shard count stored) are compiled by a worker of the sharded
    layout; their results stay in shard 0, where results_of and job show find them."""
    server = private_redis_server()
    namespace = f"fleettest{uuid.uuid4().hex[:12]}"
    client, keys = redis.Redis.from_url(server.url), KeySpace(namespace)
    graphs = generate_workload(tmp_path / "graphs", 3, seed=42)
    old_stream = keys.jobs(f"stream:{toolchain_id()}")  # the key the queue had before sharding
    assert old_stream == keys.job_shard(0).stream(toolchain_id())
    client.xgroup_create(old_stream, GROUP, id="0", mkstream=True)
    jobs = [f"old-{i:05d}" for i in range(3)]
    for job_id, graph in zip(jobs, graphs, strict=True):
        job = {"id": job_id, "batch": "old", "file": str(graph), "graph": graph.read_text(), "attempt": 1,
               "toolchain": toolchain_id()}  # fmt: skip
        client.xadd(old_stream, {"job": json.dumps(job)})
    assert any(job_shard(job, 16) != 0 for job in jobs)  # so finding them in shard 0 is the fallback's doing

    settings = load_settings({"tier": server.url, "namespace": namespace, "heartbeat_interval": 0.2})
    assert Worker(settings, "w-new", max_jobs=3).run() == 3
    assert job_shards(client, keys) == 16
    found = results_of(client, keys, jobs)
    assert {job: r["status"] for job, r in found.items()} == dict.fromkeys(jobs, "completed")
    assert all(client.exists(keys.job_shard(0).result(job)) for job in jobs)
    assert job_info(client, keys, jobs[0])["status"] == "completed"
    status = fleet_module.queue_status(client, keys, 0.2)
    assert (status["completed"], status["pending"], status["in_flight"]) == (3, 0, 0)
    assert client.xlen(old_stream) == 0


def test_a_worker_looks_at_the_shards_pending_jobs_only_while_a_worker_may_have_died() -> None:
    """The takeover look costs one XPENDING per shard: it runs first (this name's jobs from before a restart),
    then only while a heartbeat is stale or gone for less than job_claim_idle (older ones XAUTOCLAIM covers)."""
    client, keys = fakeredis.FakeRedis(), KeySpace(f"js{uuid.uuid4().hex[:8]}")
    worker = reading_worker(client, keys, 4)  # heartbeat_interval 2 s: dead after 4 s; job_claim_idle 60 s
    now = time.time()

    def beat(name: str, age: float) -> None:
        client.hset(keys.worker_heartbeats, name, json.dumps({"time": now - age}))

    beat("alive", 0)
    assert worker._takeover_due() is True and worker._takeover_due() is False
    beat("long-dead", 3600)
    assert worker._takeover_due() is False
    beat("just-died", 10)
    assert worker._takeover_due() is True
    client.hdel(keys.worker_heartbeats, "just-died")
    assert worker._takeover_due() is True  # its heartbeat is gone, and its job may not be idle long enough yet
    worker._vanished = {name: gone - 3600 for name, gone in worker._vanished.items()}
    assert worker._takeover_due() is False
