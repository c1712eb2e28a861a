"""How the fleet's waiting is woken rather than timed: an idle worker blocks until a job is queued, and a
submitter blocks until one of its jobs finishes.

Both are lists in shard 0's slot (cachestore.keys), so a blocking pop works on a cluster too, where the job
streams of the shards live in other slots and cannot be read by one blocking command. Whoever queues a job
(a submit, a retry, a requeue, a job's trace tasks) pushes a wake-up token onto its toolchain's list, capped
at WAKE_TOKENS; a worker that found no job in any shard pops one (BLPOP) and looks again. A worker that
records a job as finished (completed or dead-lettered) pushes its id onto its batch's list, which `submit
--wait` pops. The pushes are separate commands after the job's own (another slot): a worker killed between
the two loses a wake-up, never a job, and each wait still looks on its own at least every block it makes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import redis.exceptions as rex

from cachestore.keys import KeySpace

if TYPE_CHECKING:
    from cachestore.backends.redis import RedisClient

# A toolchain's list keeps at most this many tokens: enough to wake every idle worker of a large fleet at once;
# tokens nobody popped (every worker was busy) cost an idle worker one empty look each.
WAKE_TOKENS = 64


def wake_workers(client: RedisClient, keys: KeySpace, toolchain: str, jobs: int, ttl: int) -> None:
    """One token per job queued (at most WAKE_TOKENS), for the toolchain's idle workers."""
    if jobs <= 0:
        return
    wake = keys.job_wake(toolchain)
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(wake, *[b"1"] * min(jobs, WAKE_TOKENS))
        pipe.ltrim(wake, -WAKE_TOKENS, -1)
        pipe.expire(wake, ttl)
        pipe.execute()


def wait_for_job(client: RedisClient, keys: KeySpace, toolchain: str, seconds: float) -> bool:
    """Block until a token comes (True) or `seconds` pass (False). Under a key that is no list (another tool's,
    or a hand's), the block is waited out as a timed one."""
    try:
        return client.blpop([keys.job_wake(toolchain)], timeout=seconds) is not None
    except rex.ResponseError:  # WRONGTYPE
        time.sleep(seconds)
        return False


def tell_finished(client: RedisClient, keys: KeySpace, batch_id: str, job_id: str, ttl: int) -> None:
    """A job of `batch_id` finished: its id for the batch's waiters."""
    done = keys.job_batch_done(batch_id)
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(done, job_id)
        pipe.expire(done, ttl)
        pipe.execute()


def finished_jobs(client: RedisClient, keys: KeySpace, batch_ids: Sequence[str], seconds: float) -> list[str]:
    """The ids of the batches' jobs that finished since the last call, blocking up to `seconds` for the first."""
    lists = [keys.job_batch_done(batch) for batch in batch_ids]
    try:
        popped = client.blpop(lists, timeout=seconds)
    except rex.ResponseError:  # one of them is no list: the wait's own looks find its results
        time.sleep(seconds)
        return []
    if popped is None:
        return []
    with client.pipeline(transaction=False) as pipe:
        for done in lists:
            pipe.lpop(done, 10_000)
        more = pipe.execute(raise_on_error=False)
    ids = [popped[1], *(job for batch in more if isinstance(batch, list) for job in batch)]
    return [job.decode() if isinstance(job, bytes) else job for job in ids]
