"""`nkicache compile --workers N`: the compile's kernel variants traced by N processes, its passes run in order.

This process keys the graphs (bridge.parallel.key_variants), then forks N - 1 helper processes, which inherit
the trace tasks. Every process takes the next task in the pass order from a counter in shared memory
(`Claims`) whenever it is free, and a helper sends back what it traced over its own pipe. Nothing is handed
over through threads or queues: this process runs no thread of its own, and a helper never waits for it to
be handed its next task. As soon as all the tasks a pass needs are answered, this process runs that pass, in
input order, with the specification's loop, handed the variants traced for it.

With a tier that reads, this process asks it for the variants after the fork (a forked process must not
inherit a tier client in use) and tells the helpers which tasks are left. Helpers are forked when this
process runs no other thread (they start in milliseconds, the compiler already imported), otherwise they
start from the forkserver (`workers.pool_process.pool_context`). A helper that dies leaves the tasks it took to this
process, which traces them; the others keep taking tasks, and each pass completes as without helpers.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Any

from bridge.parallel import TraceOutcome, TraceTask, VariantPlan, key_variants, trace_task
from bridge.port import TracedVariant
from cachestore.settings import Settings
from cachestore.stores import open_tier
from workers.compile_run import CTRL_C_POLL_SECONDS, CompileRun, CtrlC
from workers.passes import PassResult, compile_graph
from workers.pool_process import init_process, pool_context, trace_in_process

# A process killed while it holds the counter's lock (a window of microseconds) would hold it for ever: the
# others give up on it after this long and trace what is left here.
CLAIM_LOCK_SECONDS = 5.0
STOPPED = 1 << 62  # the counter once the compile stops: no task is taken any more


def pool_start_context() -> multiprocessing.context.BaseContext:
    """fork when this process runs no other thread (a helper starts in milliseconds, the compiler already
    imported), else the forkserver context."""
    if "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return pool_context()


class ClaimsBroken(Exception):
    """The counter's lock was not free within CLAIM_LOCK_SECONDS (its holder died holding it)."""


class Claims:
    """The next task to take, in shared memory, and which process took each (so a dead helper's are known)."""

    def __init__(self, context: multiprocessing.context.BaseContext, tasks: int):
        self.next = context.Value("q", 0)
        self.taken_by = context.Array("i", max(tasks, 1), lock=False)

    def take(self, who: int, count: int) -> int | None:
        """The position (in the list of tasks left to trace) this process takes next, None when all are taken."""
        lock = self.next.get_lock()
        if not lock.acquire(timeout=CLAIM_LOCK_SECONDS):
            raise ClaimsBroken
        try:
            counter = self.next.get_obj()  # under the lock already
            position = counter.value
            if position >= count:
                return None
            counter.value = position + 1
            self.taken_by[position] = who
            return position
        finally:
            lock.release()

    def taken(self) -> int:
        """How many tasks were taken, read without the lock (a dead helper may hold it for ever)."""
        return self.next.get_obj().value

    def stop(self) -> None:
        lock = self.next.get_lock()
        if lock.acquire(timeout=CLAIM_LOCK_SECONDS):
            self.next.get_obj().value = STOPPED
            lock.release()


def _helper(
    who: int,
    tasks: list[TraceTask],
    claims: Claims,
    connection: Connection,
    others: list[Connection],
    settings: Settings,
    dropped_outside_passes: Any,
) -> None:
    """A helper process: take tasks until none is left, sending back each outcome (the list of tasks left to
    trace comes first, once this compile's parent has asked the tier)."""
    for other in others:  # the other pipes' ends: a pipe whose process dies must read as closed
        other.close()
    init_process(settings, dropped_outside_passes)
    try:
        left = connection.recv()
        while (position := claims.take(who, len(left))) is not None:
            connection.send(trace_in_process([tasks[left[position]]])[0])
    except (EOFError, OSError, ClaimsBroken):  # the parent is gone or stopped the compile
        pass
    finally:
        connection.close()


class Helpers:
    """The N - 1 helper processes, each with a pipe this process reads their outcomes from."""

    def __init__(
        self,
        context: multiprocessing.context.BaseContext,
        tasks: list[TraceTask],
        claims: Claims,
        count: int,
        settings: Settings,
        dropped_outside_passes: Any,
    ):
        pipes = [context.Pipe() for _ in range(count)]
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self.pipes: dict[int, Connection] = {}
        for who, (parent_end, child_end) in enumerate(pipes, start=1):
            others = [end for pipe in pipes if pipe[1] is not child_end for end in pipe] + [parent_end]
            args = (who, tasks, claims, child_end, others, settings, dropped_outside_passes)
            process = context.Process(target=_helper, name=f"nkicache-tracer-{who}", args=args, daemon=True)
            try:
                process.start()
            except OSError:  # no process to be had: this one traces more
                parent_end.close()
                continue
            finally:
                child_end.close()
            self.processes[who], self.pipes[who] = process, parent_end

    def hand_out(self, left: list[int]) -> None:
        """Tell the helpers which tasks are left to trace (one that cannot be told is dead: `receive` sees it)."""
        for pipe in self.pipes.values():
            with contextlib.suppress(OSError):
                pipe.send(left)

    def receive(self, timeout: float) -> tuple[list[TraceOutcome], list[int]]:
        """Outcomes the helpers sent (waiting up to `timeout` for one), and the helpers that died."""
        outcomes, dead = [], []
        sentinels = {process.sentinel: who for who, process in self.processes.items()}
        for ready in wait([*self.pipes.values(), *sentinels], timeout):
            who = sentinels.get(ready) if isinstance(ready, int) else None
            for key, pipe in self.pipes.items():
                if (pipe is ready or key == who) and self._drain(pipe, outcomes) and key not in dead:
                    dead.append(key)
        for who in dead:
            self.pipes.pop(who).close()
            self.processes.pop(who).join()
        return outcomes, dead

    @staticmethod
    def _drain(pipe: Connection, outcomes: list[TraceOutcome]) -> bool:
        """Read what the pipe holds; True when its helper is gone (the pipe closed)."""
        try:
            while pipe.poll():
                outcomes.append(pipe.recv())
        except (EOFError, OSError):
            return True
        return False

    def close(self) -> None:
        for pipe in self.pipes.values():
            pipe.close()
        for process in self.processes.values():
            process.join()


def compile_in_parallel(
    paths: Sequence[str],
    *,
    settings: Settings,
    workers: int,
    out_dir: str,
    target_name: str | None,
    on_result: Callable[[PassResult], None],
) -> CompileRun:
    """Compile `paths` with this process and `workers - 1` helper processes tracing; results in input order."""
    context = pool_start_context()  # before anything here could start a thread
    dropped_outside_passes = context.Value("q", 0)
    limits = settings.limits()
    tier = open_tier(settings)  # connects on first use only: nothing of it is in use when the helpers fork
    results: list[PassResult] = []
    with CtrlC() as ctrl_c:
        plan = key_variants(paths, shared=False, target_name=target_name, limits=limits)  # every graph's variants
        claims = Claims(context, len(plan.tasks))
        # Out of the collector's reach before the fork: its full collections would otherwise walk (and write) every
        # object of this process in both, copying their pages (about 5% more trace CPU in two processes, measured).
        gc.freeze()
        helpers = Helpers(context, plan.tasks, claims, workers - 1, settings, dropped_outside_passes)
        try:
            scheduler = Scheduler(plan, ahead_of(plan, tier), claims, helpers, tier, limits)
            results = scheduler.run(paths, out_dir, target_name, on_result, ctrl_c)
        finally:
            gc.unfreeze()
            claims.stop()
            helpers.close()
            if tier is not None:
                tier.close()
    run = CompileRun(results, ctrl_c.pressed)
    if tier is not None:
        counts = tier.counts()
        passes_dropped = sum(int(r.counts.get("tier_dropped", 0)) for r in results)
        run.tier_dropped_outside_passes = counts["tier_dropped"] - passes_dropped
        for name in ("tier_errors", "tier_timeouts"):
            run.tier_faults_outside_passes[name] = counts[name] - sum(int(r.counts.get(name, 0)) for r in results)
    run.tier_dropped_outside_passes += dropped_outside_passes.value
    return run


def ahead_of(plan: VariantPlan, tier: Any) -> list[int]:
    """The tasks worth tracing ahead, in the pass order: not a variant the tier's index says it stored (its pass
    reads it), and, when the tier stores what a pass publishes and reads it back, one per variant of the whole
    compile (a later pass reads the earlier one's). A guess only: a pass counts what it would alone whatever is
    traced ahead, tracing itself what is missing and leaving what it does not need (one index read)."""
    if tier is None or not tier.reads:
        return [task.task_id for task in plan.tasks]
    facts = tier.variant_facts({task.cache_key: task.key_components for task in plan.tasks})
    shared = facts is not None and tier.writes  # an index that cannot be read: a tier down
    seen: set[str] = set()
    left = []
    for task in plan.tasks:
        held = facts is not None and task.cache_key in facts and facts[task.cache_key].stored_here_before
        if held or (shared and task.cache_key in seen):
            continue
        seen.add(task.cache_key)
        left.append(task.task_id)
    return left


class Scheduler:
    """Runs each pass once every task it needs is answered, and takes the next task to trace in between."""

    def __init__(self, plan: VariantPlan, left: list[int], claims: Claims, helpers: Helpers, tier: Any, limits: Any):
        self.plan, self.claims, self.helpers, self.tier, self.limits = plan, claims, helpers, tier, limits
        self.left = left  # the tasks to trace, in the pass order; helpers index it by position
        self.needs = {graph: set(tasks) & set(left) for graph, tasks in plan.needs.items()}
        self.by_id = {task.task_id: task for task in plan.tasks}
        self.outcomes: dict[int, TraceOutcome] = {}
        # Traces a pass did not take (its graph failed first, or the tier answered): a later pass of the same
        # variant takes them instead of tracing.
        self.spare: dict[str, TracedVariant] = {}
        self.orphans: deque[int] = deque()  # tasks a dead helper took: traced here
        self.broken = False  # the counter's lock is lost: every task not answered is traced here
        helpers.hand_out(self.left)

    def run(
        self,
        paths: Sequence[str],
        out_dir: str,
        target_name: str | None,
        on_result: Callable[[PassResult], None],
        ctrl_c: CtrlC,
    ) -> list[PassResult]:
        results: list[PassResult] = []
        while len(results) < len(paths) and not ctrl_c.pressed:
            self._receive(0)
            index = len(results)
            if self.needs[index] <= self.outcomes.keys():
                results.append(self._run_pass(paths[index], index, out_dir, target_name))
                on_result(results[-1])
            elif (task := self._next_task()) is not None:
                self.outcomes[task.task_id] = trace_task(task, None, self.limits)  # published by its pass
            else:
                self._receive(CTRL_C_POLL_SECONDS)  # the helpers trace the rest
        return results

    def _receive(self, timeout: float) -> None:
        if not self.helpers.pipes:
            return
        outcomes, dead = self.helpers.receive(timeout)
        for outcome in outcomes:
            if outcome.traced is not None:
                outcome = replace(outcome, traced=replace(outcome.traced, elsewhere=True))  # a helper traced it
            self.outcomes.setdefault(outcome.task_id, outcome)
        for who in dead:
            self._helper_died(who)

    def _helper_died(self, who: int) -> None:
        """The tasks a dead helper took and did not answer are traced here."""
        taken = min(self.claims.taken(), len(self.left))
        lost = [self.left[p] for p in range(taken) if self.claims.taken_by[p] == who]
        self.orphans.extend(task_id for task_id in lost if task_id not in self.outcomes)

    def _next_task(self) -> TraceTask | None:
        while self.orphans:
            task_id = self.orphans.popleft()
            if task_id not in self.outcomes:
                return self.by_id[task_id]
        if not self.broken:
            try:
                position = self.claims.take(0, len(self.left))
                return None if position is None else self.by_id[self.left[position]]
            except ClaimsBroken:
                self.broken = True
        pending = [task_id for task_id in self.left if task_id not in self.outcomes]
        return self.by_id[pending[-1]] if pending else None  # from the end: a helper may be tracing the next one

    def _run_pass(self, path: str, index: int, out_dir: str, target_name: str | None) -> PassResult:
        ahead: dict[str, TracedVariant] = {}
        for task_id in self.plan.owned[index]:
            key, outcome = self.by_id[task_id].cache_key, self.outcomes.pop(task_id, None)
            if outcome is not None and outcome.traced is not None:
                ahead[key] = outcome.traced
            elif key in self.spare:
                ahead[key] = self.spare.pop(key)
            if outcome is not None:  # answered, the binary handed to its one pass and not kept
                self.outcomes[task_id] = TraceOutcome(task_id, key)
        result, _ = compile_graph(
            path, tier=self.tier, target_name=target_name, out_dir=out_dir, limits=self.limits, traced_ahead=ahead
        )
        self.spare.update(ahead)  # what the pass did not take
        return result
