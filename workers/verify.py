"""Verification that needs the compiler: `nkicache inspect verify` (every entry decoded with the reader's
signature policy and checked against its key through the codegen loop's own key rule; sampled entries
re-traced and compared byte for byte, or executed against the numpy references), and the key components
`inspect explain` asks about, built as the loop builds them.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np

from bridge.codegen import BirCodeGenLoop, cache_key_of_stored
from bridge.errors import NkiCacheError
from bridge.graph import load_graph
from bridge.graph_runner import RUNNERS, compare_output
from bridge.identity import toolchain_id
from bridge.ir import InternalNkiKernel, Tensor, freeze_key_components
from bridge.kernels import get_internal_kernel_registry
from bridge.references import reference
from bridge.sampling import sample_inputs
from bridge.targets import Target, get_platform_target, make_target
from cachestore.api import RawEntry, Reader
from cachestore.entry import MAX_ENTRY_BYTES, Entry, SignaturePolicy
from cachestore.inspect import (
    InspectError,
    binary_problem,
    components_problem,
    decode_or_reason,
    key_problem,
    toolchain_problem,
)
from cachestore.keys import partition
from cachestore.scan_split import scan_split


class VerifyReport(msgspec.Struct):
    checked: int = 0
    bad: list[dict] = msgspec.field(default_factory=list)
    recompiled: int = 0
    executed: int = 0

    @property
    def ok(self) -> int:
        return self.checked - len({item["key"] for item in self.bad})

    def as_json(self) -> dict:
        return {
            "checked": self.checked,
            "ok": self.ok,
            "bad": self.bad,
            "recompiled": self.recompiled,
            "executed": self.executed,
        }


def verify_entries(
    reader: Reader,
    policy: SignaturePolicy,
    *,
    max_bytes: int = MAX_ENTRY_BYTES,
    recompile: int = 0,
    execute: int = 0,
    seed: int = 0,
    processes: int | None = None,
) -> VerifyReport:
    """Decode every entry of the reader's partition with the reader's signature policy (digest,
    signature, schema), check that it was traced by that toolchain, that its binary matches its digest and that
    its key components hash to its key. Then re-trace `recompile` sampled entries
    and compare bytes (only this compiler's own entries: another toolchain's binaries are expected to
    differ), and run `execute` sampled entries against the numpy references. The entries are read and checked
    by up to `processes` processes (cachestore.scan_split; None: one a CPU), each keeping a sample of the keys
    it found good; the samples are merged into one."""
    if recompile and reader.partition != partition(toolchain_id()):
        raise InspectError(
            f"--recompile re-traces with this compiler (toolchain {toolchain_id()}); the entries "
            f"of toolchain {reader.partition} were traced by another"
        )
    wanted = max(recompile, execute)

    def task(index: int) -> _Check:
        return _Check(policy, max_bytes, wanted, random.Random(f"{seed}:{index}"))

    report = VerifyReport()
    samples = []
    for share in scan_split(reader, task, processes=processes):
        report.checked += share["checked"]
        report.bad += share["bad"]
        samples.append((share["sample"], share["good"]))
    sample = _sampled_entries(reader, policy, max_bytes, merged_sample(samples, wanted, random.Random(seed)), report)
    for key, entry in sample[:recompile]:
        _record(report, key, _recompile_problem(key, entry))
        report.recompiled += 1
    for key, entry in sample[:execute]:
        _record(report, key, _execute_problem(key, entry, seed))
        report.executed += 1
    return report


class _Check:
    """verify's checks over the entries one process reads: its problems, and a uniform sample (a reservoir) of
    `wanted` keys among the entries it found good."""

    def __init__(self, policy: SignaturePolicy, max_bytes: int, wanted: int, rng: random.Random):
        self.policy, self.max_bytes, self.wanted, self.rng = policy, max_bytes, wanted, rng
        self.report = VerifyReport()
        self.sample: list[str] = []
        self.good = 0

    def add(self, batch: list[RawEntry]) -> None:
        for raw in batch:
            self.report.checked += 1
            entry = decode_or_reason(raw.data, self.policy, self.max_bytes, raw.cache_key)
            problem = (
                entry
                if isinstance(entry, str)
                else (
                    binary_problem(entry)
                    or toolchain_problem(raw, entry)
                    or key_problem(raw.cache_key, entry, cache_key_of_stored)
                )
            )
            if problem:
                self.report.bad.append({"key": raw.cache_key, "reason": problem})
            else:
                self._sampled(raw.cache_key)

    def _sampled(self, key: str) -> None:
        self.good += 1
        if len(self.sample) < self.wanted:
            self.sample.append(key)
        elif self.wanted:
            slot = self.rng.randrange(self.good)
            if slot < self.wanted:
                self.sample[slot] = key

    def result(self) -> dict:
        return {"checked": self.report.checked, "bad": self.report.bad, "sample": self.sample, "good": self.good}


def merged_sample(samples: list[tuple[list[str], int]], wanted: int, rng: random.Random) -> list[str]:
    """`wanted` keys drawn uniformly from the union of the parts a process each sampled: (its sample, uniform
    among the `good` keys it found, of min(wanted, good) keys). Each draw takes a part with the probability of its
    share of the keys not yet drawn, then a key of its sample: every key has the same chance, as if one process
    had sampled them all."""
    pools = [(list(keys), good) for keys, good in samples]
    chosen: list[str] = []
    while len(chosen) < wanted:
        left = sum(good for _, good in pools)
        if not left:
            break
        point = rng.randrange(left)
        for index, (keys, good) in enumerate(pools):
            if point < good:
                chosen.append(keys.pop(rng.randrange(len(keys))))
                pools[index] = (keys, good - 1)
                break
            point -= good
    return sorted(chosen)


def _sampled_entries(
    reader: Reader, policy: SignaturePolicy, max_bytes: int, keys: list[str], report: VerifyReport
) -> list[tuple[str, Entry]]:
    """The sampled entries, read again (the scan kept their keys only): one changed since it was checked is
    recorded with its problem, one deleted since is left out."""
    sample = []
    for key, data in sorted(reader.get_entries(keys).items()):
        entry = decode_or_reason(data, policy, max_bytes, key)
        if isinstance(entry, str):
            _record(report, key, f"changed while verifying: {entry}")
        else:
            sample.append((key, entry))
    return sample


def _record(report: VerifyReport, key: str, problem: str | None) -> None:
    if problem:
        report.bad.append({"key": key, "reason": problem})


class RebuiltOp(msgspec.Struct):
    func_name: str
    inst: InternalNkiKernel
    target: Target
    attrs: dict


def rebuild_op(components: Mapping[str, Any]) -> RebuiltOp:
    """The InternalNkiKernel op an entry was compiled from, rebuilt from its key components: kernel_name is
    mapped back to a func_name by asking each registered kernel which kernel it selects for these shapes."""
    kc = freeze_key_components(components)
    try:
        target = make_target(kc["target"])
        ops, res = kc["operands"], kc["results"]
        operands = [Tensor(f"in{i}", s, d) for i, (s, d) in enumerate(zip(ops["shapes"], ops["dtypes"], strict=True))]
        results = [Tensor(f"out{i}", s, d) for i, (s, d) in enumerate(zip(res["shapes"], res["dtypes"], strict=True))]
        attrs = dict(kc.get("attrs") or {})
        kernel_name = kc["kernel_name"]
    except (KeyError, TypeError, ValueError) as exc:
        raise InspectError(f"key components cannot be rebuilt into an op: {type(exc).__name__}: {exc}") from None
    registry = get_internal_kernel_registry()
    for func_name in registry.names():
        try:
            call = registry.resolve(func_name).marshal(operands, results, attrs)
        except NkiCacheError:
            continue
        if call.kernel_name == kernel_name:
            return RebuiltOp(
                func_name, InternalNkiKernel(func_name, kernel_name, operands, results, attrs), target, attrs
            )
    raise InspectError(f"no registered kernel compiles {kernel_name!r} for these shapes and attrs")


def _recompile_problem(key: str, entry: Entry) -> str | None:
    try:
        op = rebuild_op(entry.key_components)
        loop = BirCodeGenLoop(op.target)
        trace = loop._trace_kernel_beta2 if entry.format == "klir" else loop._trace_kernel_beta3
        result = trace(op.inst, key)
    except NkiCacheError as exc:
        return f"recompile failed: {' '.join(str(exc).split())}"
    if result["binary"] != entry.binary:
        return f"recompiled binary differs: {len(entry.binary)} bytes stored, {len(result['binary'])} bytes recompiled"
    if list(result["input_names"]) != entry.input_names or list(result["output_names"]) != entry.output_names:
        return "recompiled binary names other inputs or outputs"
    return None


def _execute_problem(key: str, entry: Entry, seed: int) -> str | None:
    try:
        op = rebuild_op(entry.key_components)
        rng = np.random.default_rng([seed, int(key[:8], 16)])
        inputs = sample_inputs(op.func_name, op.inst.operands, op.attrs, rng)
        outputs = RUNNERS[entry.format](entry.binary, dict(zip(entry.input_names, inputs, strict=True)))
        expected = reference(op.func_name, inputs, op.attrs)
    except (NkiCacheError, ValueError, TypeError, KeyError) as exc:
        return f"execution failed: {type(exc).__name__}: {' '.join(str(exc).split())}"
    comparison = compare_output(
        [outputs.get(name) for name in entry.output_names],
        expected,
        [t.dtype for t in (*op.inst.operands, *op.inst.results)],
        [t.dtype for t in op.inst.results],
    )
    if comparison.ok:
        return None
    names = [*entry.output_names, "(extra)"]
    return f"execution output {names[comparison.failed_output]} {comparison.problem}"


def components_for(components: Mapping[str, Any], target_name: str | None = None) -> dict[str, Any]:
    """User-given key components (JSON) completed as the key builder would: target and neuroncore count
    from `target_name` (else the platform target) when missing."""
    if "kernel_name" not in components:
        raise InspectError("key components must name the kernel_name")
    completed = dict(components)
    if target_name:
        completed["target"] = target_name
    completed.setdefault("target", type(get_platform_target()).__name__)
    if target_name or "num_neuroncores" not in completed:
        completed["num_neuroncores"] = make_target(str(completed["target"])).num_neuroncores_per_sengine
    completed.setdefault("attrs", {})
    problem = components_problem(completed)
    if problem is not None:
        raise InspectError(f"key components are malformed: {problem}")
    return freeze_key_components(completed)


def components_of_graph_op(graph_path: str, op_index: int, target_name: str | None = None) -> dict[str, Any]:
    """The key components the codegen loop builds for op `op_index` of a graph file."""
    graph = load_graph(graph_path)
    if not 0 <= op_index < len(graph.ops):
        raise InspectError(f"{graph_path}: no op {op_index} (the graph has {len(graph.ops)} ops)")
    inst = graph.ops[op_index]
    if not isinstance(inst, InternalNkiKernel):
        raise InspectError(f"{graph_path}: op {op_index} is {type(inst).__name__}, not an InternalNkiKernel")
    name = target_name or graph.target
    loop = BirCodeGenLoop(make_target(name) if name else get_platform_target())
    # As codegenInternalNativeNkiKernel builds them; computing the key folds in the target and neuroncores.
    components = loop._key_components(inst)
    loop._compute_cache_key_from_components(components)
    return components
