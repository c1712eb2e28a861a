"""A compile's distinct kernel variants, traced by several processes while the passes stay sequential loops.

`plan_variants` reads and keys the graphs of a compile (the same keys the codegen loop computes) and lists the
trace tasks: the variants that neither a pass's own cache nor the tier will answer. `trace_task` traces one, in
whichever process takes it. Each pass is then run by the specification's loop, in order, handed the variants
traced for it (`BirCodeGenLoop.traced_elsewhere`); what it is not handed (a task that failed, a graph file
changed in between) it traces itself, as it would without any of this.

Which pass a variant is traced for follows what a sequential compile of the same graphs would do, so each
pass counts what it counts sequentially (`parallel_traces` says how many of its `traces` ran elsewhere):

- tier that reads: one task per variant the tier does not hold, for the first graph (in input order) that
  uses it; a later graph gets it from the tier, as a remote hit, as it would after the earlier pass published
  it. The task holds the single-flight lease while it traces and publishes the trace before it answers.
- tier off or mirror only: no pass reads another's traces, so one task per variant of each graph.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from bridge.codegen import BirCodeGenLoop, stored_trace_problem
from bridge.errors import NkiCacheError
from bridge.failures import FAILED, lasting
from bridge.graph import GraphError, load_graph
from bridge.identity import toolchain_id
from bridge.ir import InternalNkiKernel, Tensor
from bridge.limits import Limits, check_graph, kernel_instruction_limit
from bridge.miss_causes import MissObservation, classify_miss, facts_of_absent
from bridge.port import KernelStore, TracedVariant
from bridge.targets import get_platform_target, make_target


class TraceTask(msgspec.Struct, frozen=True):
    """One variant to trace: the first op of `graph` (an index into the planned paths) that uses it."""

    task_id: int
    graph: int
    cache_key: str
    op: InternalNkiKernel
    target: str
    key_components: dict[str, Any]


class TraceOutcome(msgspec.Struct, frozen=True):
    """What a trace task gave: the trace made here, or the error (the pass then traces the op itself and fails
    on it as a sequential pass does), or `found`, another process's trace the tier held once the lease was
    ours or its holder done, or none of them: another process holds the lease (`busy`: not waited for)."""

    task_id: int
    cache_key: str
    traced: TracedVariant | None = None
    error: str | None = None
    found: TracedVariant | None = None
    busy: bool = False


class VariantPlan(msgspec.Struct):
    tasks: list[TraceTask] = msgspec.field(default_factory=list)
    needs: dict[int, set[int]] = msgspec.field(default_factory=dict)  # graph -> the tasks its pass waits for
    owned: dict[int, list[int]] = msgspec.field(default_factory=dict)  # graph -> the tasks traced for it
    held: int = 0  # variants the tier already held, left to the passes to read
    # cache key -> why the tier missed it (the plan's lookup)
    causes: dict[str, str] = msgspec.field(default_factory=dict)


def plan_variants(
    paths: Sequence[str | Mapping],
    *,
    tier: KernelStore | None,
    target_name: str | None,
    limits: Limits,
    labels: Sequence[str] | None = None,
) -> VariantPlan:
    """The trace tasks of compiling `paths` (graph files, or parsed graphs named by `labels`), ordered by the
    first graph that needs them. A graph that cannot be read, keyed or passes no limit check gets none: its
    pass meets the error itself and reports it."""
    shared = tier is not None and tier.reads  # a pass reads what an earlier one published
    plan = key_variants(paths, shared=shared, target_name=target_name, limits=limits, labels=labels)
    return without_held(plan, tier) if shared and plan.tasks else plan


def key_variants(
    paths: Sequence[str | Mapping],
    *,
    shared: bool,
    target_name: str | None,
    limits: Limits,
    labels: Sequence[str] | None = None,
) -> VariantPlan:
    """`plan_variants` before it asks the tier (no tier used: `compile --workers N` keys the graphs before it
    forks its pool, which may not inherit a tier client in use). `shared`: the tier reads, so a variant gets
    one task, for the first graph that uses it."""
    plan = VariantPlan()
    first_task: dict[str, int] = {}  # cache key -> task, across graphs when the tier is shared
    for index, path in enumerate(paths):
        plan.needs[index], plan.owned[index] = set(), []
        keyed = _keyed_ops(path, target_name, limits, labels[index] if labels else None)
        if not shared:
            first_task = {}
        for op, components, cache_key, target in keyed:
            if cache_key not in first_task:
                first_task[cache_key] = len(plan.tasks)
                plan.tasks.append(TraceTask(len(plan.tasks), index, cache_key, op, target, components))
                plan.owned[index].append(first_task[cache_key])
            plan.needs[index].add(first_task[cache_key])
    return plan


def _keyed_ops(
    source: str | Mapping, target_name: str | None, limits: Limits, label: str | None
) -> list[tuple[InternalNkiKernel, dict, str, str]]:
    """(op, key components, cache key, target) of every internal kernel op of the graph, in order; none when the
    graph is not one its pass would compile."""
    try:
        if isinstance(source, Mapping):
            graph = load_graph(source, source=label)
        else:
            graph = load_graph(source, max_bytes=limits.max_graph_bytes)
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


def without_held(plan: VariantPlan, tier: KernelStore) -> VariantPlan:
    """The plan without the tasks whose variant the tier holds a trace the loop would accept for (one round
    trip): the passes read those from the tier."""
    traces, stored = tier.find_traces(sorted({task.cache_key for task in plan.tasks}))
    held = {key for key, trace in traces.items() if stored_trace_problem(key, trace) is None}
    kept = [task for task in plan.tasks if task.cache_key not in held]
    return VariantPlan(
        kept,
        {graph: {t for t in tasks if plan.tasks[t].cache_key not in held} for graph, tasks in plan.needs.items()},
        {graph: [t for t in tasks if plan.tasks[t].cache_key not in held] for graph, tasks in plan.owned.items()},
        len({task.cache_key for task in plan.tasks if task.cache_key in held}),
        _miss_causes(kept, stored, tier),
    )


def _miss_causes(kept: Sequence[TraceTask], stored: set[str], tier: KernelStore) -> dict[str, str]:
    """Why the tier missed each variant the plan traces (bridge.miss_causes), from the plan's own lookup and
    one read of the tier's variant index, as a pass's prefetch finds them; a pass counts its miss under it."""
    down, facts = facts_of_absent(tier, {task.cache_key: task.key_components for task in kept}, stored)
    return {
        task.cache_key: classify_miss(
            MissObservation(down, rejected=task.cache_key in stored),
            None if facts is None else facts.get(task.cache_key),
        )
        for task in kept
    }


def with_causes(handed: Mapping[str, TracedVariant], plan: VariantPlan) -> dict[str, TracedVariant]:
    """The variants handed to a pass, each naming why the tier missed it when the plan asked."""
    return {
        key: msgspec.structs.replace(variant, miss_cause=plan.causes.get(key, "unknown"))
        for key, variant in handed.items()
    }


def trace_task(
    task: TraceTask,
    tier: KernelStore | None,
    limits: Limits,
    wait: bool = True,
) -> TraceOutcome:
    """Trace one task's variant as the loop's own miss would (single-flight lease, publish to the tier, the
    kernel instruction limit), in this process. When another process holds the lease: wait for its trace
    (`wait`), else answer `busy` at once, so a process with other tasks to trace goes on to the next. What it
    publishes is written behind, the lease released once it is stored, so a process waiting on the lease still
    finds it (a caller with such a waiter has it sent at once: `send_now`)."""
    lease = tier is not None and tier.reads and tier.single_flight
    if lease:
        if not tier.acquire_lease(task.cache_key):
            if not wait:
                return TraceOutcome(task.task_id, task.cache_key, busy=True)
            found = _found(task, tier.wait_for_trace(task.cache_key))
            return found or TraceOutcome(task.task_id, task.cache_key)
        # The holder before us may have published and released between the plan's lookup and our lease.
        traces, _ = tier.find_traces([task.cache_key])
        found = _found(task, traces.get(task.cache_key))
        if found is not None:
            tier.release_lease(task.cache_key)
            return found
    loop = BirCodeGenLoop(make_target(task.target))
    started = time.perf_counter()
    resolved = False
    try:
        # First the registry: its func_name is not in the key, so its failure is the op's, never the variant's.
        loop._resolve_kernel_config(task.op)
        resolved = True
        with kernel_instruction_limit(limits.max_kernel_instructions):
            result = loop._trace_internal_kernel_to_new_nki_frontend(task.op, task.cache_key)
    except Exception as exc:
        if not (resolved and lasting(exc)):  # the pass meets it (or, out of memory here, not) itself, as alone
            if lease:
                tier.release_lease(task.cache_key)
            return TraceOutcome(task.task_id, task.cache_key, error=f"{type(exc).__name__}: {exc}")
        # The kernel cannot compile: remembered by the tier, handed to its pass as such.
        message = " ".join(str(exc).split())
        if tier is not None:
            tier.publish_failure(task.cache_key, task.key_components, message, release_lease=lease)
        failed = TracedVariant({}, time.perf_counter() - started, toolchain_id(), failure=message)
        return TraceOutcome(task.task_id, task.cache_key, failed, error=message)
    seconds = time.perf_counter() - started
    if tier is not None:
        tier.publish_trace(task.cache_key, result, task.key_components, seconds, release_lease=lease)
    return TraceOutcome(task.task_id, task.cache_key, TracedVariant(result, seconds, toolchain_id()))


def _found(task: TraceTask, stored: Any) -> TraceOutcome | None:
    """What the tier holds for the task as its outcome, when it is what tracing the task would give: another
    process's trace, or its failure (a negative entry: the task's error, which its pass meets again)."""
    if stored is None or stored_trace_problem(task.cache_key, stored) is not None:
        return None
    if stored.result["format"] == FAILED:
        return TraceOutcome(task.task_id, task.cache_key, error=stored.result["binary"].decode())
    variant = TracedVariant(dict(stored.result), stored.compile_seconds, stored.toolchain, elsewhere=True)
    return TraceOutcome(task.task_id, task.cache_key, found=variant)


# -- a task as JSON (fleet trace tasks travel on the job stream) -------------------------------------------
def task_document(task: TraceTask) -> dict[str, Any]:
    """A trace task as JSON: its key, its target, and a graph of its one op (tensor names kept: a trace holds
    them), which `task_from_document` reads back through the graph loader's checks."""
    op = task.op
    tensors = {tensor.name: _tensor_document(tensor) for tensor in (*op.operands, *op.results)}
    kernel = {
        "type": "InternalNkiKernel",
        "func_name": op.func_name,
        "kernel_name": op.kernel_name,
        "operands": [t.name for t in op.operands],
        "results": [t.name for t in op.results],
        "attrs": op.get_attrs_dict(),
    }
    graph = {"name": "trace-task", "target": task.target, "tensors": tensors, "ops": [kernel]}
    return {"cache_key": task.cache_key, "target": task.target, "graph": graph}


def _tensor_document(tensor: Tensor) -> dict[str, Any]:
    document: dict[str, Any] = {"shape": list(tensor.shape), "dtype": tensor.dtype}
    if hasattr(tensor, "access_shape"):
        document["access_shape"] = list(tensor.access_shape)
    return document


def task_from_document(document: object, task_id: int = 0) -> TraceTask:
    """The trace task a `task_document` describes; GraphError when it is not one (malformed, or its op does
    not hash to the key it names: a task is never traced under another variant's key)."""
    if not isinstance(document, Mapping) or not isinstance(document.get("cache_key"), str):
        raise GraphError("trace task: not an object naming a cache_key")
    if not isinstance(document.get("graph"), Mapping):  # never a string: load_graph would take it for a path
        raise GraphError("trace task: its graph is not an object")
    graph = load_graph(document["graph"], source="trace task")
    ops = [op for op in graph.ops if isinstance(op, InternalNkiKernel)]
    if len(ops) != 1 or graph.target is None:
        raise GraphError("trace task: its graph must hold one internal kernel op and name its target")
    loop = BirCodeGenLoop(make_target(graph.target))
    components = loop._key_components(ops[0])
    cache_key = loop._compute_cache_key_from_components(components)
    if cache_key != document["cache_key"]:
        raise GraphError(f"trace task: its op hashes to {cache_key[:16]}..., not to {document['cache_key'][:16]}...")
    return TraceTask(task_id, 0, cache_key, ops[0], graph.target, components)
