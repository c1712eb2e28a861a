"""Issue 48: the fleet's waits are woken, not timed. An idle worker takes a job the moment it is queued, in any
shard, and `submit --wait` returns the moment its last job finishes; both still look on their own, so a lost
wake-up costs a bound, never a job."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from helpers_graphs import delete_namespace, unique_namespace, wait_until

import workers.fleet
from cachestore.keys import KeySpace
from cachestore.settings import Settings
from workers.fleet import Worker, batch_of, submit_texts, wait_for
from workers.fleet_wakeups import WAKE_TOKENS, finished_jobs, tell_finished, wait_for_job, wake_workers

FOREVER_MS = 600_000  # a block no test could sit out: returning at all shows the wake-up came


@pytest.fixture
def namespace(redis_client: redis.Redis) -> Iterator[str]:
    name = unique_namespace()
    yield name
    delete_namespace(redis_client, name)


def test_wake_ups_are_capped_and_popped_one_at_a_time(redis_client: redis.Redis, namespace: str) -> None:
    keys = KeySpace(namespace)
    assert not wait_for_job(redis_client, keys, "tc", 0.05)  # none queued: the block ends on its own
    wake_workers(redis_client, keys, "tc", 3 * WAKE_TOKENS, ttl=60)
    assert redis_client.llen(keys.job_wake("tc")) == WAKE_TOKENS
    assert 0 < redis_client.ttl(keys.job_wake("tc")) <= 60
    assert wait_for_job(redis_client, keys, "tc", 0.05)
    assert redis_client.llen(keys.job_wake("tc")) == WAKE_TOKENS - 1
    assert not wait_for_job(redis_client, keys, "another toolchain", 0.05)


def test_finished_jobs_of_several_batches_come_back_in_one_call(redis_client: redis.Redis, namespace: str) -> None:
    keys = KeySpace(namespace)
    assert finished_jobs(redis_client, keys, ["b1", "b2"], 0.05) == []
    for batch, job in (("b1", "b1-00000"), ("b2", "b2-00000"), ("b1", "b1-00001"), ("b3", "b3-00000")):
        tell_finished(redis_client, keys, batch, job, ttl=60)
    assert sorted(finished_jobs(redis_client, keys, ["b1", "b2"], 0.05)) == ["b1-00000", "b1-00001", "b2-00000"]
    assert finished_jobs(redis_client, keys, ["b1", "b2"], 0.05) == []  # each id is told once


def finish(client: redis.Redis, keys: KeySpace, job_id: str, shards: int) -> None:
    """What a worker's complete script and its push do for a job, without a worker."""
    shard = keys.job_shard(workers.fleet.job_shard(job_id, shards))
    client.set(shard.result(job_id), json.dumps({"status": "completed", "file": job_id}), ex=60)
    tell_finished(client, keys, batch_of(job_id), job_id, ttl=60)


def test_a_wait_returns_when_its_last_job_is_told_finished(
    redis_client: redis.Redis, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers.fleet, "LOOK_SECONDS", FOREVER_MS / 1000)
    keys = KeySpace(namespace)
    submission = submit_texts(redis_client, keys, [("a.json", "{}"), ("b.json", "{}")], ttl=60, shards=4)
    progress: list[int] = []
    finisher = threading.Timer(0.2, lambda: [finish(redis_client, keys, job, 4) for job in submission.job_ids])
    finisher.start()
    started = time.monotonic()
    waited = wait_for(redis_client, keys, submission.job_ids, None, progress.append, job_ttl=60)
    finisher.join()
    assert sorted(waited.results) == sorted(submission.job_ids) and waited.lost == []
    assert time.monotonic() - started < FOREVER_MS / 1000 / 2  # woken by the push, not the next look
    assert progress[0] == 0 and progress[-1] == 2


def test_a_wait_still_finds_a_result_whose_push_was_lost(
    redis_client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed between its result and its push: the wait's own look finds the result."""
    monkeypatch.setattr(workers.fleet, "LOOK_SECONDS", 0.3)
    keys = KeySpace(namespace)
    submission = submit_texts(redis_client, keys, [("a.json", "{}")], ttl=60, shards=4)
    [job] = submission.job_ids
    shard = keys.job_shard(workers.fleet.job_shard(job, 4))
    redis_client.set(shard.result(job), json.dumps({"status": "completed"}), ex=60)
    waited = wait_for(redis_client, keys, [job], 30, lambda done: None, job_ttl=60)
    assert list(waited.results) == [job]


def idle_worker(redis_url: str, namespace: str) -> Worker:
    worker = Worker(Settings(tier=redis_url, namespace=namespace, job_shards=8), "w-idle")
    shards = workers.fleet.fix_job_shards(worker.client, worker.keys, 8)
    worker.shards = [worker.keys.job_shard(i) for i in range(shards)]
    workers.fleet.ensure_group(worker.client, worker.keys, worker.toolchain, shards)
    return worker


def test_an_idle_worker_takes_a_job_in_any_shard_as_soon_as_it_is_queued(
    redis_client: redis.Redis, redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers.fleet, "BLOCK_MS", FOREVER_MS)
    worker = idle_worker(redis_url, namespace)
    name = f"idle-{namespace}"
    worker.client = redis.Redis.from_url(redis_url, client_name=name)  # no socket timeout: it blocks FOREVER_MS
    taken: list[Any] = []
    reader = threading.Thread(target=lambda: taken.append(worker._read_new()), daemon=True)
    reader.start()

    def blocked() -> bool:  # every shard looked at, found empty, and waiting for a wake-up
        return any(c["name"] == name and c["cmd"] == "blpop" for c in redis_client.client_list())

    assert wait_until(blocked, timeout=30) and not taken
    submission = submit_texts(redis_client, worker.keys, [("a.json", "{}")], ttl=60, shards=8)
    reader.join(timeout=30)
    assert not reader.is_alive(), "the worker was not woken by the job it was waiting for"
    [(shard, _message_id, fields)] = taken
    assert json.loads(fields[b"job"])["id"] == submission.job_ids[0]
    assert shard == worker.keys.job_shard(workers.fleet.job_shard(submission.job_ids[0], 8))


def test_a_key_that_is_no_list_turns_a_woken_wait_into_a_timed_one(redis_client: redis.Redis, namespace: str) -> None:
    """Another tool's string under the wake-up or finished list: the waits time out as before, no error."""
    keys = KeySpace(namespace)
    redis_client.set(keys.job_wake("tc"), b"not a list")
    redis_client.set(keys.job_batch_done("b1"), b"not a list")
    tell_finished(redis_client, keys, "b2", "b2-00000", ttl=60)
    started = time.monotonic()
    assert not wait_for_job(redis_client, keys, "tc", 0.05)
    assert finished_jobs(redis_client, keys, ["b1", "b2"], 0.05) == []
    assert time.monotonic() - started >= 0.1  # both waited their block out
