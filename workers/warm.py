"""Upgrade without a cold start: trace the most used variants of another toolchain with this compiler.

Every entry keeps its key components, and in this compiler the key components are the whole input of a
kernel compile (kernel name, operand and result shapes and dtypes, attrs, target, neuroncores). So a new
compiler can rebuild each kernel call from the old compiler's entries, trace it, and store it under its own
toolchain before it takes traffic. The specification's key does not depend on the compiler: a rebuilt
call must hash to the very key it came from, or it is skipped.
"""

from __future__ import annotations

import heapq
import json
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import msgspec

from bridge.codegen import kernel_cache_key
from bridge.errors import NkiCacheError
from bridge.graph import load_graph
from bridge.identity import toolchain_id
from bridge.limits import Limits, check_graph, kernel_instruction_limit
from bridge.port import TracedVariant
from bridge.toolchain import compile_kernel
from cachestore.api import MetricsBatch, Reader, batched
from cachestore.client import TierClient
from cachestore.entry import FAILED
from cachestore.inspect import decode_or_reason, describe_components
from cachestore.keys import partition, split_partition
from workers.verify import rebuild_op


class WarmError(NkiCacheError):
    """Nothing to warm from (no other toolchain in the tier, or the one named holds no entries)."""


class Variant(msgspec.Struct, order=True):
    """Ordered by use, then recency, then key: keys are unique, so `components` is never compared."""

    usage: int
    last_use: float
    cache_key: str
    components: dict


class WarmReport(msgspec.Struct):
    source: str | None  # the toolchain warmed from (None: a dry run that found none to warm from)
    toolchain: str  # this compiler's
    considered: int = 0  # variants picked
    to_trace: int = 0  # of those, what this compiler had to trace (with --dry-run: would have)
    traced: int = 0
    present: int = 0  # already held by this toolchain, or being traced by another process right now
    # Pool traces made by another compiler than this one (its process imported other code): traced here instead.
    refused: int = 0
    skipped: list[dict] = msgspec.field(default_factory=list)  # [{key, reason}]: cannot be rebuilt into a call
    failed: list[dict] = msgspec.field(default_factory=list)  # [{key, reason}]: this compiler refuses the call
    seconds: float = 0.0
    trace_seconds: float = 0.0  # compile time of the traced variants, summed
    batch: str | None = None  # with the fleet: the batch of trace jobs submitted
    jobs: list[str] = msgspec.field(default_factory=list)
    # With --dry-run: what would be traced, one item a variant ({key, kernel_name, target, operand_shapes,
    # result_shapes}), so that a dry run says which variants, not only how many.
    would_trace: list[dict] = msgspec.field(default_factory=list)
    nothing_to_warm: str | None = None  # a dry run's reason there is nothing to warm from (a warm's error)

    def as_json(self) -> dict:
        return msgspec.structs.asdict(self)


def default_source(reader: Reader) -> str:
    """The other toolchain whose (trusted scope's) entries were used most recently."""
    latest: dict[str, float] = {}
    for name in reader.entry_partitions():
        toolchain, scope = split_partition(name)
        if toolchain == toolchain_id() or scope:  # an untrusted scope or the quarantine
            continue
        for variant in _variants(reader.in_partition(name), reader):
            latest[toolchain] = max(latest.get(toolchain, 0.0), variant.last_use)
    if not latest:
        raise WarmError(f"{reader.description} holds no entries of another toolchain to warm from")
    return max(latest, key=lambda toolchain: (latest[toolchain], toolchain))


def pick_variants(
    reader: Reader, source: str, *, top: int | None = None, min_usage: int = 0, since: float | None = None
) -> list[Variant]:
    """The most used variants of `source` (usage from the fleet metrics), at most `top`, used at least
    `min_usage` times and last at or after `since`. Keeps `top` in memory, not the whole partition."""
    if partition(source) not in reader.entry_partitions():
        raise WarmError(f"{reader.description} holds no entries of toolchain {source}")
    chosen: list[Variant] = []
    for variant in _variants(reader.in_partition(partition(source)), reader):
        if variant.usage < min_usage or (since is not None and variant.last_use < since):
            continue
        if top is None:
            chosen.append(variant)
        elif len(chosen) < top:
            heapq.heappush(chosen, variant)
        elif variant > chosen[0]:
            heapq.heapreplace(chosen, variant)
    return sorted(chosen, reverse=True)


def _variants(store: Reader, metrics: Reader) -> Iterator[Variant]:
    for batch in batched(store.scan_entries(with_ttl=False)):
        records = metrics.key_records([raw.cache_key for raw in batch])
        for raw in batch:
            entry = decode_or_reason(raw.data)
            if isinstance(entry, str) or entry.format == FAILED:
                continue  # unreadable, or a kernel the old compiler failed on: nothing worth rebuilding
            record = records.get(raw.cache_key)
            usage, last_use = (record.usage, record.last_use) if record else (0, entry.created)
            yield Variant(usage, last_use, raw.cache_key, dict(entry.key_components))


def warm(
    tier: TierClient,
    variants: list[Variant],
    source: str,
    *,
    workers: int = 1,
    dry_run: bool = False,
    on_progress: Callable[[], None] = lambda: None,
    fleet: Callable[[list[tuple[str, str]]], Any] | None = None,
    per_job: int = 8,
    limits: Limits | None = None,
) -> WarmReport:
    """Trace `variants` with this compiler and store them in its partition of `tier`, single flight with
    every other process (a variant another process holds the lease on is left to it). With `fleet`, the
    variants to trace go to the fleet instead: `fleet` submits graphs of `per_job` kernel calls each, as
    (name, graph JSON), and returns the submission; this compiler's workers trace them (their codegen loops
    take the leases), and `report.jobs` names the jobs. `limits` (the settings' bounds on a graph's work)
    apply as they do to a compile: a call over one fails with the limit's message."""
    limits = limits or Limits()
    report = WarmReport(source, toolchain_id(), considered=len(variants))
    started = time.perf_counter()
    held = tier.find_traces([v.cache_key for v in variants])[0]
    calls = []
    for variant in variants:
        if variant.cache_key in held:
            report.present += 1
            on_progress()
            continue
        call, problem = _rebuilt_call(variant)
        refused = None if problem is not None else _over_limits(variant, call, limits)
        if problem is not None:
            report.skipped.append({"key": variant.cache_key, "reason": problem})
            on_progress()
        elif refused is not None:
            report.failed.append({"key": variant.cache_key, "reason": refused})
            on_progress()
        elif fleet is None and not dry_run and not tier.acquire_lease(variant.cache_key):
            report.present += 1  # another warmer or compile is tracing it now
            on_progress()
        else:
            calls.append((variant, call))
    report.to_trace = len(calls)
    if dry_run:
        report.would_trace = [_planned(variant) for variant, _ in calls]
    if fleet is not None and not dry_run:
        submission = fleet(warm_graphs([call for _, call in calls], report.toolchain, per_job))
        report.batch, report.jobs = submission.batch_id, list(submission.job_ids)
    elif not dry_run:
        for variant, call, outcome in _traced(calls, workers, limits.max_kernel_instructions):
            _store(tier, report, variant, call, outcome, limits.max_kernel_instructions)
            on_progress()
    if not dry_run:
        # Names this compiler in the fleet metrics (with no pass), so that `report` compares the toolchains'
        # coverage, which it only looks for when the metrics know more than one toolchain.
        settings = tier.settings
        tier.record(
            MetricsBatch(
                f"warm-{uuid.uuid4().hex}", settings.host, settings.worker, {"passes": 0}, toolchain=report.toolchain
            )
        )
    report.seconds = time.perf_counter() - started
    return report


def warm_graphs(calls: list[dict], toolchain: str, per_job: int) -> list[tuple[str, str]]:
    """(name, graph JSON) of graphs that call the given kernels, `per_job` calls each (one target a graph):
    compiling a graph traces, and stores, each call's variant under the same key as the entry it came from."""
    by_target: dict[str, list[dict]] = {}
    for call in calls:
        by_target.setdefault(call["target"], []).append(call)
    graphs = []
    for target, group in sorted(by_target.items()):
        for start in range(0, len(group), per_job):
            name = f"warm-{toolchain[:8]}-{len(graphs):05d}"
            graphs.append((f"{name}.json", json.dumps(_graph(name, target, group[start : start + per_job]))))
    return graphs


def _graph(name: str, target: str, calls: list[dict]) -> dict:
    tensors: dict[str, dict] = {}
    ops = []
    for i, call in enumerate(calls):
        names = {}
        for role, tensors_of_call in (("in", call["operands"]), ("out", call["results"])):
            names[role] = [f"v{i}_{role}{j}" for j in range(len(tensors_of_call))]
            for tensor_name, tensor in zip(names[role], tensors_of_call, strict=True):
                tensors[tensor_name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype)}
        ops.append(
            {
                "type": "InternalNkiKernel",
                "func_name": call["func_name"],
                "kernel_name": call["components"]["kernel_name"],
                "operands": names["in"],
                "results": names["out"],
                "attrs": call["attrs"],
            }
        )
    return {"name": name, "target": target, "tensors": tensors, "ops": ops}


def _planned(variant: Variant) -> dict:
    """What a dry run shows of a variant it would trace: its key, kernel and shapes (its call was rebuilt, so
    its components are well formed)."""
    info = describe_components(variant.components)
    return {
        "key": variant.cache_key,
        **{name: info[name] for name in ("kernel_name", "target", "operand_shapes", "result_shapes")},
    }


def _rebuilt_call(variant: Variant) -> tuple[dict | None, str | None]:
    try:
        op = rebuild_op(variant.components)
        key, components = kernel_cache_key(op.inst, op.target)
    except (NkiCacheError, KeyError, TypeError, ValueError) as exc:
        return None, f"cannot be rebuilt into a kernel call: {' '.join(str(exc).split())}"
    if key != variant.cache_key:
        return None, f"its components hash to {key[:16]}... with this compiler, not to its key"
    call = {
        "func_name": op.func_name,
        "operands": op.inst.operands,
        "results": op.inst.results,
        "attrs": op.attrs,
        "target": type(op.target).__name__,
        "components": components,
    }
    return call, None


def _over_limits(variant: Variant, call: dict, limits: Limits) -> str | None:
    """Why a compile would refuse this call's graph (a tensor or the graph over max_tensor_elements or
    max_graph_elements), or None: the very check a compile makes (bridge.limits.check_graph), on the graph of
    this one call that `--fleet` would submit."""
    try:
        graph = load_graph(
            _graph(f"warm-{variant.cache_key[:16]}", call["target"], [call]), source=f"variant {variant.cache_key[:16]}"
        )
        check_graph(graph, limits)
    except NkiCacheError as exc:
        return " ".join(str(exc).split())
    return None


def _traced(
    calls: list[tuple[Variant, dict]], workers: int, max_instructions: int
) -> Iterator[tuple[Variant, dict, Any]]:
    """(variant, call, the traced variant or the error message), as each trace finishes."""
    if workers <= 1 or len(calls) <= 1:
        for variant, call in calls:
            yield variant, call, _trace(call, max_instructions)
        return
    from workers.pool_process import pool_context

    with ProcessPoolExecutor(max_workers=workers, mp_context=pool_context()) as pool:
        futures = [(variant, call, pool.submit(_trace, call, max_instructions)) for variant, call in calls]
        for variant, call, future in futures:
            yield variant, call, future.result()


def _trace(call: dict, max_instructions: int) -> TracedVariant | str:
    from bridge.targets import make_target

    started = time.perf_counter()
    try:
        with kernel_instruction_limit(max_instructions):  # as a compile's pass traces (workers.passes)
            result = compile_kernel(
                call["func_name"], call["operands"], call["results"], call["attrs"], target=make_target(call["target"])
            )
    except NkiCacheError as exc:
        return " ".join(str(exc).split())
    return TracedVariant(result, time.perf_counter() - started, toolchain_id())


def _store(
    tier: TierClient, report: WarmReport, variant: Variant, call: dict, outcome: Any, max_instructions: int
) -> None:
    if not isinstance(outcome, str) and outcome.toolchain != tier.toolchain:
        report.refused += 1  # never stored under this compiler's toolchain: traced by this process instead
        outcome = _trace(call, max_instructions)
    if isinstance(outcome, str):
        tier.release_lease(variant.cache_key)
        report.failed.append({"key": variant.cache_key, "reason": outcome})
        return
    tier.publish_trace(variant.cache_key, outcome.result, call["components"], outcome.seconds, release_lease=True)
    report.traced += 1
    report.trace_seconds += outcome.seconds
