"""BirCodeGenLoop: lowers a macro graph to a BIR basic block, re-tracing internal NKI kernels through the
new NKI frontend, with the specification's per-pass in-memory cache.

Names, signatures and control flow follow the specification ("NKI-Frontend Bridge and Binary Cache");
docs/spec-conformance.md maps each of its claims to the code here and to the test that checks it. The
cache lives on the instance and dies with the pass; nothing here is persisted.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from bridge import tier_seam
from bridge.errors import KernelCompileError, NkiCacheError
from bridge.graph import Graph
from bridge.identity import toolchain_id
from bridge.ir import (
    ORDINARY_OPS,
    BasicBlock,
    BirElementwise,
    InternalNkiKernel,
    MacroOp,
    NKIKLIRKernel,
    freeze_key_components,
)
from bridge.kernels import get_internal_kernel_registry
from bridge.key_rule import key_digest
from bridge.klir import VERSION_IDENTIFIERS
from bridge.metrics import KernelCategory, KernelMetricsCollector
from bridge.port import KernelStore, PassRecord, StoredTrace
from bridge.registry import InternalKernelConfig, KernelCall
from bridge.targets import Target, get_platform_target, make_target

logger = logging.getLogger(__name__)

# The environment key the orchestrator reads. It is data, never a branch: the dispatcher always takes beta3.
NKI_FRONTEND_ENV_KEY = "nki_frontend"
NKI_FRONTEND_ENV_DEFAULT = "beta2"
CACHE_KEY_LOG_PREFIX = 16
BANNER = "=" * 80


class BirCodeGenLoop:
    """One compilation pass. Construct a fresh one per pass: its cache is per-compilation."""

    def __init__(self, target: Target | None = None, tier: KernelStore | None = None):
        self.target = target if target is not None else get_platform_target()
        self._new_nki_frontend_kernel_cache: dict[str, dict] = {}
        self._cache_key_components: dict[str, dict] = {}
        self._cache_usage_counts: dict[str, int] = {}
        self.cache_hits = 0
        self.cache_misses = 0
        # Beyond the specification: the env value the orchestrator reads (as data, for diagnostics), and the
        # tier, which reaches the loop only through the specification's seams (bridge.tier_seam), as it reaches
        # any other loop; the pass's own counters are its seam's (`PASS_ATTRIBUTES`).
        self.nki_frontend_setting: str | None = None
        self.tier = tier
        tier_seam.begin_pass(self, tier, _verify)

    def __getattr__(self, name: str) -> Any:
        """The pass's counters and hand-overs (traces, remote_hits, traced_ahead, pass_id, ...), its seam's."""
        if name in PASS_ATTRIBUTES:
            seam = tier_seam.of(self)
            if seam is not None:
                return getattr(seam, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- the orchestrator -------------------------------------------------------------------------
    def codegenInternalNativeNkiKernel(self, inst: InternalNkiKernel, bb: BasicBlock) -> None:
        """Codegen for internal NKI kernels using new NKI frontend path.
        Traces the kernel to new NKI frontend at codegen time and creates BIR NKIKLIRKernel instruction.
        Uses caching to avoid redundant tracing of identical kernels."""
        func_name = inst.func_name
        kernel_name = inst.kernel_name
        # Read as data (kept for diagnostics); it selects nothing, as in the compiled dispatcher.
        self.nki_frontend_setting = os.environ.get(NKI_FRONTEND_ENV_KEY, NKI_FRONTEND_ENV_DEFAULT)

        # kernel_name, operands and results (_extract_tensor_info), attrs, and out_shape for ResizeNearest.
        key_components = self._key_components(inst)
        cache_key = self._compute_cache_key_from_components(key_components)
        cached = self._get_cached_new_nki_frontend_binary(cache_key)
        if cached is not None:
            self.cache_hits += 1
            logger.info("Cache hit for %s (cache key: %s...)", func_name, cache_key[:CACHE_KEY_LOG_PREFIX])
            self._record_cache_usage(cache_key)
            result = cached
        else:
            self.cache_misses += 1
            logger.info("Cache miss for %s (cache key: %s...)", func_name, cache_key[:CACHE_KEY_LOG_PREFIX])
            result = self._trace_internal_kernel_to_new_nki_frontend(inst, cache_key)
            self._cache_new_nki_frontend_binary(cache_key, result, key_components)

        kernel = NKIKLIRKernel(kernel_name, [t.name for t in inst.operands], [t.name for t in inst.results])
        kernel.set_klir_binary(result["binary"])
        kernel.set_kernel_format(result["format"])
        kernel.set_nki_binary_version_identifier(VERSION_IDENTIFIERS[result["format"]])
        kernel.set_func_args(result["input_names"])
        kernel.set_func_outs(result["output_names"])
        bb.addInstruction(kernel)

    # -- the cache key ----------------------------------------------------------------------------
    def _extract_tensor_info(self, tensors: list) -> dict[str, list]:
        """Helper to extract shape and dtype info from tensors for cache key."""
        result: dict[str, list] = {"shapes": [], "dtypes": []}
        for t in tensors:
            try:
                shape = t.access_shape
            except AttributeError:
                shape = t.shape
            result["shapes"].append(shape)
            result["dtypes"].append(t.dtype)
        return result

    def _compute_cache_key_from_components(self, key_components: dict[str, Any]) -> str:
        """Compute a cache key from key components."""
        key_components["target"] = self.target.__class__.__name__
        key_components["num_neuroncores"] = self.target.num_neuroncores_per_sengine
        return key_digest(key_components)

    # -- the three maps ---------------------------------------------------------------------------
    def _get_cached_new_nki_frontend_binary(self, cache_key: str) -> dict | None:
        return self._new_nki_frontend_kernel_cache.get(cache_key)

    def _cache_new_nki_frontend_binary(self, cache_key: str, binary: dict, key_components: dict) -> None:
        self._new_nki_frontend_kernel_cache[cache_key] = binary
        self._cache_key_components[cache_key] = key_components
        self._cache_usage_counts[cache_key] = 1

    def _record_cache_usage(self, cache_key: str) -> None:
        if cache_key in self._cache_usage_counts:
            self._cache_usage_counts[cache_key] += 1

    # -- the bridge -------------------------------------------------------------------------------
    # The specification's docstring, verbatim and stale: the compiled dispatcher reads no environment and never
    # branches. It always takes beta3.
    def _trace_internal_kernel_to_new_nki_frontend(self, inst: InternalNkiKernel, cache_key: str) -> dict:
        """Trace an internal NKI kernel using beta2 (KLIR) or beta3 (BIR) path.
        Environment variable NKI_FRONTEND controls the path:
        - "beta2": Use beta2 KLIR tracing (default)
        - "beta3": Use beta3 BIR compilation
        Returns a dict with keys: 'binary', 'input_names', 'output_names', 'format' ('klir' or 'bir')."""
        return self._trace_kernel_beta3(inst, cache_key)

    def _resolve_kernel_config(self, inst: InternalNkiKernel) -> tuple[InternalKernelConfig, Any, dict, dict]:
        """(cfg, kernel_func, additional_args, call_args) for `inst`, from the internal kernel registry."""
        cfg = get_internal_kernel_registry().resolve(inst.func_name)
        call = cfg.marshal(inst.operands, inst.results, inst.get_attrs_dict())
        if call.kernel_name != inst.kernel_name:
            raise KernelCompileError(
                f"op names kernel {inst.kernel_name!r} but {inst.func_name} selects {call.kernel_name!r} "
                "for these shapes and attrs"
            )
        call_args = {"kernel_name": call.kernel_name, "inputs": list(call.inputs), "outputs": list(call.outputs)}
        return cfg, call.kernel_func, call.attrs, call_args

    def _trace_kernel_beta3(self, inst: InternalNkiKernel, cache_key: str) -> dict:
        """The live leaf: ParserFrontend.compile_to_bir, format 'bir'."""
        _cfg, kernel_func, additional_args, call_args = self._resolve_kernel_config(inst)
        call = KernelCall(
            call_args["kernel_name"],
            kernel_func,
            tuple(call_args["inputs"]),
            tuple(call_args["outputs"]),
            additional_args,
        )
        from bridge.frontends.beta3 import trace_beta3  # the frontends load with the first trace, not on a warm hit

        return trace_beta3(call, self.target)

    def _trace_kernel_beta2(self, inst: InternalNkiKernel, cache_key: str) -> dict:
        """The dormant leaf: TraceKernel.trace, format 'klir'. Complete, and called by nothing in the bridge."""
        from bridge.frontends.beta2 import TraceKernel

        _cfg, kernel_func, additional_args, call_args = self._resolve_kernel_config(inst)
        with TraceKernel(
            target=self.target,
            num_neuroncores_per_sengine=self.target.num_neuroncores_per_sengine,
            kernel_name=call_args["kernel_name"],
        ) as tk:
            tk.bind_arguments(call_args)
            tk.specialize_and_call(kernel_func, additional_args)
            klir = tk.trace()
        return {
            "binary": klir,
            "input_names": [spec.name for spec in call_args["inputs"]],
            "output_names": [spec.name for spec in call_args["outputs"]],
            "format": "klir",
        }

    # -- beyond the specification: the pass as nkicache's driver runs it ------------------------------
    def _key_components(self, inst: InternalNkiKernel) -> dict[str, Any]:
        """The key components the orchestrator builds for `inst` (before target and neuroncores are folded)."""
        key_components: dict[str, Any] = {}
        key_components["kernel_name"] = inst.kernel_name
        key_components["operands"] = self._extract_tensor_info(inst.operands)
        key_components["results"] = self._extract_tensor_info(inst.results)
        key_components["attrs"] = inst.get_attrs_dict()
        if inst.func_name == "ResizeNearest":
            key_components["out_shape"] = self._extract_tensor_info(inst.results[:1])["shapes"][0]
        return key_components

    def tier_counts(self) -> dict[str, int]:
        """Tier errors, timeouts, rejections and drops during this pass."""
        return tier_seam.of(self).tier_counts()

    def pass_summary(self) -> dict[str, float]:
        """This pass's counters (bridge.port.PASS_COUNTERS), as `nkicache compile --json` and the reports
        name them."""
        return tier_seam.of(self).summary(self)

    def pass_record(self, graph_name: str, started: float, finished: float) -> PassRecord:
        """What this pass tells the store: its counts and how it used each kernel variant."""
        return tier_seam.of(self).record(self, graph_name, started, finished)

    def finish_pass(self, graph_name: str, started: float) -> None:
        """Hand this pass's metrics to the tier (once), without waiting for the tier to store them (nor the pass's
        entries): the store writes behind, and a caller that needs them stored when it goes on (a fleet job
        acknowledged, a process about to exit) calls the store's `flush` or `close` itself."""
        tier_seam.of(self).finish(self, graph_name, started)

    # -- statistics and metrics -------------------------------------------------------------------
    def _kernel_types(self) -> dict[str, dict]:
        types: dict[str, dict] = defaultdict(lambda: {"keys": [], "usage": 0})
        for cache_key, kc in self._cache_key_components.items():
            info = types[kc["kernel_name"]]
            info["keys"].append(cache_key)
            info["usage"] += self._cache_usage_counts.get(cache_key, 0)
        return types

    def _print_new_nki_frontend_cache_statistics(self) -> None:
        total = self.cache_hits + self.cache_misses
        if not self._new_nki_frontend_kernel_cache and total == 0:
            return
        if not logger.isEnabledFor(logging.DEBUG):
            return  # the same (no) output, without building every line of it at each pass's end
        debug = logger.debug
        debug(BANNER)
        debug("New NKI Frontend Kernel Cache Statistics")
        debug(BANNER)
        debug("Total kernels processed: " + str(total))
        debug("  Cache hits:   " + str(self.cache_hits) + " (" + _share(self.cache_hits, total) + ")")
        debug("  Cache misses: " + str(self.cache_misses) + " (" + _share(self.cache_misses, total) + ")")
        debug("Unique cached variants: " + str(len(self._new_nki_frontend_kernel_cache)))
        types = self._kernel_types()
        debug("Distinct kernel types: " + str(len(types)))
        for name, info in sorted(types.items(), key=lambda x: x[1]["usage"], reverse=True):
            debug("Kernel: " + name)
            debug("  Variants: " + str(len(info["keys"])))
            debug("  Total usage: " + str(sum(self._cache_usage_counts[k] for k in info["keys"])))
            for cache_key in info["keys"]:
                kc = self._cache_key_components[cache_key]
                debug("    Operand shapes: " + str(kc["operands"]["shapes"]))
                debug("    Result shapes:  " + str(kc["results"]["shapes"]))
        debug(BANNER)

    def _export_new_nki_fe_metrics(self) -> None:
        """Export new NKI FE kernel metrics to the collector."""
        if not self._cache_key_components:
            return
        collector = KernelMetricsCollector.get_instance()
        agg: dict[str, dict[str, int]] = defaultdict(lambda: {"call_count": 0, "variances": 0})
        for cache_key, kc in self._cache_key_components.items():
            agg[kc["kernel_name"]]["call_count"] += self._cache_usage_counts.get(cache_key)
            agg[kc["kernel_name"]]["variances"] += 1
        for kernel_name, stats in agg.items():
            collector.record_kernel(
                kernel_name=kernel_name,
                category=KernelCategory.NEW_NKI_FE,
                call_count=stats["call_count"],
                number_of_variances=stats["variances"],
            )

    def afterStmtTransform(self) -> None:
        """Per-function teardown: export the metrics, then log the statistics."""
        self._export_new_nki_fe_metrics()
        self._print_new_nki_frontend_cache_statistics()

    # -- walking a graph --------------------------------------------------------------------------
    def codegenElementwise(self, op: MacroOp, bb: BasicBlock) -> None:
        bb.addInstruction(
            BirElementwise(type(op).__name__, [t.name for t in op.operands], [t.name for t in op.results])
        )

    def run(self, graph: Graph) -> BasicBlock:
        """Lower every op of `graph` in order, dispatching by the op's type name, then tear down."""
        dispatch = {"InternalNkiKernel": self.codegenInternalNativeNkiKernel}
        dispatch.update(dict.fromkeys(ORDINARY_OPS, self.codegenElementwise))
        bb = BasicBlock(graph.name)
        seam = tier_seam.of(self)
        seam.label, seam.started = graph.name, time.time()  # recorded by the teardown (afterStmtTransform)
        seam.prefetch(self, (op for op in graph.ops if isinstance(op, InternalNkiKernel)), self._built_key)
        for index, op in enumerate(graph.ops):
            codegen = dispatch.get(type(op).__name__)
            if codegen is None:
                raise NkiCacheError(f"{graph.source}: op {index}: no codegen for {type(op).__name__}")
            try:
                codegen(op, bb)
            except NkiCacheError as exc:
                raise OpCodegenError(graph.source, index, op, exc) from exc
        self.afterStmtTransform()
        return bb

    def _built_key(self, inst: InternalNkiKernel) -> tuple[dict[str, Any], str]:
        """(key components, cache key) of `inst` through the key builder as the class defines it (not counted as
        a use of the key: the prefetch's)."""
        key_components = self._key_components(inst)
        builder = tier_seam.original(type(self), tier_seam.KEY_BUILDER)
        return key_components, builder(self, key_components)


def _share(count: int, total: int) -> str:
    """`count` as a percentage of `total` for the statistics, 'n/a' of none: a cache filled before anything was
    looked up has processed nothing, which is no 100% miss rate."""
    return format(100.0 * count / total, ".1f") + "%" if total else "n/a"


# The pass's own counters and hand-overs, its seam's (bridge.tier_seam.PassSeam), read as the loop's.
PASS_ATTRIBUTES = frozenset(
    {
        "traces",
        "trace_seconds",
        "remote_hits",
        "tier_lookups",
        "lease_waits",
        "parallel_traces",
        "traces_refused",
        "known_failures",
        "tier_saved_seconds",
        "in_pass_saved_seconds",
        "miss_causes",
        "kernel_miss_causes",
        "key_use_times",
        "tier_counts_at_start",
        "traced_elsewhere",
        "traced_ahead",
        "pass_id",
    }
)
tier_seam.install(BirCodeGenLoop)


class OpCodegenError(NkiCacheError):
    """A graph op failed to compile; the message names the graph file, the op and the cause."""

    def __init__(self, source: str, index: int, op: object, cause: NkiCacheError):
        self.source, self.index, self.cause = source, index, cause
        label = getattr(op, "func_name", type(op).__name__)
        super().__init__(f"{source}: op {index} ({label}): {cause}")


def kernel_cache_key(inst: InternalNkiKernel, target: Target | None = None) -> tuple[str, dict[str, Any]]:
    """(cache key, key components) of an internal kernel op, as the codegen loop computes them for `target`
    (default: the platform target): the key under which a tier stores that kernel's binary."""
    loop = BirCodeGenLoop(target)
    components = loop._key_components(inst)
    return loop._compute_cache_key_from_components(components), components


def cache_key_of_stored(key_components: Mapping[str, Any]) -> str:
    """The cache key that stored key components (as an entry or a snapshot keeps them, or as a user types
    them) hash to, through the loop's own `_compute_cache_key_from_components` for the target they name.
    Raises ValueError for components the loop cannot have built (no target, an unknown one, or a
    neuroncore count that is not the target's), TypeError for malformed ones."""
    components = freeze_key_components(key_components)
    if "target" not in components:
        raise ValueError("key components name no target")
    loop = _key_loop(str(components["target"]))
    target = loop.target
    stated_cores = components.get("num_neuroncores", target.num_neuroncores_per_sengine)
    if stated_cores != target.num_neuroncores_per_sengine:
        raise ValueError(f"num_neuroncores {stated_cores!r} is not {components['target']}'s")
    return loop._compute_cache_key_from_components(components)


@functools.lru_cache(maxsize=64)
def _key_loop(target_name: str) -> BirCodeGenLoop:
    """A loop for `target_name`, kept for the key rule alone (which reads only its target): verify recomputes
    the key of every entry, and building a loop and its target each time was a fifth of its time."""
    try:
        return BirCodeGenLoop(make_target(target_name))
    except NkiCacheError as exc:
        raise ValueError(str(exc)) from None


def _verify(loop: BirCodeGenLoop, cache_key: str, stored: StoredTrace) -> str | None:
    return stored_trace_problem(cache_key, stored)


def stored_trace_problem(cache_key: str, stored: StoredTrace) -> str | None:
    """Why a stored trace is not what this loop would emit under `cache_key`, or None. It must come from this
    very compiler (another toolchain's binary is what that compiler made), the bridge emits only 'bir' (the
    dispatcher never takes beta2), and an entry's key components must hash to the key it was read under,
    through the loop's own key rule: otherwise it is another variant's binary."""
    return tier_seam.trace_problem(stored, toolchain_id(), cache_key, cache_key_of_stored)
