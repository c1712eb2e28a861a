"""A job's result, failure count or artifact key holding bytes no worker wrote (corruption, another tool, a
hand) is reported as such by `submit --wait`, `job show` and `batch show`: never a traceback, never a wait
for ever."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from helpers_graphs import delete_namespace, mixed_graph, write_graph

from cachestore.keys import KeySpace, job_shard
from workers import fleet
from workers.cli import main as nkicache

pytestmark = pytest.mark.redis

HOSTILE = [b"\xff\xfe not utf-8", b"not json", b"[1, 2]", json.dumps({"status": "done?"}).encode(),
           json.dumps({"status": "dead_letter", "attempts": "many", "error": None}).encode()]  # fmt: skip


@pytest.fixture
def queue(redis_url: str, tmp_path: Path) -> Iterator[tuple[redis.Redis, KeySpace, dict[str, str], list[str]]]:
    client = redis.Redis.from_url(redis_url)
    namespace = f"hostileresults{uuid.uuid4().hex[:12]}"
    keys = KeySpace(namespace)
    graphs = [write_graph(tmp_path, mixed_graph(f"g{i}")) for i in range(len(HOSTILE))]
    submission = fleet.submit(client, keys, [str(g) for g in graphs], 3600)
    shards = fleet.job_shards(client, keys)
    for job, value in zip(submission.job_ids, HOSTILE, strict=True):
        home = keys.job_shard(job_shard(job, shards))
        client.set(home.result(job), value)
        client.hset(home.failures, job, "NaN")
    env = {"NKICACHE_TIER": redis_url, "NKICACHE_NAMESPACE": namespace}
    try:
        yield client, keys, env, [submission.batch_id, *submission.job_ids]
    finally:
        delete_namespace(client, namespace)
        client.close()


def test_results_no_worker_wrote_read_as_unreadable_or_count_nothing(queue) -> None:
    client, keys, _env, (_batch, *jobs) = queue
    results = fleet.results_of(client, keys, jobs)
    assert [results[job]["status"] for job in jobs] == ["unreadable"] * 4 + ["dead_letter"]
    for job in jobs[:4]:
        assert results[job]["error"].startswith(f"the result stored for job {job} is not one a worker writes")


def test_batch_show_and_job_show_report_them_and_exit_1(queue) -> None:
    _client, _keys, env, (batch, *jobs) = queue
    shown = CliRunner().invoke(nkicache, ["batch", "show", batch, "--json"], env=env)
    assert shown.exit_code == 1, shown.output
    info = json.loads(shown.output)
    assert (info["completed"], info["unreadable"], info["dead_letter"]) == (0, 4, 1)
    one = CliRunner().invoke(nkicache, ["job", "show", jobs[0], "--json"], env=env)
    assert one.exception is None or isinstance(one.exception, SystemExit), one.output
    job = json.loads(one.output)
    assert job["status"] == "unreadable" and job["failed_attempts"] == 0


def test_submit_wait_finishes_on_them_without_a_traceback(queue, tmp_path: Path) -> None:
    client, keys, env, _ids = queue
    # A second batch whose results another tool overwrites as soon as they are asked for: wait must end.
    graph = write_graph(tmp_path, mixed_graph("late"))
    real = fleet.results_of

    def overwritten(client_, keys_, job_ids):
        for job in job_ids:
            client.set(keys.job_shard(job_shard(job, fleet.job_shards(client, keys))).result(job), b"\x00garbage")
        return real(client_, keys_, job_ids)

    fleet.results_of = overwritten
    try:
        result = CliRunner().invoke(nkicache, ["submit", str(graph), "--wait", "--timeout", "30", "--json"], env=env)
    finally:
        fleet.results_of = real
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["completed"] == 0 and report["unfinished"] == 0
    assert next(iter(report["jobs"].values()))["status"] == "unreadable"
