"""`nkicache compile --workers N`: the compile's kernel variants traced by N processes, its passes run in order.

This process and N - 1 pool processes share the trace tasks (bridge.parallel): the pool processes are fed a
few tasks ahead, and this process takes the next one itself whenever it has nothing else to do, so the pool's
start-up costs no time at the front (this process traces while the others start) and a single graph gets
every worker. As soon as all the tasks a pass needs are answered, this process runs that pass, in input
order, with the specification's loop, handed the variants traced for it.

The pool is forked from this process when nothing else runs in it (no thread yet: nothing a fork could copy
half-held), so pool processes start with the compiler already imported; otherwise it is the forkserver one
(`workers.pool.pool_context`). A pool process that dies breaks the pool: its tasks, and the ones not taken
yet, are traced here, and each pass completes as without a pool.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from bridge.parallel import TraceOutcome, TraceTask, VariantPlan, plan_variants, trace_task, with_causes
from cachestore.client import open_tier
from cachestore.settings import Settings
from workers.passes import PassResult, compile_graph
from workers.pool import CTRL_C_POLL_SECONDS, CompileRun, CtrlC, _init_process, _trace_in_process, pool_context

TASKS_AHEAD = 2  # chunks queued per pool process, so one never waits for this process to hand it the next
# While this thread traces, the feeder and the executor's threads wait for the GIL to hand a pool process its
# next task: at the default 5 ms a hand-over (three threads) takes about as long as a small trace (~15 ms), and
# the pool process idles. 0.5 ms cut its idle time from about 25% to about 12% on the default workload.
SWITCH_INTERVAL = 0.0005
CHUNK = 3  # tasks per hand-over to a pool process: a third of the hand-overs, for a tail of at most 3 small traces


def pool_start_context() -> multiprocessing.context.BaseContext:
    """fork when this process runs no other thread (a pool process starts in milliseconds, the compiler already
    imported), else the forkserver context."""
    if "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return pool_context()


def compile_in_parallel(
    paths: Sequence[str],
    *,
    settings: Settings,
    workers: int,
    out_dir: str,
    target_name: str | None,
    on_result: Callable[[PassResult], None],
) -> CompileRun:
    """Compile `paths` with this process and `workers - 1` pool processes tracing; results in input order."""
    context = pool_start_context()
    dropped_outside_passes = context.Value("q", 0)
    tier, results = None, []
    with CtrlC() as ctrl_c:
        executor = ProcessPoolExecutor(workers - 1, mp_context=context, initializer=_init_process,
                                       initargs=(settings, dropped_outside_passes))  # fmt: skip
        try:
            executor.submit(int)  # start the pool processes now: they start while this one plans
            tier = open_tier(settings)  # after the fork: its threads are this process's alone
            try:
                plan = plan_variants(paths, tier=tier, target_name=target_name, limits=settings.limits())
                scheduler = Scheduler(plan, executor, workers - 1, tier, settings)
                results = scheduler.run(paths, out_dir, target_name, on_result, ctrl_c)
            finally:
                if tier is not None:
                    tier.close()
        finally:
            executor.shutdown(wait=True, cancel_futures=True)
    run = CompileRun(results, ctrl_c.pressed)
    if tier is not None:
        counts = tier.counts()
        passes_dropped = sum(int(r.counts.get("tier_dropped", 0)) for r in results)
        run.tier_dropped_outside_passes = counts["tier_dropped"] - passes_dropped
        for name in ("tier_errors", "tier_timeouts"):
            run.tier_faults_outside_passes[name] = counts[name] - sum(int(r.counts.get(name, 0)) for r in results)
    run.tier_dropped_outside_passes += dropped_outside_passes.value
    return run


class Scheduler:
    """Runs each pass once every task it needs is answered, and traces here in between; a feeder thread keeps
    the pool processes a few chunks of tasks ahead, so they never wait for this thread to finish a trace."""

    def __init__(self, plan: VariantPlan, executor: ProcessPoolExecutor, helpers: int, tier: object,
                 settings: Settings):  # fmt: skip
        self.plan, self.executor, self.helpers, self.tier = plan, executor, helpers, tier
        self.limits = settings.limits()
        self.pending: deque[TraceTask] = deque(plan.tasks)
        self.in_flight: dict[Future, list[TraceTask]] = {}
        self.outcomes: dict[int, TraceOutcome] = {}
        self.changed = threading.Condition()  # guards the three above
        self.stopping = threading.Event()

    def run(self, paths: Sequence[str], out_dir: str, target_name: str | None,
            on_result: Callable[[PassResult], None], ctrl_c: CtrlC) -> list[PassResult]:  # fmt: skip
        feeder = threading.Thread(target=self._feed_pool, name="nkicache-trace-feeder", daemon=True)
        feeder.start()
        results: list[PassResult] = []
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL)
        try:
            while len(results) < len(paths) and not ctrl_c.pressed:
                index = len(results)
                with self.changed:
                    ready = self.plan.needs[index] <= self.outcomes.keys()
                    task = self.pending.popleft() if not ready and self.pending else None
                    if not ready and task is None:
                        self.changed.wait(CTRL_C_POLL_SECONDS)
                        continue
                if ready:
                    results.append(self._run_pass(paths[index], index, out_dir, target_name))
                    on_result(results[-1])
                else:
                    outcome = trace_task(task, self.tier, self.limits)
                    with self.changed:
                        self.outcomes[task.task_id] = outcome
        finally:
            sys.setswitchinterval(switch_interval)
            self.stopping.set()
            feeder.join()
        return results

    def _feed_pool(self) -> None:
        """The feeder thread: hand the pool the next tasks as it answers, until nothing is left for it."""
        while not self.stopping.is_set():
            with self.changed:
                while self.helpers and self.pending and len(self.in_flight) < TASKS_AHEAD * self.helpers:
                    chunk = [self.pending.popleft() for _ in range(min(CHUNK, len(self.pending)))]
                    try:
                        self.in_flight[self.executor.submit(_trace_in_process, chunk)] = chunk
                    except BrokenProcessPool:
                        self._pool_broken(chunk)
                if not self.in_flight and not (self.helpers and self.pending):
                    return
                waiting = list(self.in_flight)
            done, _ = wait(waiting, timeout=CTRL_C_POLL_SECONDS, return_when=FIRST_COMPLETED)
            with self.changed:
                for future in done:
                    self._collect(future, self.in_flight.pop(future))
                self.changed.notify_all()

    def _collect(self, future: Future, chunk: list[TraceTask]) -> None:
        try:
            for outcome in future.result():
                self.outcomes[outcome.task_id] = outcome
        except BrokenProcessPool:
            self._pool_broken(chunk)
        except Exception as exc:  # the tasks failed in transit: their passes trace the variants themselves
            for task in chunk:
                self.outcomes[task.task_id] = TraceOutcome(task.task_id, task.cache_key, error=str(exc))

    def _pool_broken(self, chunk: list[TraceTask]) -> None:
        """A pool process died (killed, out of memory): its tasks and every later one are traced here."""
        self.helpers = 0
        self.pending.extendleft(reversed(chunk))

    def _run_pass(self, path: str, index: int, out_dir: str, target_name: str | None) -> PassResult:
        with self.changed:
            owned = [self.outcomes[task_id] for task_id in self.plan.owned[index]]
            for outcome in owned:  # handed to its one pass: the binary is not kept for the rest of the compile
                self.outcomes[outcome.task_id] = TraceOutcome(outcome.task_id, outcome.cache_key)
        handed = with_causes({outcome.cache_key: outcome.traced for outcome in owned if outcome.traced is not None},
                             self.plan)  # fmt: skip
        result, _ = compile_graph(path, tier=self.tier, target_name=target_name, out_dir=out_dir, limits=self.limits,
                                  traced_elsewhere=handed)  # fmt: skip
        return result
