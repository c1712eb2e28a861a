"""One compilation pass: a graph file in, a compiled basic block and the pass's counts out.

Used by every way of compiling (the command line in-process, the local pool, the fleet worker), so a pass
counts and fails the same way everywhere. Project errors end up in `PassResult.error` as one line naming
the file, the op and the cause; the caller decides what to do with them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from bridge import tier_seam
from bridge.artifact import build_artifact, encode_artifact, write_artifact
from bridge.codegen import BirCodeGenLoop
from bridge.errors import NkiCacheError
from bridge.failures import causes
from bridge.graph import load_graph
from bridge.limits import Limits, check_graph, kernel_instruction_limit
from bridge.metrics import KernelMetricsCollector
from bridge.port import PASS_COUNTERS, SECONDS_COUNTERS, KernelStore, TracedVariant
from bridge.targets import get_platform_target, make_target

COUNT_KEYS = tuple(name for name in PASS_COUNTERS if name != "passes")  # a pass's own counts


class PassResult(msgspec.Struct):
    file: str
    graph: str | None = None
    target: str | None = None
    counts: dict[str, float] = msgspec.field(default_factory=lambda: dict.fromkeys(COUNT_KEYS, 0))
    seconds: float = 0.0
    artifact: str | None = None
    error: str | None = None
    # {tier level: verified entries it answered during the pass}, nearest first (one item for a single tier).
    level_hits: dict[str, int] = msgspec.field(default_factory=dict)
    # A fleet trace task's answer (workers/trace_tasks.py): the cache keys it traced, told to the job they are for
    # (`traced_for`: the job its message names, when a key can be made of it).
    traced_keys: list[str] = msgspec.field(default_factory=list)
    traced_for: str | None = None

    def as_json(self) -> dict[str, Any]:
        shown = {
            key: value
            for key, value in msgspec.structs.asdict(self).items()
            if key not in ("counts", "traced_keys", "traced_for")
        }
        return shown | self.counts


def compile_graph(
    source: str | Path | Mapping,
    *,
    tier: KernelStore | None = None,
    target_name: str | None = None,
    out_dir: str | Path | None = None,
    label: str | None = None,
    pass_id: str | None = None,
    limits: Limits | None = None,
    traced_elsewhere: Mapping[str, TracedVariant] | None = None,
    traced_ahead: dict[str, TracedVariant] | None = None,
    tier_counts_from: Mapping[str, int] | None = None,
    read_tier: Callable[[Callable[[], Any]], Any] | None = None,
) -> tuple[PassResult, bytes | None]:
    """Compile one graph with a fresh BirCodeGenLoop (the spec's cache dies with the pass).

    With `out_dir` the artifact is written there atomically and its path recorded; the encoded artifact is
    returned either way, for callers that ship it elsewhere (the fleet). `pass_id` names the pass's metrics
    batch: two passes with one id count once in the fleet metrics. `limits` bound the graph's work (default:
    the settings' defaults); exceeding one fails the pass with an error naming the graph, the op and the limit.
    `traced_elsewhere` holds variants a fleet job's trace tasks traced for this pass, by cache key; `traced_ahead`
    variants traced ahead for it (`compile --workers N`): the pass takes those it would trace out of the dict,
    and leaves the rest there for the caller. `tier_counts_from`: the tier's counts the pass's tier counters start
    from (default: the pass's start), for a caller that asked the tier on its behalf before."""
    limits = limits or Limits()
    result = PassResult(label or (str(source) if not isinstance(source, Mapping) else "<graph>"))
    started = time.perf_counter()
    loop = None
    encoded = None
    hits_before = _level_hits(tier)
    try:
        # A parsed graph (a fleet job) is named by its file, so errors and the default name match a local compile.
        if isinstance(source, Mapping):
            graph = load_graph(source, source=label)
        else:
            graph = load_graph(source, max_bytes=limits.max_graph_bytes)
        result.graph = graph.name
        check_graph(graph, limits)
        name = target_name or graph.target
        target = make_target(name) if name else get_platform_target()
        result.target = type(target).__name__
        # The collector is process-wide, as in the compiler, where a process is one compilation; a worker
        # process runs thousands, and the fleet metrics already carry every pass's counts: keep one pass's.
        KernelMetricsCollector.get_instance().reset()
        loop = BirCodeGenLoop(target, tier=tier)
        seam = tier_seam.of(loop)  # what only this driver hands the pass, through the seam the tier attaches by
        seam.pass_id = pass_id
        seam.traced_elsewhere = dict(traced_elsewhere or {})
        seam.traced_ahead = traced_ahead if traced_ahead is not None else {}
        if tier_counts_from is not None:
            seam.tier_counts_at_start = dict(tier_counts_from)
        if read_tier is not None:
            seam.read_tier = read_tier
        with kernel_instruction_limit(limits.max_kernel_instructions):
            bb = loop.run(graph)
        artifact = build_artifact(graph, bb, result.target)
        encoded = encode_artifact(artifact)
        if out_dir is not None:
            result.artifact = str(write_artifact(artifact, out_dir))
    except Exception as exc:  # a bug in one pass must not cost the other graphs their compile
        if out_of_memory(exc):
            # Under a job's memory limit (RLIMIT_AS) this is the graph's doing, not a bug: say so in one line (the
            # fleet's compiling process exits on it: its heap is suspect).
            result.error = f"{result.file}: out of memory compiling the graph (a job's limit is the job_memory setting)"
        elif isinstance(exc, NkiCacheError):
            result.error = " ".join(str(exc).split())
        else:
            error = f"{result.file}: internal error (a bug, please report): {type(exc).__name__}: {exc}"
            result.error = " ".join(error.split())
        encoded = None
    finally:
        if loop is not None:
            summary = loop.pass_summary()
            result.counts = {key: summary[key] for key in COUNT_KEYS}
        hits_after = _level_hits(tier)
        result.level_hits = {level: hits - hits_before.get(level, 0) for level, hits in hits_after.items()}
        result.seconds = time.perf_counter() - started
    return result, encoded


def _level_hits(tier: KernelStore | None) -> dict[str, int]:
    """The tier's hits per level so far (none without a tier)."""
    return tier.level_hits() if tier is not None else {}


def add_level_hits(results: list[PassResult]) -> dict[str, int]:
    """Hits per tier level over passes."""
    totals: dict[str, int] = {}
    for result in results:
        for level, hits in result.level_hits.items():
            totals[level] = totals.get(level, 0) + hits
    return totals


def add_counts(results: list[PassResult]) -> dict[str, float]:
    """Totals over passes, from summed counts (a hit rate is computed from these, never averaged)."""
    totals: dict[str, float] = dict.fromkeys(COUNT_KEYS, 0)
    for result in results:
        for key in COUNT_KEYS:
            totals[key] += result.counts.get(key, 0)
    for key in SECONDS_COUNTERS:
        totals[key] = round(totals[key], 6)
    return totals


def out_of_memory(exc: BaseException) -> bool:
    """A MemoryError, or a thread that could not start (what CPython raises when the memory limit leaves no room
    for a thread's stack: the tier client starts its writer thread in the first pass that writes), whether
    raised as it is or as the cause of a project error."""
    return any(
        isinstance(cause, MemoryError) or (isinstance(cause, RuntimeError) and str(cause) == "can't start new thread")
        for cause in causes(exc)
    )
