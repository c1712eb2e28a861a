"""The fleet: compile jobs on a Redis Stream, read by workers on many machines through a consumer group.

    submit   XADD one job per graph (the graph's JSON travels in the job, so workers need no shared disk)
             onto the stream of the submitter's toolchain (`bridge.identity.toolchain_id`) in the job's shard
    worker   XREADGROUP on its own toolchain's streams, one job from one shard at a time, compile in a child
             process (workers/job_process.py), then store the artifact (under its own hash tag) and one Lua
             script records the result, XACKs and XDELs the job (a finished job leaves the stream); a worker
             takes over the jobs of a worker whose heartbeat is older than two intervals (XCLAIM), and
             XAUTOCLAIM, after `job_claim_idle`, of any worker that went quiet
    failure  any failure of a job (an exception, a limit exceeded, its compiling process killed) is the job's:
             it is re-queued with its attempt count; after `job_max_attempts` it goes to the dead-letter
             stream with its error; a message that is no job at all goes there at once, under its message id
    results  one key per job id, written with SET NX and expiring after `job_ttl` (as do artifacts and
             batches), so a job completes exactly once even when a reclaimed job was also finished by the
             worker that was thought dead, and finished jobs do not pile up

Routing by toolchain: a binary is only right for the compiler that made it (issue 13), so each toolchain has
its own stream and consumer group, and a worker reads only its own compiler's stream. A job another compiler
submitted waits for a worker of that compiler (`nkicache queue` names toolchains that have waiting jobs and no
live worker) instead of being compiled by the wrong one. A job whose own JSON names another toolchain than
the worker's (only a hand-written job can) fails with an error naming both and is never compiled. Results,
counts, failures and dead letters stay shared.

Sharding (cachestore.keys.JobKeys): the queue is split over J shards (`job_shards`, fixed per namespace), each
in its own hash slot, so a cluster spreads it over its masters. A job goes to shard crc32(job id) mod J and
everything recorded about it (result, failures, counts, dead letter) goes to the shard it was read from, so
each script touches one slot. Shard 0 is the queue's slot from before sharding: its jobs still drain.

Artifacts live in the tier (`NS:vV:artifact:{JOB}`, tagged by their job id so that they spread over a cluster,
expiring after `job_ttl`); `nkicache submit --wait --out
DIR` downloads them so `nkicache run` can load them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import msgspec
import redis.exceptions as rex

from bridge.graph import load_graph, parse_graph_json, read_graph_file
from bridge.identity import toolchain_id
from bridge.inputs import shown_path
from bridge.port import plural
from cachestore.api import stored_number
from cachestore.backends.redis import RedisClient, text
from cachestore.keys import DEFAULT_JOB_SHARDS, MAX_JOB_SHARDS, JobKeys, KeySpace, job_shard, shard_count_or
from cachestore.settings import Settings
from workers.fleet_connection import BLOCK_MS, FleetError, fleet_client
from workers.fleet_wakeups import finished_jobs, tell_finished, wait_for_job, wake_workers
from workers.job_process import CompileProcess
from workers.passes import PassResult

logger = logging.getLogger(__name__)
GROUP = "nkicache-workers"
MAX_GRAPH_BYTES = 16 * 1024 * 1024  # the max_graph_bytes setting's default

# KEYS[1] result key  KEYS[2] counts hash  KEYS[3] job stream  KEYS[4] failures hash
# ARGV[1] job id  ARGV[2] result JSON  ARGV[3] job_ttl (s)  ARGV[4] message id
# Record the result once (a second finisher of a reclaimed job changes nothing), acknowledge and delete the
# message: an acknowledged job has nothing left to do in the stream but hold its graph's bytes. The artifact
# is stored before, under its own hash tag (another slot): a result never names an artifact that is not there.
COMPLETE_JOB_LUA = """
if redis.call('SET', KEYS[1], ARGV[2], 'NX', 'EX', ARGV[3]) then
  redis.call('HINCRBY', KEYS[2], 'completed', 1)
  redis.call('HDEL', KEYS[4], ARGV[1])
end
redis.call('XACK', KEYS[3], 'nkicache-workers', ARGV[4])
redis.call('XDEL', KEYS[3], ARGV[4])
return 1
"""

# KEYS[1] result key  KEYS[2] counts  KEYS[3] failures  KEYS[4] job stream  KEYS[5] dead-letter stream
# ARGV[1] job id  ARGV[2] message id  ARGV[3] error  ARGV[4] max attempts  ARGV[5] job JSON  ARGV[6] worker
# ARGV[7] job_ttl (s)  ARGV[8] the job's graph file  ARGV[9] dead_letter_limit
# Count the failure; re-queue the job, or dead-letter it after the last attempt (the stream trimmed to the
# newest dead_letter_limit); acknowledge and delete the message either way (a retry is a new message).
FAIL_JOB_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('XACK', KEYS[4], 'nkicache-workers', ARGV[2])
  redis.call('XDEL', KEYS[4], ARGV[2])
  return 0
end
local attempts = redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
redis.call('HINCRBY', KEYS[2], 'failed', 1)
if attempts >= tonumber(ARGV[4]) then
  local result = cjson.encode({status='dead_letter', error=ARGV[3], worker=ARGV[6], attempts=attempts,
                               file=ARGV[8]})
  redis.call('SET', KEYS[1], result, 'EX', ARGV[7])
  redis.call('HINCRBY', KEYS[2], 'dead_letter', 1)
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('XADD', KEYS[5], 'MAXLEN', ARGV[9], '*', 'job', ARGV[1], 'error', ARGV[3], 'attempts', attempts,
             'payload', ARGV[5])
else
  redis.call('XADD', KEYS[4], '*', 'job', ARGV[5])
end
redis.call('XACK', KEYS[4], 'nkicache-workers', ARGV[2])
redis.call('XDEL', KEYS[4], ARGV[2])
return attempts
"""


# KEYS[1] job stream   ARGV[1] consumer   ARGV[2] message id
# Reset the idle time of a job this consumer still holds, so a long compile is not taken over while its worker
# is alive (only a worker that went quiet loses its job); a job another consumer already took is left alone, and
# so is a deleted message (a trace task its job withdrew, workers/trace_tasks.py): XCLAIM would drop it from the
# pending list, by which the job waits for this worker's answer.
TOUCH_JOB_LUA = """
local entry = redis.call('XPENDING', KEYS[1], 'nkicache-workers', ARGV[2], ARGV[2], 1)[1]
if entry and entry[2] == ARGV[1] and #redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2]) > 0 then
  redis.call('XCLAIM', KEYS[1], 'nkicache-workers', ARGV[1], 0, ARGV[2], 'JUSTID')
  return 1
end
return 0
"""


# KEYS[1] job stream  KEYS[2] dead-letter stream  KEYS[3] counts
# ARGV[1] message id  ARGV[2] error  ARGV[3] the message's job field as it is  ARGV[4] dead_letter_limit
# A message that is no job (hand-written, corrupt) has no job id to record a result or count attempts under:
# dead-letter it under its message id, once (only the worker whose XACK acknowledged it), and acknowledge it.
DEAD_LETTER_MESSAGE_LUA = """
if redis.call('XACK', KEYS[1], 'nkicache-workers', ARGV[1]) == 1 then
  redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[4], '*', 'job', ARGV[1], 'error', ARGV[2], 'attempts', 0,
             'payload', ARGV[3])
  redis.call('HINCRBY', KEYS[3], 'dead_letter', 1)
end
redis.call('XDEL', KEYS[1], ARGV[1])
return 1
"""


# KEYS[1] dead-letter stream  KEYS[2] job stream  KEYS[3] result key  KEYS[4] failures
# ARGV[1] dead-letter entry id  ARGV[2] job JSON (attempt 1)  ARGV[3] job id
# Put a dead-lettered job back on its stream as new, once: only the caller whose XDEL removed the entry.
REQUEUE_LUA = """
if redis.call('XDEL', KEYS[1], ARGV[1]) == 1 then
  redis.call('XADD', KEYS[2], '*', 'job', ARGV[2])
  redis.call('DEL', KEYS[3])
  redis.call('HDEL', KEYS[4], ARGV[3])
  return 1
end
return 0
"""


def ensure_group(client: RedisClient, keys: KeySpace, toolchain: str, shards: int) -> None:
    """The consumer group of every shard's stream of `toolchain`."""
    for shard in range(shards):
        try:
            client.xgroup_create(keys.job_shard(shard).stream(toolchain), GROUP, id="0", mkstream=True)
        except rex.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


def fix_job_shards(client: RedisClient, keys: KeySpace, wanted: int) -> int:
    """The namespace's number of job shards, fixed by the first submitter or worker to `wanted` (the setting
    job_shards): every later one uses that count, whatever its own setting."""
    client.set(keys.job_shard_count, wanted, nx=True)
    return job_shards(client, keys, wanted)


def job_shards(client: RedisClient, keys: KeySpace, configured: int = DEFAULT_JOB_SHARDS) -> int:
    """The namespace's number of job shards, or 1 before any is fixed (only shard 0, today's layout, can hold
    jobs then); `configured` (the job_shards setting) when the key holds no count, with one warning. Only
    reads, so the read-only ACL user can run it."""
    stored = client.get(keys.job_shard_count)
    if stored is None:
        return 1
    return shard_count_or(stored, MAX_JOB_SHARDS, configured, keys.job_shard_count)


def home_shards(job_id: str, shards: int) -> list[int]:
    """Where a job's result, failures or message can be: the shard of its id, then shard 0 (a job queued before
    the queue was sharded is there, and finishes there)."""
    return list(dict.fromkeys([job_shard(job_id, shards), 0]))


# -- submitting -----------------------------------------------------------------------------------
class Submission(msgspec.Struct):
    batch_id: str
    toolchain: str  # the submitter's compiler: only a worker of this toolchain takes the jobs
    job_ids: list[str] = msgspec.field(default_factory=list)
    names: dict[str, str] = msgspec.field(default_factory=dict)  # job id -> graph file


def read_graphs(paths: Sequence[str], max_bytes: int = MAX_GRAPH_BYTES) -> list[str]:
    """The text of every graph file, each checked as its job will be: readable, at most `max_bytes`, UTF-8,
    JSON, and a graph `load_graph` accepts. The first file that is not is a FleetError or GraphError naming it.
    A job is a graph's text, so a file that cannot be one fails here, on the submitter's machine, instead of
    as a dead letter after job_max_attempts compiles."""
    graphs = []
    for path in paths:
        data = read_graph_file(path, max_bytes)  # bounded, and never a device or a FIFO
        source = shown_path(path)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FleetError(f"{source}: graph file is not UTF-8 text: byte {exc.start} is invalid") from None
        load_graph(parse_graph_json(text, source), source=source)
        graphs.append(text)
    return graphs


def submit(
    client: RedisClient,
    keys: KeySpace,
    paths: Sequence[str],
    ttl: int,
    max_bytes: int = MAX_GRAPH_BYTES,
    shards: int = DEFAULT_JOB_SHARDS,
) -> Submission:
    """One job per graph file. Every file is read and checked before the first job is enqueued: a bad one
    fails the submission with nothing enqueued, never a batch cut short and left unrecorded. The batch's list
    of job ids lives `ttl` seconds (job_ttl), as its results do."""
    graphs = list(zip(map(str, paths), read_graphs(paths, max_bytes), strict=True))
    return submit_texts(client, keys, graphs, ttl, shards)


def submit_texts(
    client: RedisClient, keys: KeySpace, graphs: Sequence[tuple[str, str]], ttl: int, shards: int = DEFAULT_JOB_SHARDS
) -> Submission:
    """One job per (name, graph text), every text already checked as `read_graphs` does. Each job goes to the
    shard of its id (`shards` is the job_shards setting, used if the namespace has no count yet)."""
    toolchain = toolchain_id()
    count = fix_job_shards(client, keys, shards)
    # The groups exist before the first job, so a worker that starts later still reads from the beginning;
    # the registry lets `nkicache queue` find the streams even while no worker of the toolchain is live.
    ensure_group(client, keys, toolchain, count)
    client.hset(keys.job_toolchains, toolchain, time.time())
    submission = Submission(uuid.uuid4().hex[:12], toolchain)
    for path, graph in graphs:
        job_id = f"{submission.batch_id}-{len(submission.job_ids):05d}"  # batch_of(job_id) is the batch id
        job = {
            "id": job_id,
            "batch": submission.batch_id,
            "file": path,
            "graph": graph,
            "attempt": 1,
            "toolchain": toolchain,
        }
        client.xadd(keys.job_shard(job_shard(job_id, count)).stream(toolchain), {"job": json.dumps(job)})
        submission.job_ids.append(job_id)
        submission.names[job_id] = path
    if submission.job_ids:
        client.rpush(keys.job_batch(submission.batch_id), *submission.job_ids)
        client.expire(keys.job_batch(submission.batch_id), ttl)
        wake_workers(client, keys, toolchain, len(submission.job_ids), ttl)
    return submission


def results_of(client: RedisClient, keys: KeySpace, job_ids: Sequence[str]) -> dict[str, dict]:
    """The results of the finished jobs among `job_ids` (a job not finished, or whose result expired, has none).
    One GET per job (a cluster's MGET needs one slot); a job with none in its id's shard is looked for in shard 0,
    where a job queued before sharding finished."""
    shards = job_shards(client, keys)
    results = _results_in(client, keys, {job_id: job_shard(job_id, shards) for job_id in job_ids})
    before = {job_id: 0 for job_id in job_ids if job_id not in results and job_shard(job_id, shards) != 0}
    return {**results, **_results_in(client, keys, before)} if before else results


def _results_in(client: RedisClient, keys: KeySpace, shard_of: dict[str, int]) -> dict[str, dict]:
    with client.pipeline(transaction=False) as pipe:
        for job_id, shard in shard_of.items():
            pipe.get(keys.job_shard(shard).result(job_id))
        values = pipe.execute() if shard_of else []
    return {job: job_result(job, value) for job, value in zip(shard_of, values, strict=True) if value is not None}


RESULT_STATUSES = ("completed", "dead_letter")  # what a worker's complete and fail scripts write


def job_result(job_id: str, value: bytes | str) -> dict[str, Any]:
    """A job's stored result; one no worker wrote (corrupt, or another tool's bytes under its key) reads as
    finished with status `unreadable` and an error saying so, so that `submit --wait`, `job show` and `batch
    show` report it instead of failing, and a wait does not wait for it for ever."""
    try:
        result = json.loads(value)
    except (TypeError, ValueError):  # UnicodeDecodeError is a ValueError
        result = None
    if not isinstance(result, dict) or result.get("status") not in RESULT_STATUSES:
        return {
            "status": "unreadable",
            "error": f"the result stored for job {job_id} is not one a worker writes (corrupt, or another tool's)",
        }
    return result


def batch_of(job_id: str) -> str:
    """The batch a job id belongs to (`submit_texts` makes job ids BATCH-NNNNN)."""
    return job_id.rpartition("-")[0]


T = TypeVar("T")
# How long a waiting submitter keeps retrying a Redis it cannot reach before it gives up: long enough for a
# restart or a cluster failover (a replica takes over within cluster-node-timeout, 15 s by default).
RECONNECT_SECONDS = 30.0
# What a restart or a failover raises while it lasts (BusyLoadingError is a ConnectionError).
TRANSIENT_ERRORS = (
    rex.ConnectionError,
    rex.TimeoutError,
    rex.ClusterDownError,
    rex.TryAgainError,
    rex.ReadOnlyError,
    rex.MasterDownError,
)


def retrying(call: Callable[[], T]) -> T:
    """`call()`, retried while Redis is restarting or failing over, for at most RECONNECT_SECONDS in a row."""
    deadline = time.monotonic() + RECONNECT_SECONDS
    while True:
        try:
            return call()
        except TRANSIENT_ERRORS:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# How often a wait reads every result still missing and looks for lost batches, whatever it was told.
LOOK_SECONDS = 1.0
MIN_BLOCK_SECONDS = 0.01  # (BLPOP's timeout 0 would block for ever)


class Waited(msgspec.Struct):
    results: dict[str, dict]  # job id -> result, for the jobs that finished
    lost: list[str]  # jobs with no result whose batch is gone from Redis: they will never finish


def lost_jobs(client: RedisClient, keys: KeySpace, unfinished: Sequence[str], keep_for: int) -> list[str]:
    """The unfinished jobs whose batch list is gone (Redis restarted empty, or a failover lost the writes); the
    lists that are there are kept `keep_for` seconds more (EXPIRE answers both), so that a wait longer than
    job_ttl does not take its own batch for lost. A batch's list is written after its jobs, so while it exists
    the jobs do too (a replica applies writes in order)."""
    batches = sorted({batch_of(job) for job in unfinished})
    with client.pipeline(transaction=False) as pipe:
        for batch in batches:
            pipe.expire(keys.job_batch(batch), keep_for)
        exists = dict(zip(batches, pipe.execute(), strict=True))
    return [job for job in unfinished if not exists[batch_of(job)]]


def wait_for(
    client: RedisClient,
    keys: KeySpace,
    job_ids: Sequence[str],
    timeout: float | None,
    on_progress: Callable[[int], None],
    job_ttl: int,
) -> Waited:
    """Wait until every job finished or is lost, or `timeout` passed. It blocks on the batches' lists of
    finished jobs (workers.fleet_wakeups) and reads each job's result as its id comes; every LOOK_SECONDS it
    reads every result still missing and looks for lost batches, whatever came (a worker killed between its
    result and its push, or another waiter on the batch, takes a push from this one). A short restart or
    failover is ridden out (`retrying`), a longer one raises redis-py's error. The batches waited on are kept
    job_ttl from each look."""
    deadline = None if timeout is None else time.monotonic() + timeout
    batches = sorted({batch_of(job) for job in job_ids})
    wanted = set(job_ids)
    results: dict[str, dict] = {}
    finished: list[str] = []
    look_at = 0.0
    while True:
        looking = time.monotonic() >= look_at
        # Only the jobs not seen finished are asked for: a result read once is kept, since it expires job_ttl
        # after its job finished, which a long batch's first jobs can reach before its last one finishes.
        asked = [job for job in (job_ids if looking else finished) if job in wanted and job not in results]
        results.update(retrying(lambda asked=asked: results_of(client, keys, asked)) if asked else {})
        on_progress(len(results))
        unfinished = [job for job in job_ids if job not in results]
        lost: list[str] = []
        if looking and unfinished:
            look_at = time.monotonic() + LOOK_SECONDS
            lost = retrying(lambda pending=unfinished: lost_jobs(client, keys, pending, job_ttl))
        if len(lost) == len(unfinished) or (deadline is not None and time.monotonic() > deadline):
            return Waited(results, lost)
        until = look_at if deadline is None else min(look_at, deadline)
        seconds = max(until - time.monotonic(), MIN_BLOCK_SECONDS)
        finished = retrying(lambda seconds=seconds: finished_jobs(client, keys, batches, seconds))


def download_artifacts(client: RedisClient, keys: KeySpace, results: dict[str, dict], out_dir: str) -> list[str]:
    from bridge.artifact import decode_artifact, write_artifact

    written = []
    for job_id, result in sorted(results.items()):
        if result.get("status") != "completed":
            continue
        data = client.get(keys.job_artifact(job_id))
        if data is None:
            continue
        artifact = decode_artifact(data, f"artifact of job {job_id}")
        written.append(str(write_artifact(artifact, out_dir)))
    return written


def live_workers(client: RedisClient, keys: KeySpace, heartbeat_interval: float) -> list[dict[str, Any]]:
    """The workers whose heartbeat is at most 3 intervals old, by name. `toolchain` is None for a worker that
    predates toolchains (its heartbeat has none): it serves no toolchain's stream."""
    now = time.time()
    workers = []
    for name, beat in client.hgetall(keys.worker_heartbeats).items():
        info = _heartbeat(beat)
        if info is not None and now - info["time"] <= 3 * heartbeat_interval:
            workers.append({"name": text(name), "toolchain": None, **info})
    return sorted(workers, key=lambda w: w["name"])


def _heartbeat(beat: bytes | str) -> dict[str, Any] | None:
    """A heartbeat as a worker writes it (a JSON object with a finite `time`), its other fields defaulted, or
    None. One written by hand or corrupt is no live worker; it must not fail every `queue`, and with it
    every `queue --live-check` liveness probe, which would have each worker restarted."""
    try:
        info = json.loads(beat)
    except (TypeError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    when = info.get("time")
    if isinstance(when, bool) or not isinstance(when, int | float) or not math.isfinite(when):
        return None
    return {"host": "", "pid": None, "job": None, "done": 0, **info}


def _group_of(client: RedisClient, stream: str) -> dict:
    # Only reads, so the read-only ACL user can run it: before the first submit there is no stream.
    try:
        groups = client.xinfo_groups(stream)
    except rex.ResponseError as exc:
        if "no such key" not in str(exc).lower():
            raise
        groups = []
    return next((g for g in groups if text(g["name"]) == GROUP), {})


def _waiting(client: RedisClient, stream: str, group: dict) -> int:
    """Messages of `stream` no worker has taken yet. A finished message is acknowledged and deleted, so the
    stream holds the waiting ones and the group's pending (taken) ones; the group's `lag` cannot count them
    once a message was deleted before its delivery (a trace task withdrawn: workers/trace_tasks.py)."""
    if not group:
        return 0
    return max(0, client.xlen(stream) - int(group.get("pending", 0)))


def queue_status(client: RedisClient, keys: KeySpace, heartbeat_interval: float) -> dict[str, Any]:
    """The queue as `nkicache queue --json` prints it. `pending` and `in_flight` are summed over the
    toolchains' streams; `toolchains` breaks them down (with the live workers of each) for every toolchain that
    has jobs waiting or a live worker, and `unserved` maps each toolchain whose jobs no live worker can take
    to its number of waiting jobs (pending or in flight)."""
    workers = live_workers(client, keys, heartbeat_interval)
    known = {text(toolchain) for toolchain in client.hgetall(keys.job_toolchains)}  # HKEYS is not in the ACLs
    known |= {w["toolchain"] for w in workers if w["toolchain"]}
    shards = [keys.job_shard(i) for i in range(job_shards(client, keys))]
    toolchains: dict[str, dict[str, int]] = {}
    for toolchain in sorted(known):
        streams = [shard.stream(toolchain) for shard in shards]
        groups = [_group_of(client, stream) for stream in streams]
        row = {
            "pending": sum(_waiting(client, stream, group) for stream, group in zip(streams, groups, strict=True)),
            "in_flight": sum(int(group.get("pending", 0)) for group in groups),
            "live_workers": sum(1 for w in workers if w["toolchain"] == toolchain),
        }
        # Idle streams of toolchains long gone stay registered; listing them would bury the ones that matter.
        if any(row.values()):
            toolchains[toolchain] = row
    unserved = {tc: row["pending"] + row["in_flight"] for tc, row in toolchains.items() if not row["live_workers"]}
    counts: dict[str, int] = {}
    for shard in shards:
        for name, value in client.hgetall(shard.counts).items():
            counts[text(name)] = counts.get(text(name), 0) + int(stored_number(value))
    return {
        "pending": sum(row["pending"] for row in toolchains.values()),
        "in_flight": sum(row["in_flight"] for row in toolchains.values()),
        "completed": counts.get("completed", 0),
        "failed": counts.get("failed", 0),
        "dead_letter": sum(client.xlen(shard.dead_letters) for shard in shards),
        "workers": workers,
        "toolchains": toolchains,
        "unserved": unserved,
    }


def serves(client: RedisClient, keys: KeySpace, toolchain: str, heartbeat_interval: float) -> bool:
    """Whether a live worker compiles with `toolchain`, i.e. reads that toolchain's stream."""
    return any(w["toolchain"] == toolchain for w in live_workers(client, keys, heartbeat_interval))


# -- the worker -----------------------------------------------------------------------------------
class Worker:
    """Reads jobs with the consumer group until told to stop (SIGTERM/SIGINT finish the current job).

    Jobs compile in a child process (`CompileProcess`), so nothing a job does can end the worker. A background
    thread writes the heartbeat and keeps the current job claimed (its idle time reset) while the job
    compiles; a worker whose heartbeat is more than two intervals old is dead, and its jobs are taken over."""

    def __init__(self, settings: Settings, name: str, out_dir: str | None = None, max_jobs: int | None = None):
        self.settings = settings.replace(worker=name)
        self.name = name
        self.out_dir = out_dir
        self.max_jobs = max_jobs
        self.keys = KeySpace(settings.namespace)
        # This process's compiler: the worker reads only this toolchain's stream and compiles only its jobs.
        self.toolchain = toolchain_id()
        self.shards: list[JobKeys] = [self.keys.job_shard(0)]  # all of them once `run` knows the count
        self._next_shard = 0  # where the next read starts: rotating, so no shard's jobs wait behind another's
        self.client = fleet_client(settings)
        self.compiler = CompileProcess(self.settings, out_dir)
        self._complete = self.client.register_script(COMPLETE_JOB_LUA)
        self._fail = self.client.register_script(FAIL_JOB_LUA)
        self._touch = self.client.register_script(TOUCH_JOB_LUA)
        self._dead_letter_message = self.client.register_script(DEAD_LETTER_MESSAGE_LUA)
        self.stopping = False
        self.current: str | None = None
        self._current_message: tuple[JobKeys, str] | None = None
        self.done = 0
        self.failed = 0  # failed attempts (each retried or dead-lettered)
        self.taken_over = 0  # jobs taken from a worker whose heartbeat stopped
        self.queue_errors = 0  # failed operations on the job queue (the worker waits and retries)
        self.traced_tasks = 0  # other jobs' trace tasks answered (workers/trace_tasks.py)
        self._last_claim = 0.0
        self._last_takeover_look = 0.0
        self._looked = False  # whether a takeover look ran: the first one looks for this name's own old jobs
        self._seen_beats: set[str] = set()
        self._vanished: dict[str, float] = {}  # heartbeats gone since an earlier look -> when first seen gone
        self._beats_stop = threading.Event()

    @property
    def dead_after(self) -> float:
        """Seconds without a heartbeat after which a worker is taken for dead and its jobs taken over."""
        return 2 * self.settings.heartbeat_interval

    def install_signal_handlers(self) -> None:
        def stop(signum: int, frame: object) -> None:
            self.stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def run(self) -> int:
        count = fix_job_shards(self.client, self.keys, self.settings.job_shards)
        self.shards = [self.keys.job_shard(i) for i in range(count)]
        # Idle workers block on different shards (their start rotates from here), so a new job in most shards
        # wakes one at once instead of waiting for a BLOCK to end.
        self._next_shard = zlib.crc32(self.name.encode()) % count
        ensure_group(self.client, self.keys, self.toolchain, count)
        self.compiler.start()
        self._heartbeat()
        beats = threading.Thread(target=self._beat_until_stopped, name="nkicache-heartbeat", daemon=True)
        beats.start()
        logger.info("worker %s: started (toolchain %s, pid %d)", self.name, self.toolchain, os.getpid())
        outage = 0
        try:
            while not self.stopping and (self.max_jobs is None or self.done < self.max_jobs):
                try:
                    message = self._next_message()
                    if message is not None:
                        self._process(*message)
                    outage = 0
                except rex.RedisError as exc:
                    # The queue's Redis is down or refusing: the job (if any) stays pending and will be
                    # delivered again or reclaimed; wait, with a growing pause, and try again.
                    outage += 1
                    self.queue_errors += 1
                    pause = min(5.0, 0.1 * 2**outage)
                    logger.warning("worker %s: the queue failed (%s); retrying in %.1f s", self.name, exc, pause)
                    self._beats_stop.wait(pause)
                    if "NOGROUP" in str(exc):  # a Redis restarted without persistence lost the group
                        with contextlib.suppress(rex.RedisError):
                            ensure_group(self.client, self.keys, self.toolchain, len(self.shards))
        finally:
            self._beats_stop.set()
            beats.join()
            self.compiler.close()
            with contextlib.suppress(rex.RedisError):
                self._leave()
        logger.info(
            "worker %s: stopped after %s (%s)",
            self.name,
            plural(self.done, "job"),
            plural(self.failed, "failed attempt"),
        )
        return self.done

    def _stream(self, shard: JobKeys) -> str:
        return shard.stream(self.toolchain)

    def _next_message(self) -> tuple[JobKeys, str, dict] | None:
        """One job message, taken from one shard: a dead worker's, else one idle for job_claim_idle, else a new
        one. Never more than one at a time, so no job waits behind another on a busy worker."""
        if time.monotonic() - self._last_takeover_look >= self.settings.heartbeat_interval / 2:
            self._last_takeover_look = time.monotonic()
            for shard in self.shards if self._takeover_due() else []:
                message = self._take_over(shard)
                if message is not None:
                    return message
        if time.monotonic() - self._last_claim >= min(self.settings.job_claim_idle / 2, 5.0):
            self._last_claim = time.monotonic()
            for shard in self.shards:
                message = self._claim_idle(shard)
                if message is not None:
                    return message
        return self._read_new()

    def _takeover_due(self) -> bool:
        """Whether the shards' pending jobs are worth a look (one XPENDING each): on the first look (jobs of a
        worker of this name before a restart), or while a worker's heartbeat is recently stale or gone. Only
        recently: a job of a worker silent for longer than job_claim_idle is XAUTOCLAIMed anyway, so an idle
        fleet with an old dead heartbeat left behind does not pay J commands a look."""
        now = time.time()
        beats = {
            text(name): _heartbeat(beat) for name, beat in self.client.hgetall(self.keys.worker_heartbeats).items()
        }
        window = self.dead_after + self.settings.job_claim_idle
        for name in self._seen_beats - beats.keys():
            self._vanished.setdefault(name, now)
        self._seen_beats = set(beats)
        self._vanished = {
            name: gone for name, gone in self._vanished.items() if now - gone <= window and name not in beats
        }
        stale = any(beat is not None and self.dead_after < now - beat["time"] <= window for beat in beats.values())
        first, self._looked = not self._looked, True
        return first or stale or bool(self._vanished)

    def _claim_idle(self, shard: JobKeys) -> tuple[JobKeys, str, dict] | None:
        claimed = self.client.xautoclaim(
            self._stream(shard), GROUP, self.name, int(self.settings.job_claim_idle * 1000), "0-0", count=1
        )
        for message_id, fields in claimed[1] if claimed else []:
            if fields:  # a deleted entry comes back without fields
                logger.warning(
                    "worker %s: reclaimed job message %s, idle for %.0f s",
                    self.name,
                    text(message_id),
                    self.settings.job_claim_idle,
                )
                return shard, text(message_id), fields
        return None

    def _read_new(self) -> tuple[JobKeys, str, dict] | None:
        """A new job: a non-blocking read of each shard, starting at a rotating one; when all were empty, a wait
        for a wake-up token (workers.fleet_wakeups) of at most BLOCK_MS, and a second look. An idle worker costs
        one command per shard and BLOCK_MS, and takes a job as soon as it is queued."""
        message = self._look_for_job()
        if message is None and wait_for_job(self.client, self.keys, self.toolchain, BLOCK_MS / 1000):
            message = self._look_for_job()
        return message

    def _look_for_job(self) -> tuple[JobKeys, str, dict] | None:
        first = self._next_shard
        self._next_shard = (first + 1) % len(self.shards)
        for shard in [self.shards[(first + k) % len(self.shards)] for k in range(len(self.shards))]:
            reply = self.client.xreadgroup(GROUP, self.name, {self._stream(shard): ">"}, count=1)
            for _stream, messages in reply or []:
                for message_id, fields in messages:
                    return shard, text(message_id), fields
        return None

    def _take_over(self, shard: JobKeys) -> tuple[JobKeys, str, dict] | None:
        """A job of `shard` held by a dead worker: one whose heartbeat is more than `dead_after` seconds old (a
        SIGKILLed worker's stays behind, aging) or gone, or this worker's own from before a restart under the
        same name. A live worker resets its job's idle time every heartbeat, so XCLAIM's idle bound also keeps
        a job whose worker beats again from being taken."""
        idle_ms = int(self.dead_after * 1000)
        stream = self._stream(shard)
        entries = self.client.xpending_range(stream, GROUP, min="-", max="+", count=50, idle=idle_ms)
        if not entries:
            return None
        raw_beats = self.client.hgetall(self.keys.worker_heartbeats)
        beats = {text(name): _heartbeat(beat) for name, beat in raw_beats.items()}
        now = time.time()
        for entry in entries:
            owner = text(entry["consumer"])
            beat = beats.get(owner)
            silent = now - beat["time"] if beat is not None else math.inf
            if owner == self.name or silent > self.dead_after:
                for message_id, fields in self.client.xclaim(stream, GROUP, self.name, idle_ms, [entry["message_id"]]):
                    if fields:
                        self.taken_over += 1
                        logger.warning(
                            "worker %s: took over job message %s of worker %s (no heartbeat for %.1f s)",
                            self.name,
                            text(message_id),
                            owner,
                            silent,
                        )
                        return shard, text(message_id), fields
        return None

    def _process(self, shard: JobKeys, message_id: str, fields: dict) -> None:
        """Compile a job and record it in the shard it was read from (a job queued before sharding, in shard 0,
        finishes there): the scripts' keys are all in that shard's slot."""
        trace = fields.get(b"trace", fields.get("trace"))
        if trace is not None:
            self._trace(shard, message_id, trace)
            return
        raw = fields.get(b"job", fields.get("job"))
        job = _job(raw)
        if isinstance(job, str):
            # Not a job: it would kill this worker, then every worker that reclaimed it after it.
            logger.warning("worker %s: message %s is no job (%s); dead-lettered", self.name, message_id, job)
            keys = [self._stream(shard), shard.dead_letters, shard.counts]
            payload = raw if isinstance(raw, bytes | str) else ""
            self._dead_letter_message(keys=keys, args=[message_id, job, payload, self.settings.dead_letter_limit])
            return
        self.current, self._current_message = job["id"], (shard, message_id)
        attempt = job.get("attempt", 1)
        logger.info("worker %s: job %s (%s) taken, attempt %s", self.name, job["id"], job["file"], attempt)
        try:
            self._heartbeat()
            self._compile_and_record(job, shard, message_id)
        finally:
            # Stop keeping the job claimed even when recording it failed (Redis outage): it must become
            # idle, so that it is reclaimed and compiled again instead of held by this worker forever.
            self.current, self._current_message = None, None
        self.done += 1
        self._heartbeat()

    def _trace(self, shard: JobKeys, message_id: str, raw: bytes | str) -> None:
        """Another job's trace task (workers/trace_tasks.py), in the compiling process; acknowledged and deleted
        whatever came of it: a task that failed or died here is traced by its job's own worker."""
        # Kept claimed while it traces, as a job is, and named in the heartbeat.
        self.current, self._current_message = f"trace-{message_id}", (shard, message_id)
        try:
            self._heartbeat()
            result, _ = self.compiler.compile(
                {"id": f"trace-{message_id}", "file": "trace task", "graph": "", "trace": text(raw)}
            )
        finally:
            self.current, self._current_message = None, None
        job_id = result.traced_for  # (the compiling process read the message: what job it names, if any)
        if result.traced_keys and job_id is not None:
            # Told before the acknowledgement, which the job waits for before it reads this (workers/trace_tasks.py).
            traced_for = self.keys.job_traced(job_id)
            with self.client.pipeline(transaction=False) as pipe:
                pipe.sadd(traced_for, *result.traced_keys)
                pipe.expire(traced_for, self.settings.job_ttl)
                pipe.execute()
        with self.client.pipeline(transaction=False) as pipe:
            pipe.xack(self._stream(shard), GROUP, message_id)
            pipe.xdel(self._stream(shard), message_id)
            pipe.execute()
        self.traced_tasks += 1
        logger.info(
            "worker %s: %s: %s",
            self.name,
            result.file,
            result.error or ("traced" if result.counts["parallel_traces"] else "traced elsewhere"),
        )

    def _compile_and_record(self, job: dict, shard: JobKeys, message_id: str) -> None:
        # The streams its trace tasks go on: this toolchain's, read by its workers.
        streams = [self._stream(each) for each in self.shards]
        job = {**{key: value for key, value in job.items() if key != "trace"}, "streams": streams}
        result, artifact = self._compile(job)
        ttl = self.settings.job_ttl
        if result.error is None and artifact is not None:
            record = {
                "status": "completed",
                "worker": self.name,
                "host": self.settings.host,
                "file": job["file"],
                "graph": result.graph,
                **result.as_json(),
            }
            # NX: a reclaimed job finished twice keeps one artifact (both finishers ran this compiler on its graph).
            self.client.set(self.keys.job_artifact(job["id"]), artifact, nx=True, ex=ttl)
            keys = [shard.result(job["id"]), shard.counts, self._stream(shard), shard.failures]
            self._complete(keys=keys, args=[job["id"], json.dumps(record), ttl, message_id])
            tell_finished(self.client, self.keys, batch_of(job["id"]), job["id"], ttl)
            c = result.counts
            logger.info(
                "worker %s: job %s (%s) finished in %.2f s: %s, %s, %s, %s, %s, %s",
                self.name,
                job["id"],
                job["file"],
                result.seconds,
                plural(c["kernels"], "kernel"),
                plural(c["cache_hits"], "hit"),
                plural(c["cache_misses"], "miss"),
                plural(c["remote_hits"], "remote hit"),
                plural(c["traces"], "trace"),
                plural(c["parallel_traces"], "parallel trace"),
            )
        else:
            # A retry goes back onto the stream the job was read from.
            error = result.error or "no artifact"
            keys = [shard.result(job["id"]), shard.counts, shard.failures, self._stream(shard), shard.dead_letters]
            retry = {**job, "attempt": job.get("attempt", 1) + 1}
            attempts = self._fail(
                keys=keys,
                args=[
                    job["id"],
                    message_id,
                    error,
                    self.settings.job_max_attempts,
                    json.dumps(retry),
                    self.name,
                    ttl,
                    job["file"],
                    self.settings.dead_letter_limit,
                ],
            )
            self.failed += 1
            finished = attempts >= self.settings.job_max_attempts
            if finished:
                tell_finished(self.client, self.keys, batch_of(job["id"]), job["id"], ttl)
            elif attempts:  # (0: another worker finished it first)
                wake_workers(self.client, self.keys, self.toolchain, 1, ttl)
            verdict = "dead-lettered" if finished else "to be retried"
            logger.warning(
                "worker %s: job %s failed (attempt %s of %d, %s) after %.2f s: %s",
                self.name,
                job["id"],
                attempts,
                self.settings.job_max_attempts,
                verdict,
                result.seconds,
                error,
            )

    def _compile(self, job: dict) -> tuple[PassResult, bytes | None]:
        mismatch = self._toolchain_problem(job)
        if mismatch is not None:
            # Never compiled: this compiler's binary need not be the one the submitter's compiler produces.
            return PassResult(job["file"], error=mismatch), None
        if len(job["graph"].encode("utf-8", "surrogatepass")) > self.settings.max_graph_bytes:
            return PassResult(
                job["file"],
                error=(
                    f"{job['file']}: graph of more than {self.settings.max_graph_bytes} "
                    "bytes, the limit max_graph_bytes"
                ),
            ), None
        # In the child: parsed there as a JSON object (never anything compile_graph would take for a path on
        # this machine), bounded in depth, size and work, and limited in time and memory.
        started = time.perf_counter()
        result, artifact = self.compiler.compile(job)
        result.seconds = result.seconds or time.perf_counter() - started
        return result, artifact

    def _toolchain_problem(self, job: dict) -> str | None:
        """Why this worker must not compile `job`, or None. `submit` puts every job on its own toolchain's
        stream, so only a job written there by hand can name another toolchain, or none."""
        submitted = job.get("toolchain")
        if submitted == self.toolchain:
            return None
        under = f"under toolchain {submitted}" if submitted else "without a toolchain"
        return (
            f"{job['file']}: job submitted {under}, but worker {self.name} compiles with toolchain "
            f"{self.toolchain}; not compiled (only a worker of the submitter's toolchain may compile it)"
        )

    def _beat_until_stopped(self) -> None:
        # Often enough that the current job never looks idle for job_claim_idle to the other workers.
        interval = min(self.settings.heartbeat_interval, self.settings.job_claim_idle / 3)
        while not self._beats_stop.wait(interval):
            try:
                self._heartbeat()
                current = self._current_message
                if current is not None:
                    self._touch(keys=[self._stream(current[0])], args=[self.name, current[1]])
            except rex.RedisError as exc:  # the main loop meets the same outage and decides; keep beating
                logger.warning("worker %s: heartbeat failed: %s", self.name, exc)
            except Exception:  # a beat lost to a bug must not end the beating: other workers would take our job
                logger.exception("worker %s: heartbeat failed", self.name)

    def _heartbeat(self) -> None:
        beat = {
            "time": time.time(),
            "host": self.settings.host,
            "pid": os.getpid(),
            "job": self.current,
            "done": self.done,
            "toolchain": self.toolchain,
            "compiler_pid": self.compiler.pid,
        }
        self.client.hset(self.keys.worker_heartbeats, self.name, json.dumps(beat))

    def _leave(self) -> None:
        self.client.hdel(self.keys.worker_heartbeats, self.name)


def _job(raw: object) -> dict | str:
    """A stream message's job (a JSON object naming its id, file and graph text, as `submit` writes it), or
    what is wrong with it."""
    if raw is None:
        return "the message has no job field"
    try:
        job = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        return "the message's job field is not JSON"
    if not isinstance(job, dict):
        return f"the job is a JSON {type(job).__name__}, not an object"
    for name in ("id", "file", "graph"):
        if not isinstance(job.get(name), str):
            return f"the job's {name!r} is not a string"
    job["file"] = shown_path(job["file"])  # logged and put in errors: a newline in it must not forge a log line
    return job


def dead_letters(client: RedisClient, keys: KeySpace) -> Iterator[dict]:
    """Every shard's dead letters, shard by shard (each shard's in the order they were dead-lettered)."""
    for shard in range(job_shards(client, keys)):
        for message_id, fields in client.xrange(keys.job_shard(shard).dead_letters):
            yield {"id": text(message_id), **{text(k): text(v) for k, v in fields.items() if text(k) != "payload"}}
