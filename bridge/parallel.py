"""A compile's distinct kernel variants, traced by several processes while the passes stay sequential loops.

`plan_variants` reads and keys the graphs of a compile (the same keys the codegen loop computes) and lists the
trace tasks: the variants that neither a pass's own cache nor the tier will answer. `trace_task` traces one, in
whichever process takes it. Each pass is then run by the specification's loop, in order, handed the variants
traced for it (`BirCodeGenLoop.traced_elsewhere`); what it is not handed (a task that failed, a graph file
changed in between) it traces itself, as it would without any of this.

Which pass a variant is traced for follows what a sequential compile of the same graphs would do, so each
pass counts what it counts sequentially (`traces` there = `traces` + `parallel_traces` here):

- tier that reads: one task per variant the tier does not hold, for the first graph (in input order) that
  uses it; a later graph gets it from the tier, as a remote hit, as it would after the earlier pass published
  it. The task holds the single-flight lease while it traces and publishes the trace before it answers.
- tier off or mirror only: no pass reads another's traces, so one task per variant of each graph.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bridge.codegen import BirCodeGenLoop, stored_trace_problem
from bridge.errors import NkiCacheError
from bridge.graph import load_graph
from bridge.ir import InternalNkiKernel
from bridge.limits import Limits, check_graph, kernel_instruction_limit
from bridge.port import KernelStore, TracedVariant
from bridge.targets import get_platform_target, make_target


@dataclass(frozen=True)
class TraceTask:
    """One variant to trace: the first op of `graph` (an index into the planned paths) that uses it."""

    task_id: int
    graph: int
    cache_key: str
    op: InternalNkiKernel
    target: str
    key_components: dict[str, Any]


@dataclass(frozen=True)
class TraceOutcome:
    """What a trace task gave: the trace, or the error (the pass then traces the op itself and fails on it as
    a sequential pass does), or neither when another process published it first (the pass reads the tier)."""

    task_id: int
    cache_key: str
    traced: TracedVariant | None = None
    error: str | None = None


@dataclass
class VariantPlan:
    tasks: list[TraceTask] = field(default_factory=list)
    needs: dict[int, set[int]] = field(default_factory=dict)  # graph -> the tasks its pass waits for
    owned: dict[int, list[int]] = field(default_factory=dict)  # graph -> the tasks traced for it
    held: int = 0  # variants the tier already held, left to the passes to read


def plan_variants(
    paths: Sequence[str], *, tier: KernelStore | None, target_name: str | None, limits: Limits
) -> VariantPlan:
    """The trace tasks of compiling `paths`, ordered by the first graph that needs them. A graph that cannot
    be read, keyed or passes no limit check gets none: its pass meets the error itself and reports it."""
    shared = tier is not None and tier.reads  # a pass reads what an earlier one published
    plan = VariantPlan()
    first_task: dict[str, int] = {}  # cache key -> task, across graphs when the tier is shared
    for index, path in enumerate(paths):
        plan.needs[index], plan.owned[index] = set(), []
        keyed = _keyed_ops(path, target_name, limits)
        if not shared:
            first_task = {}
        for op, components, cache_key, target in keyed:
            if cache_key not in first_task:
                first_task[cache_key] = len(plan.tasks)
                plan.tasks.append(TraceTask(len(plan.tasks), index, cache_key, op, target, components))
                plan.owned[index].append(first_task[cache_key])
            plan.needs[index].add(first_task[cache_key])
    if shared and plan.tasks:
        plan = _without_held(plan, tier)
    return plan


def _keyed_ops(path: str, target_name: str | None, limits: Limits) -> list[tuple[InternalNkiKernel, dict, str, str]]:
    """(op, key components, cache key, target) of every internal kernel op of the graph, in order; none when the
    graph is not one its pass would compile."""
    try:
        graph = load_graph(path, max_bytes=limits.max_graph_bytes)
        check_graph(graph, limits)
        name = target_name or graph.target
        target = make_target(name) if name else get_platform_target()
        loop, target_class = BirCodeGenLoop(target), type(target).__name__
        keyed = []
        for op in graph.ops:
            if isinstance(op, InternalNkiKernel):
                components = loop._key_components(op)
                keyed.append((op, components, loop._compute_cache_key_from_components(components), target_class))
        return keyed
    except (NkiCacheError, OSError, ValueError, TypeError, RecursionError):
        return []


def _without_held(plan: VariantPlan, tier: KernelStore) -> VariantPlan:
    """The plan without the tasks whose variant the tier holds a trace the loop would accept for (one round
    trip): the passes read those from the tier."""
    traces, _ = tier.find_traces(sorted({task.cache_key for task in plan.tasks}))
    held = {key for key, stored in traces.items() if stored_trace_problem(key, stored) is None}
    kept = [task for task in plan.tasks if task.cache_key not in held]
    return VariantPlan(
        kept,
        {graph: {t for t in tasks if plan.tasks[t].cache_key not in held} for graph, tasks in plan.needs.items()},
        {graph: [t for t in tasks if plan.tasks[t].cache_key not in held] for graph, tasks in plan.owned.items()},
        len({task.cache_key for task in plan.tasks if task.cache_key in held}),
    )


def trace_task(task: TraceTask, tier: KernelStore | None, limits: Limits) -> TraceOutcome:
    """Trace one task's variant as the loop's own miss would (single-flight lease, publish to the tier, the
    kernel instruction limit), in this process."""
    lease = tier is not None and tier.reads and tier.single_flight
    if lease and not tier.acquire_lease(task.cache_key):
        # Another process (another compile, a fleet worker) traces it: the pass reads its trace from the tier.
        tier.wait_for_trace(task.cache_key)
        return TraceOutcome(task.task_id, task.cache_key)
    loop = BirCodeGenLoop(make_target(task.target))
    started = time.perf_counter()
    try:
        with kernel_instruction_limit(limits.max_kernel_instructions):
            result = loop._trace_internal_kernel_to_new_nki_frontend(task.op, task.cache_key)
    except Exception as exc:  # any failure is the pass's to meet and report, as it would alone
        if lease:
            tier.release_lease(task.cache_key)
        return TraceOutcome(task.task_id, task.cache_key, error=f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - started
    if tier is not None:
        tier.publish_trace(task.cache_key, result, task.key_components, seconds, release_lease=lease)
        tier.flush()  # a later pass reads it from the tier: stored before the answer
    return TraceOutcome(task.task_id, task.cache_key, TracedVariant(result, seconds))
