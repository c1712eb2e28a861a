"""Operating the fleet's queue: show a job or a batch, requeue dead letters, purge (see workers/fleet.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis.exceptions as rex

from bridge.identity import toolchain_id
from cachestore.api import stored_number
from cachestore.backends.redis import RedisClient, text
from cachestore.keys import JobKeys, KeySpace
from workers.fleet import GROUP, REQUEUE_LUA, FleetError, _heartbeat, _job, home_shards, job_shards, results_of
from workers.fleet_wakeups import wake_workers

JOB_FIELDS = ("status", "file", "error", "worker", "seconds")  # of each job in `batch show`
STREAM_SCAN_LIMIT = 10_000  # jobs of a stream looked through to find a waiting one (finished jobs leave it)


def job_info(client: RedisClient, keys: KeySpace, job_id: str) -> dict[str, Any]:
    """What is known of one job: its result once finished (completed or dead_letter), else the worker compiling
    it, else whether it waits in this toolchain's stream; `failed_attempts` so far, and whether its artifact is
    still stored. A job unknown to all of these never existed, or finished more than job_ttl ago. It is looked
    for in the shard of its id, then in shard 0 (where a job queued before the queue was sharded stays)."""
    info: dict[str, Any] = {"id": job_id}
    homes = [keys.job_shard(shard) for shard in home_shards(job_id, job_shards(client, keys))]
    result = results_of(client, keys, [job_id]).get(job_id)
    failures = next((f for f in (client.hget(home.failures, job_id) for home in homes) if f is not None), None)
    info["failed_attempts"] = int(stored_number(failures)) if failures is not None else 0  # hostile: 0
    if result is not None:
        info.update(result)
        info["artifact_stored"] = bool(client.exists(keys.job_artifact(job_id)))
        return info
    for name, beat in client.hgetall(keys.worker_heartbeats).items():
        fields = _heartbeat(beat)
        if fields is not None and fields.get("job") == job_id:
            info.update(status="in_flight", worker=text(name))
            return info
    for home in homes:
        for _message_id, fields in client.xrange(home.stream(toolchain_id()), count=STREAM_SCAN_LIMIT):
            job = _job(fields.get(b"job", fields.get("job")))
            if isinstance(job, dict) and job["id"] == job_id:
                info.update(status="waiting", file=job["file"], attempt=job.get("attempt", 1))
                return info
    info["status"] = "unknown"
    return info


def batch_info(client: RedisClient, keys: KeySpace, batch_id: str) -> dict[str, Any]:
    job_ids = [text(job) for job in client.lrange(keys.job_batch(batch_id), 0, -1)]
    if not job_ids:
        raise FleetError(f"no batch {batch_id!r}: never submitted, or finished more than job_ttl seconds ago")
    results = results_of(client, keys, job_ids)
    jobs = {job: results.get(job, {"status": "unfinished"}) for job in job_ids}
    statuses = [r.get("status") for r in jobs.values()]
    return {
        "batch": batch_id,
        "submitted": len(job_ids),
        "completed": statuses.count("completed"),
        "dead_letter": statuses.count("dead_letter"),
        "unfinished": statuses.count("unfinished"),
        "unreadable": statuses.count("unreadable"),
        "jobs": {
            job: {k: r.get(k) for k in ("status", "file", "error", "worker", "seconds")} for job, r in jobs.items()
        },
    }


def requeue(
    client: RedisClient, keys: KeySpace, job_ids: Sequence[str] | None, ttl: int
) -> tuple[list[str], list[str]]:
    """Put dead-lettered jobs (all, or those of `job_ids`) back on their toolchain's stream as new jobs (attempt
    1, their result and failure count cleared), each with a wake-up for an idle worker (kept `ttl` seconds).
    Returns (requeued job ids, problems): a dead letter that holds no job (a malformed message) or names no
    toolchain is not requeued, and neither is an id with no dead letter."""
    wanted = set(job_ids) if job_ids else None
    script = client.register_script(REQUEUE_LUA)
    requeued: list[str] = []
    problems: list[str] = []
    seen: set[str] = set()
    for shard in (keys.job_shard(i) for i in range(job_shards(client, keys))):
        for entry_id, fields in client.xrange(shard.dead_letters):
            job_id = text(fields.get(b"job", b""))
            if wanted is not None and job_id not in wanted:
                continue
            seen.add(job_id)
            problem = _requeue_one(client, keys, shard, script, (text(entry_id), job_id), fields.get(b"payload"), ttl)
            if problem is None:
                requeued.append(job_id)
            elif problem:
                problems.append(problem)
    if wanted is not None:
        problems += [f"job {job}: no dead letter" for job in sorted(wanted - seen)]
    return requeued, problems


def _requeue_one(
    client: RedisClient, keys: KeySpace, shard: JobKeys, script: Any, entry: tuple[str, str], payload: Any, ttl: int
) -> str | None:
    """Requeue one dead letter (its entry id and job id) onto its toolchain's stream in its own shard (the
    script's keys share its slot): None when requeued, "" when another requeue took it first, else the problem."""
    entry_id, job_id = entry
    job = _job(payload)
    if isinstance(job, str) or not isinstance(job.get("toolchain"), str):
        return f"dead letter {entry_id} ({job_id}) holds no job that names a toolchain; left"
    job = {**job, "attempt": 1}
    stream = shard.stream(job["toolchain"])
    ensure = _ensure_group(client, stream)
    if ensure is not None:
        return ensure
    script_keys = [shard.dead_letters, stream, shard.result(job["id"]), shard.failures]
    if not script(keys=script_keys, args=[entry_id, json.dumps(job), job["id"]]):
        return ""
    wake_workers(client, keys, job["toolchain"], 1, ttl)
    return None


def _ensure_group(client: RedisClient, stream: str) -> str | None:
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except rex.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            return f"{stream}: cannot create the consumer group: {exc}"
    return None


def purge(client: RedisClient, keys: KeySpace, dead_letters: bool, waiting: bool) -> dict[str, int]:
    """Delete the dead letters, and/or the jobs of this toolchain's stream that no worker has taken yet. Jobs
    in flight are left to finish (deleting them would not stop their workers)."""
    purged = {"dead_letters": 0, "waiting": 0}
    for shard in (keys.job_shard(i) for i in range(job_shards(client, keys))):
        if dead_letters:
            purged["dead_letters"] += client.xlen(shard.dead_letters)
            client.delete(shard.dead_letters)
        if waiting:
            purged["waiting"] += _purge_waiting(client, shard.stream(toolchain_id()))
    return purged


def _purge_waiting(client: RedisClient, stream: str) -> int:
    """Delete the jobs of `stream` past its group's last delivered one."""
    groups = [g for g in _groups(client, stream) if text(g["name"]) == GROUP]
    after = text(groups[0]["last-delivered-id"]) if groups else "0-0"
    purged = 0
    while True:
        batch = client.xrange(stream, min=f"({after}", count=1000)
        if not batch:
            return purged
        purged += client.xdel(stream, *[message_id for message_id, _ in batch])
        after = text(batch[-1][0])


def _groups(client: RedisClient, stream: str) -> list[dict]:
    try:
        return client.xinfo_groups(stream)
    except rex.ResponseError:
        return []  # no stream: nothing waits
