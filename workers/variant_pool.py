"""`nkicache compile --workers N`: the compile's kernel variants traced by N processes, its passes run in order.

This process keys the graphs (bridge.parallel.key_variants), then forks N - 1 helper processes, which inherit
the trace tasks. Every process takes the next task in the pass order from a counter in shared memory
(`Claims`) whenever it is free, and a helper sends back what it traced over its own pipe. Nothing is handed
over through queues: a helper never waits for this process to be handed its next task. As soon as all the
tasks a pass needs are answered, this process runs that pass, in input order, with the specification's loop,
handed the variants traced for it.

The helpers trace from the start. With a tier, this process imports the store's library after the fork, while
they trace (redis-py takes 60-70 ms, which a core would otherwise spend idle), then a thread of it asks the
tier's index for the compile's variants (a forked process must not inherit a tier client in use), and the tasks
it answers for are skipped (a pass reads them). This process waits for that answer PLAN_PATIENCE_SECONDS at
most before it traces, and the passes wait for it while there is anything left to trace: a tier that is down,
frozen or slow costs the compile what no tier would, not its timeouts. A pass's prefetch is read on a thread of
its own (`TierReader`), and this process traces while it waits. Later in the compile, a thread (`TierWatch`)
gives up on a tier that leaves a pass waiting TIER_PATIENCE_SECONDS and ten times the slowest of their reads so
far (a frozen server, long before the operation timeout: the pass goes on as on a tier that failed), and once
the tier failed, puts the skipped tasks of the passes still to run back in the pool and wakes the helpers:
those passes wait for them as without a tier. Helpers are forked when this process runs no other thread (they
start in milliseconds, the compiler already imported), otherwise they start from the forkserver
(`workers.pool_process.pool_context`). A helper that dies leaves the tasks it took to this process, which traces
them; the others keep taking tasks, and each pass completes as without helpers.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

import msgspec

from bridge.parallel import TraceOutcome, TraceTask, VariantPlan, key_variants, trace_task
from bridge.port import KernelStore, TracedVariant
from cachestore.settings import Settings
from cachestore.stores import open_tier
from workers.compile_run import CTRL_C_POLL_SECONDS, CompileRun, CtrlC, import_tier_library
from workers.passes import PassResult, compile_graph
from workers.pool_process import init_process, pool_context, trace_in_process

if TYPE_CHECKING:
    from bridge.limits import Limits
    from cachestore.stacked import Tier

# A process killed while it holds the counter's lock (a window of microseconds) would hold it for ever: the
# others give up on it after this long and trace what is left here.
CLAIM_LOCK_SECONDS = 5.0
STOPPED = 1 << 62  # the counter once the compile stops: no task is taken any more
# A healthy tier's index answers within milliseconds: this process waits this long for it, then traces without
# it (what it answers for later is skipped from then on).
PLAN_PATIENCE_SECONDS = 0.05
# A pass's read of a healthy tier returns within milliseconds (a loopback Redis: 5-9 ms, 17 ms at most with both
# cores busy); one still waiting after this long, and after ten times the slowest of the passes' reads
# (cachestore.guard), is taken as a tier that stopped answering. The pass's process traces while it waits
# (TierReader), but the pass itself, and the compile's end, wait this long on a tier frozen mid-compile.
TIER_PATIENCE_SECONDS = 0.08
# The plan's read, when the compile ends before it answered, is given up on once it is this old.
PLAN_READ_PATIENCE_SECONDS = 0.15
WATCH_SECONDS = 0.01  # how often TierWatch looks at the tier (a give-up comes up to this late)
FREE, SKIPPED, TAKEN = 0, 1, 2  # a task's state in Claims


def pool_start_context() -> multiprocessing.context.BaseContext:
    """fork when this process runs no other thread (a helper starts in milliseconds, the compiler already
    imported), else the forkserver context."""
    if "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return pool_context()


class ClaimsBroken(Exception):
    """The counter's lock was not free within CLAIM_LOCK_SECONDS (its holder died holding it)."""


class Claims:
    """In shared memory: each task's state (FREE to take, SKIPPED: its pass reads the tier, TAKEN), which process
    took it (so a dead helper's are known), and the first position that may be FREE. Changed under the lock."""

    def __init__(self, context: multiprocessing.context.BaseContext, tasks: int):
        self.next = context.Value("q", 0)
        self.taken_by = context.Array("i", max(tasks, 1), lock=False)
        self.state = context.Array("b", max(tasks, 1), lock=False)

    def take(self, who: int, count: int) -> int | None:
        """The position (in the list of tasks to trace) this process takes next, None when none is free."""
        with self._locked() as counter:
            position = counter.value
            while position < count and self.state[position] != FREE:
                position += 1
            if position >= count:
                return None
            counter.value = position + 1
            self.state[position], self.taken_by[position] = TAKEN, who
            return position

    def skip(self, positions: Collection[int], skipped: bool = True) -> None:
        """Mark free tasks SKIPPED, or (`skipped=False`) skipped ones FREE again; a TAKEN task stays taken."""
        if not positions:
            return
        before, after = (FREE, SKIPPED) if skipped else (SKIPPED, FREE)
        with self._locked() as counter:
            for position in positions:
                if self.state[position] == before:
                    self.state[position] = after
            if not skipped and counter.value < STOPPED:
                counter.value = min(counter.value, *positions)

    def taken_by_one(self, who: int) -> list[int]:
        """The positions `who` took, read without the lock (a dead helper may hold it for ever)."""
        return [p for p, state in enumerate(self.state) if state == TAKEN and self.taken_by[p] == who]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[Any]:
        lock = self.next.get_lock()
        if not lock.acquire(timeout=CLAIM_LOCK_SECONDS):
            raise ClaimsBroken
        try:
            yield self.next.get_obj()  # under the lock already
        finally:
            lock.release()

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
    """A helper process: each time this compile's parent says go (once forked, and when it put tasks back), take
    tasks until none is free, sending back each outcome. It ends when the parent closes its pipe."""
    for other in others:  # the other pipes' ends: a pipe whose process dies must read as closed
        other.close()
    init_process(settings, dropped_outside_passes)
    try:
        while connection.recv():
            while (position := claims.take(who, len(tasks))) is not None:
                connection.send(trace_in_process([tasks[position]])[0])
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

    def go(self) -> None:
        """Tell the helpers to take tasks (one that cannot be told is dead: `receive` sees it). Called from
        TierWatch's thread too: a pipe closed meanwhile is skipped."""
        for pipe in list(self.pipes.values()):
            with contextlib.suppress(OSError):
                pipe.send(True)

    def receive(self, timeout: float, wake: Sequence[Connection] = ()) -> tuple[list[TraceOutcome], list[int]]:
        """Outcomes the helpers sent (waiting up to `timeout` for one, or for a `wake` connection to be ready),
        and the helpers that died."""
        outcomes, dead = [], []
        sentinels = {process.sentinel: who for who, process in self.processes.items()}
        for ready in wait([*self.pipes.values(), *sentinels, *wake], timeout):
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
        # The plan, too, out of the collector's reach before the fork (compile_run froze what came before it): its
        # full collections would otherwise walk (and write) these objects in both processes, copying their pages
        # (about 5% more trace CPU in two processes, measured).
        gc.freeze()
        helpers = Helpers(context, plan.tasks, claims, workers - 1, settings, dropped_outside_passes)
        # The tier's answer, when it comes, takes the variants it holds off their list. Until then, on a warm compile,
        # they trace for nothing (about 80 ms of a core, measured), which a cold or failing tier's compile gains.
        helpers.go()
        if tier is not None:
            import_tier_library(settings)  # while the helpers trace
        answer = TierAnswer(plan, tier)
        try:
            scheduler = Scheduler(plan, answer, claims, helpers, tier, limits)
            try:
                results = scheduler.run(paths, out_dir, target_name, on_result, ctrl_c)
            finally:
                scheduler.close()
        finally:
            claims.stop()
            answer.close()  # (its read cut short if it outlived the compile) before the tier client closes
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


def not_ahead(plan: VariantPlan, tier: KernelStore) -> set[int]:
    """The tasks not worth tracing ahead: a variant the tier's index says it stored (its pass reads it), and,
    when the tier stores what a pass publishes and reads it back, all but the first of each variant of the
    whole compile (a later pass reads the earlier one's). A guess only: a pass counts what it would alone
    whatever is traced ahead, tracing itself what is missing and leaving what it does not need."""
    facts = tier.variant_facts({task.cache_key: task.key_components for task in plan.tasks})
    if facts is None:  # the index cannot be read: a tier down, whose passes read nothing
        return set()
    seen: set[str] = set()
    skipped = set()
    for task in plan.tasks:
        stored = task.cache_key in facts and facts[task.cache_key].stored_here_before
        if stored or (tier.writes and task.cache_key in seen):
            skipped.add(task.task_id)
        seen.add(task.cache_key)
    return skipped


class TierAnswer:
    """`not_ahead` of a compile, read from the tier on a thread of its own so that tracing need not wait for it.
    `ready` (a connection `wait` can watch) is readable once it is known; with no tier that reads, at once.
    `counts_before`: the tier's counts before it was asked."""

    def __init__(self, plan: VariantPlan, tier: Tier | None):
        self.skipped: set[int] = set()
        self.counts_before: Mapping[str, int] | None = tier.counts() if tier is not None else None
        self.ready, self._done = multiprocessing.Pipe(duplex=False)
        self._thread: threading.Thread | None = None
        if tier is None or not tier.reads:
            self._done.close()
            return
        self._tier = tier  # (set, as _asked is, only when the read runs)
        self._asked = time.monotonic()
        self._thread = threading.Thread(target=self._read, args=(plan,), name="nkicache-plan", daemon=True)
        self._thread.start()

    def _read(self, plan: VariantPlan) -> None:
        try:
            self.skipped = not_ahead(plan, self._tier)
        finally:
            self._done.close()

    def known(self, timeout: float = 0.0) -> bool:
        return self.ready.poll(timeout)

    def close(self) -> None:
        """Wait for the read until it is PLAN_READ_PATIENCE_SECONDS old at most: the compile is done, and a tier
        that did not answer its plan in that long is given up on (its read cut short, as TierWatch cuts a pass's)."""
        if self._thread is not None:
            if not self.known(max(0.0, self._asked + PLAN_READ_PATIENCE_SECONDS - time.monotonic())):
                self._tier.give_up("the compile ended before the tier answered its plan's read")
            self._thread.join()
        self.ready.close()


class TierWatch:
    """A thread that watches the tier for the compile: it gives up on the tier when a read made by one of the
    passes' threads (`passes`, their idents) is overdue (cachestore.guard; TIER_PATIENCE_SECONDS at least), and
    calls `failed` once the tier failed (whichever call saw it: its breaker is open). Not while a call merely
    probes a tier not proven yet (it is not `available` to other calls meanwhile): the plan's own read is that
    probe, and taking it for a failure would throw the tier's answer away, so a warm compile whose plan read
    outlasts WATCH_SECONDS (a loaded machine) would trace every variant. Ends with the compile (`stop`)."""

    def __init__(self, tier: Tier, passes: Collection[int], failed: Callable[[], None]):
        self._stopped = threading.Event()
        args = (tier, passes, failed)
        self._thread = threading.Thread(target=self._watch, args=args, name="nkicache-tier-watch", daemon=True)
        self._thread.start()

    def _watch(self, tier: Tier, passes: Collection[int], failed: Callable[[], None]) -> None:
        told = False
        while not self._stopped.wait(WATCH_SECONDS):
            if any(tier.overdue(thread, TIER_PATIENCE_SECONDS) for thread in passes):
                tier.give_up(f"a pass's read outwaited compile --workers ({TIER_PATIENCE_SECONDS} s at least)")
            if not told and tier.failed:  # (not `available`: the plan's read probing an unproven tier is no failure)
                failed()
                told = True

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class TierReader:
    """A thread that makes the passes' prefetch reads (a pass's `read_tier`), so that this process traces while a
    pass waits for the tier instead of idling: on a tier frozen mid-compile, until TierWatch gives up on it, which
    cost the compile about half that wait with two processes (measured). A daemon thread and two queues, not a
    concurrent.futures executor: a second Ctrl-C raised while this thread holds a future's lock would hang the
    compile's end (workers.compile_run.CtrlC), and a read still waiting at exit must not hold the process."""

    def __init__(self, meanwhile: Callable[[], bool]):
        """`meanwhile()`: trace one task; False when there is none."""
        self._meanwhile = meanwhile
        self._reads: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        thread = threading.Thread(target=self._serve, name="nkicache-tier-reader", daemon=True)
        thread.start()
        self.ident: int = thread.ident  # the thread TierWatch watches

    def _serve(self) -> None:
        while (read := self._reads.get()) is not None:
            try:
                self._answers.put((True, read()))
            except BaseException as exc:  # (a bug in the read: raised in the pass, as if it had read there)
                self._answers.put((False, exc))

    def read(self, read: Callable[[], Any]) -> Any:
        """`read()`'s result, made on the reader's thread, this one tracing until it is in (then the pass goes on)."""
        self._reads.put(read)
        while self._answers.empty() and self._meanwhile():
            pass
        ok, answer = self._answers.get()
        if not ok:
            raise answer
        return answer

    def close(self) -> None:
        self._reads.put(None)


class Scheduler:
    """Runs each pass once every task it needs is answered, and takes the next task to trace in between."""

    def __init__(
        self, plan: VariantPlan, answer: TierAnswer, claims: Claims, helpers: Helpers, tier: Tier | None, limits: Limits
    ):
        self.plan, self.claims, self.helpers, self.tier, self.limits = plan, claims, helpers, tier, limits
        self.tasks = plan.tasks  # in the pass order; helpers index them by position
        self.needs = {graph: set(tasks) for graph, tasks in plan.needs.items()}
        self.by_id = {task.task_id: task for task in plan.tasks}
        self.outcomes: dict[int, TraceOutcome] = {}
        # Traces a pass did not take (its graph failed first, or the tier answered): a later pass of the same
        # variant takes them instead of tracing.
        self.spare: dict[str, TracedVariant] = {}
        self.orphans: deque[int] = deque()  # tasks a dead helper took: traced here
        self.broken = False  # the counter's lock is lost: every task not answered is traced here
        self.answer: TierAnswer | None = answer  # None once its skips are applied
        self.passes_done = 0
        self.skips = threading.Lock()  # skipping the tier's answer and putting tasks back, one at a time
        self.put_back: set[int] | None = None  # once the tier failed: the tasks of the passes after the one running
        self.put_back_applied = False
        self.reader = TierReader(self._trace_one) if tier is not None and tier.reads else None
        # The passes read the tier in this thread (leases, single lookups) and in the reader's (their prefetch).
        readers = {threading.get_ident(), self.reader.ident} if self.reader is not None else set()
        self.watch = TierWatch(tier, readers, self._put_back) if tier is not None else None
        # The plan's read is the compile's first contact with the tier, which a sequential compile's first pass
        # makes itself: what it counted (a tier down: its error) is the first pass's that runs the loop.
        self.first_counts_from = answer.counts_before
        self._apply_answer(PLAN_PATIENCE_SECONDS)

    def _apply_answer(self, timeout: float = 0.0) -> None:
        """Once the tier answered: skip the tasks it answers for (helpers no longer take them, passes no longer
        wait for them)."""
        if self.answer is None or not self.answer.known(timeout):
            return
        skipped, self.answer = self.answer.skipped, None
        with self.skips:
            if self.put_back is not None:  # the tier failed since: it answers for nothing
                return
            self.claims.skip([position for position, task in enumerate(self.tasks) if task.task_id in skipped])
        for needed in self.needs.values():
            needed -= skipped

    def _put_back(self) -> None:
        """(TierWatch's thread, once the tier failed) The skipped tasks of the passes after the one running now
        (which traces its own) back in the pool, and the helpers woken to take them."""
        with self.skips:
            later = [position for position, task in enumerate(self.tasks) if task.graph > self.passes_done]
            self.claims.skip(later, skipped=False)
            self.put_back = {self.tasks[position].task_id for position in later}
        self.helpers.go()

    def _wait_for_put_back(self) -> None:
        """Once TierWatch put tasks back (and the tier's answer is applied): the passes still to run wait for
        theirs."""
        if self.put_back is None or self.put_back_applied or self.answer is not None:
            return
        self.put_back_applied = True
        for graph, tasks in self.plan.needs.items():
            if graph >= self.passes_done:
                self.needs[graph] |= tasks & self.put_back

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.reader is not None:
            self.reader.close()

    def _trace_one(self) -> bool:
        """(While a pass waits for the tier) trace the next free task; False when there is none. The helpers'
        outcomes are read first: a helper whose pipe is full would wait for this process instead of tracing."""
        self._receive(0)
        task = self._next_task()
        if task is None:
            return False
        self.outcomes[task.task_id] = trace_task(task, None, self.limits)
        return True

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
            self._apply_answer()
            self._wait_for_put_back()
            index = self.passes_done = len(results)
            ready = self.needs[index] <= self.outcomes.keys()
            # While the tier has not answered, tracing comes first; a pass asks it only when nothing is left to
            # trace (and finds it busy, if it is still being asked: cachestore.breaker).
            task = self._next_task() if self.answer is not None or not ready else None
            if task is not None:
                self.outcomes[task.task_id] = trace_task(task, None, self.limits)  # published by its pass
            elif ready:
                results.append(self._run_pass(paths[index], index, out_dir, target_name))
                on_result(results[-1])
            else:
                self._receive(CTRL_C_POLL_SECONDS)  # the helpers trace the rest
        return results

    def _receive(self, timeout: float) -> None:
        wake = [self.answer.ready] if self.answer is not None else []
        if not self.helpers.pipes:
            if wake and timeout:
                self.answer.known(timeout)
            return
        outcomes, dead = self.helpers.receive(timeout, wake)
        for outcome in outcomes:
            if outcome.traced is not None:
                # a helper traced it
                outcome = msgspec.structs.replace(
                    outcome, traced=msgspec.structs.replace(outcome.traced, elsewhere=True)
                )
            self.outcomes.setdefault(outcome.task_id, outcome)
        for who in dead:
            self._helper_died(who)

    def _helper_died(self, who: int) -> None:
        """The tasks a dead helper took and did not answer are traced here."""
        lost = [self.tasks[p].task_id for p in self.claims.taken_by_one(who)]
        self.orphans.extend(task_id for task_id in lost if task_id not in self.outcomes)

    def _next_task(self) -> TraceTask | None:
        while self.orphans:
            task_id = self.orphans.popleft()
            if task_id not in self.outcomes:
                return self.by_id[task_id]
        if not self.broken:
            try:
                position = self.claims.take(0, len(self.tasks))
                return None if position is None else self.tasks[position]
            except ClaimsBroken:
                self.broken = True
        state = self.claims.state
        pending = [t for p, t in enumerate(self.tasks) if t.task_id not in self.outcomes and state[p] != SKIPPED]
        return pending[-1] if pending else None  # from the end: a helper may be tracing the next one

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
            path,
            tier=self.tier,
            target_name=target_name,
            out_dir=out_dir,
            limits=self.limits,
            traced_ahead=ahead,
            tier_counts_from=self.first_counts_from,
            read_tier=self.reader.read if self.reader is not None else None,
        )
        if result.counts:  # its loop ran
            self.first_counts_from = None
        self.spare.update(ahead)  # what the pass did not take
        return result
