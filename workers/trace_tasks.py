"""Fleet trace tasks: one job's untraced kernel variants, traced by the other fleet workers too.

The worker compiling a job (in its compiling process, workers/job_process.py) plans the job's variants
(bridge.parallel.plan_variants: the ones the tier does not hold), puts one trace task per variant on the
job's stream, and traces the same list itself from the other end. Another worker that reads a task traces it
through the tier with the single-flight lease (`trace_task` with `wait=False`: a variant someone already
traces is left to them), publishes it, and acknowledges the task. So every variant is traced once fleet-wide,
whichever process gets to it first.

When the job's process reaches a variant another worker holds the lease on, it waits for that trace through the
tier; a worker killed holding a task stops renewing its lease, which lapses within `lease_ttl`, and the job's
process traces the variant itself (the task, still pending, is taken over by another worker like a job and
finds the variant traced). Then the job's pass runs, the specification's loop, handed every variant traced
for it (counted in `parallel_traces`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bridge.errors import NkiCacheError
from bridge.graph import GraphError
from bridge.limits import Limits
from bridge.parallel import (
    TraceOutcome,
    TraceTask,
    plan_variants,
    task_document,
    task_from_document,
    trace_task,
    with_causes,
)
from bridge.port import KernelStore, TracedVariant
from workers.passes import PassResult, compile_graph

if TYPE_CHECKING:
    from cachestore.backends.redis import RedisClient

logger = logging.getLogger(__name__)

GROUP = "nkicache-workers"  # workers.fleet.GROUP (not imported: the compiling process need not load the fleet)
TRACE_FIELD = "trace"  # the stream message field of a trace task (a job's is "job")
MIN_TASKS = 2  # fewer untraced variants than this: nothing to share, the pass traces alone
BUSY_POLL_SECONDS = 0.005
# Each message a worker takes costs it a read, a heartbeat, a round trip to its compiling process and an
# acknowledgement (about 2.5 ms, a sixth of a small trace): a message carries a few consecutive variants. Those
# a worker has not started yet when the job's own process reaches them are traced there, as any variant
# nobody holds the lease on, so a larger message costs no tail.
TASKS_PER_MESSAGE = 3
MIN_MESSAGES = 8  # a job with few variants still gives every idle worker a message
MAX_TASKS_PER_MESSAGE = 64  # a message holding more is no trace task (it bounds a forged message's work)
BUSY_POLL_LIMIT = 30.0  # seconds of polling a variant traced elsewhere before the tier client's own wait
# How long a job waits, once its variants are all traced, for the workers still answering its messages: they
# record what they traced just after their last trace is stored, so only a worker that died waits this long.
ANSWER_WAIT_SECONDS = 1.0
MAX_JOB_ID_CHARS = 128  # a job id a trace task may name: the key of the job's traced set is made of it


def enqueue_tasks(
    client: RedisClient,
    streams: Sequence[str],
    job_id: str,
    tasks: Sequence[TraceTask],
    traced_for: str,
    wake: Callable[[int], None] = lambda messages: None,
) -> Callable[[], set[str]]:
    """The trace tasks as messages of a few consecutive variants each (`message_size`), dealt over the
    toolchain's job streams (one per shard) in the pass's order, in one round trip, then `wake(messages)`: a
    wake-up per message for the idle workers (workers.fleet_wakeups). Returns how to withdraw them once the
    job's variants are all traced: all are deleted, so no worker takes one any more (each would only find its
    variants traced); the ones a worker took before are waited for (at most ANSWER_WAIT_SECONDS); then all are
    acknowledged, so no worker takes over one a dead worker held. It returns the cache keys other workers
    traced from them (the set `traced_for`, KeySpace.job_traced)."""
    size = message_size(len(tasks))
    groups = [tasks[start : start + size] for start in range(0, len(tasks), size)]
    dealt = [streams[index % len(streams)] for index in range(len(groups))]
    with client.pipeline(transaction=False) as pipe:
        for stream, group in zip(dealt, groups, strict=True):
            pipe.xadd(stream, {TRACE_FIELD: json.dumps({"job": job_id, "tasks": [task_document(t) for t in group]})})
        message_ids = pipe.execute()
    wake(len(message_ids))

    messages = list(zip(dealt, message_ids, strict=True))

    def withdraw() -> set[str]:
        with client.pipeline(transaction=False) as pipe:
            for stream, message_id in messages:
                pipe.xdel(stream, message_id)
            pipe.execute()
        _wait_for_answers(client, messages)
        with client.pipeline(transaction=False) as pipe:
            for stream, message_id in messages:
                pipe.xack(stream, GROUP, message_id)
            pipe.execute()
        with client.pipeline(transaction=False) as pipe:
            pipe.smembers(traced_for)
            pipe.delete(traced_for)
            traced = pipe.execute()[0]
        return {key.decode() if isinstance(key, bytes) else key for key in traced}

    return withdraw


def _wait_for_answers(client: RedisClient, messages: Sequence[tuple[str, Any]]) -> None:
    """Until no worker holds one of `messages` unanswered (a worker records what it traced before it
    acknowledges the message), or ANSWER_WAIT_SECONDS: a worker that died holding one answers never."""
    deadline = time.monotonic() + ANSWER_WAIT_SECONDS
    while True:
        with client.pipeline(transaction=False) as pipe:
            for stream, message_id in messages:
                pipe.xpending_range(stream, GROUP, min=message_id, max=message_id, count=1)
            held = [pending for pending in pipe.execute() if pending]
        if not held or time.monotonic() >= deadline:
            return
        time.sleep(BUSY_POLL_SECONDS)


def compile_job(
    graph: Mapping,
    job: Mapping,
    *,
    tier: KernelStore | None,
    limits: Limits,
    out_dir: str | None,
    enqueue: Callable[[Sequence[TraceTask]], Callable[[], None]] | None,
) -> tuple[PassResult, bytes | None]:
    """A fleet job's pass, its untraced variants shared with the fleet through `enqueue` (None: traced alone).
    The result's seconds are the job's: its share of the tracing and the pass."""
    started = time.perf_counter()
    handed: dict[str, TracedVariant] = {}
    shared = enqueue is not None and tier is not None and tier.reads and tier.single_flight
    if shared:
        plan = plan_variants([graph], tier=tier, target_name=None, limits=limits, labels=[job["file"]])
        if len(plan.tasks) >= MIN_TASKS:
            withdraw = _queued(enqueue, plan.tasks, job["id"])
            traced = trace_alongside(plan.tasks, tier, limits)
            traced_for_job = _withdrawn(withdraw, job["id"])
            if traced_for_job is not None:
                # Found in the tier (`elsewhere`) but traced by no worker for this job: another job's trace,
                # which this pass reads from the tier as a remote hit instead of counting it as its own.
                traced = {key: v for key, v in traced.items() if not v.elsewhere or key in traced_for_job}
            handed = with_causes(traced, plan)
    result, artifact = compile_graph(
        graph,
        tier=tier,
        label=job["file"],
        out_dir=out_dir,
        pass_id=f"job-{job['id']}",
        limits=limits,
        traced_elsewhere=handed,
    )
    result.seconds = time.perf_counter() - started
    return result, artifact


def _queued(enqueue: Callable, tasks: Sequence[TraceTask], job_id: str) -> Callable[[], None] | None:
    try:
        return enqueue(tasks)
    except Exception as exc:  # the queue's Redis refused: every variant is traced here, as without a fleet
        logger.warning("job %s: trace tasks not queued (%s); traced here", job_id, exc)
        return None


def _withdrawn(withdraw: Callable[[], set[str]] | None, job_id: str) -> set[str] | None:
    """The cache keys other workers traced for the job, or None when that is not known (no tasks were queued,
    or the queue's Redis failed: then every variant found is counted as traced for the job)."""
    if withdraw is None:
        return None
    try:
        return withdraw()
    except Exception as exc:  # left on the stream, they are answered as traced elsewhere: only time lost
        logger.warning("job %s: trace tasks not withdrawn (%s)", job_id, exc)
        return None


def trace_alongside(tasks: Sequence[TraceTask], tier: KernelStore, limits: Limits) -> dict[str, TracedVariant]:
    """Trace the tasks from the last one back (other workers take them from the first), skipping the ones
    another process holds the lease on; then wait for those, tracing any whose holder died without a trace.
    Returns every variant, traced here or found in the tier."""
    handed: dict[str, TracedVariant] = {}
    busy = []
    for task in reversed(tasks):
        outcome = trace_task(task, tier, limits, wait=False)  # the pass is handed it directly
        if outcome.busy:
            busy.append(task)
        _take(handed, outcome)
    # Poll the leases held elsewhere every few milliseconds (the tier client's own wait polls at 50 ms, which
    # the job would spend idle): a lease free again is the holder done (its trace is found under the lease)
    # or dead (the lease lapsed: traced here).
    deadline = time.monotonic() + BUSY_POLL_LIMIT
    while busy and time.monotonic() < deadline:
        time.sleep(BUSY_POLL_SECONDS)
        still = []
        for task in busy:
            outcome = trace_task(task, tier, limits, wait=False)
            if outcome.busy:
                still.append(task)
            _take(handed, outcome)
        busy = still
    for task in busy:  # held for longer than the poll: the tier client's bounded wait (lease_wait)
        outcome = trace_task(task, tier, limits, wait=True)
        if outcome.traced is None and outcome.found is None and outcome.error is None:
            outcome = trace_task(task, tier, limits, wait=True)  # its holder died: the lease lapsed
        _take(handed, outcome)
    return handed


def _take(handed: dict[str, TracedVariant], outcome: TraceOutcome) -> None:
    variant = outcome.traced or outcome.found
    if variant is not None:
        handed[outcome.cache_key] = variant


def message_size(tasks: int) -> int:
    """Variants per trace task message for a job with `tasks` of them."""
    return max(1, min(TASKS_PER_MESSAGE, tasks // MIN_MESSAGES))


def run_task(raw: str, tier: KernelStore | None, limits: Limits) -> PassResult:
    """A trace task message read from the stream: each of its variants traced here unless the tier holds it or
    another process traces it. The result names what happened (`error` when the message is no trace task, or
    the first trace that failed: the job's own process then traces that variant); it records no pass."""
    result = PassResult("trace task")
    try:
        document = json.loads(raw)
        tasks = [task_from_document(each) for each in _task_documents(document)]
    except (ValueError, TypeError, RecursionError, NkiCacheError) as exc:
        result.error = f"trace task: not a trace task: {' '.join(str(exc).split())}"
        return result
    job = document.get("job") if isinstance(document, Mapping) else None
    result.traced_for = job if isinstance(job, str) and 0 < len(job) <= MAX_JOB_ID_CHARS else None
    result.file = f"trace task {tasks[0].cache_key[:16]}... (+{len(tasks) - 1}) of job {job}"
    for task in tasks:
        # The job's process waits for each trace on its lease: sent at once, while this process traces the next
        # one, rather than gathered for up to flush_interval (or waited for here). The answer waits for them all
        # (workers.job_process.answer_job).
        outcome = trace_task(task, tier, limits, wait=False)
        if tier is not None:
            tier.send_now()
        result.error = result.error or outcome.error
        if outcome.traced is not None:
            result.counts["parallel_traces"] += 1
            result.traced_keys.append(task.cache_key)
    return result


def _task_documents(document: object) -> list[object]:
    """The task documents of a trace task message: its list `tasks`, or the message itself (one task, as a job's
    process before TASKS_PER_MESSAGE wrote it)."""
    if not isinstance(document, Mapping) or "tasks" not in document:
        return [document]
    tasks = document["tasks"]
    if not isinstance(tasks, list) or not 1 <= len(tasks) <= MAX_TASKS_PER_MESSAGE:
        raise GraphError(f"trace task: its tasks must be a list of 1 to {MAX_TASKS_PER_MESSAGE} task objects")
    return tasks
