"""BirCodeGenLoop: lowers a macro graph to a BIR basic block, re-tracing internal NKI kernels through the
new NKI frontend, with the specification's per-pass in-memory cache.

Names, signatures and control flow follow the specification ("NKI-Frontend Bridge and Binary Cache");
docs/spec-conformance.md maps each of its claims to the code here and to the test that checks it. The
cache lives on the instance and dies with the pass; nothing here is persisted.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from bridge.errors import KernelCompileError, NkiCacheError
from bridge.failures import FAILED, MAX_FAILURE_BYTES
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
from bridge.miss_causes import MISS_CAUSES, MissObservation, VariantFacts, classify_miss, facts_of_absent
from bridge.port import TIER_COUNTERS, KernelStore, PassRecord, StoredTrace, TracedVariant, VariantUse
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
        self.tier = tier
        self._new_nki_frontend_kernel_cache: dict[str, dict] = {}
        self._cache_key_components: dict[str, dict] = {}
        self._cache_usage_counts: dict[str, int] = {}
        self.cache_hits = 0
        self.cache_misses = 0
        # Beyond the specification: what the bridge actually did, for reports.
        self.traces = 0
        self.trace_seconds = 0.0
        self.nki_frontend_setting: str | None = None
        # The persistent tier (a bridge.port.KernelStore): read-through before tracing, mirror after.
        self.remote_hits = 0
        self.tier_lookups = 0  # in-pass misses that asked the tier: the shared-cache hit rate's denominator
        self.lease_waits = 0
        # Compile seconds saved, per cache that answered (bridge.port): the tier's remote hits, the pass's own hits.
        self.tier_saved_seconds = 0.0
        self.in_pass_saved_seconds = 0.0
        self.key_use_times: dict[str, tuple[float, float]] = {}
        self._compile_seconds: dict[str, float] = {}
        self._leases: set[str] = set()
        # The tier's answers for a whole graph, fetched at once: key -> verified trace or None (a miss).
        self._prefetched: dict[str, StoredTrace | None] = {}
        self._prefetch_stored: set[str] = set()  # keys the tier held something under, rejected or not
        # For the cause of each tier miss (bridge.miss_causes): was the tier down for the prefetch, and what its
        # variant index knows of the keys the prefetch found absent (None: it could not say).
        self._tier_down = False
        self._variant_facts: dict[str, VariantFacts] | None = None
        self.miss_causes: dict[str, int] = dict.fromkeys(MISS_CAUSES, 0)
        self.kernel_miss_causes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        # The prefetch computes every op's key once: id(op) -> (op, key components, cache key), for the orchestrator.
        self._op_keys: dict[int, tuple[InternalNkiKernel, dict[str, Any], str]] = {}
        # The tier's counts this pass's are counted from (`tier_counts`); a caller that asked the tier on the
        # pass's behalf before it began sets it earlier.
        self.tier_counts_at_start = tier.counts() if tier is not None else {}
        self.pass_id: str | None = None  # names this pass's metrics batch in the tier (default: a fresh id)
        # Variants a fleet job's trace tasks traced and published for this pass (workers/trace_tasks.py): key ->
        # trace. A miss on one is answered before the tier is asked, and counted in traces.
        self.traced_elsewhere: dict[str, TracedVariant] = {}
        # Variants `compile --workers N` traced ahead for this pass (workers/variant_pool.py), published by no one:
        # a miss the tier does not answer takes the one traced for it instead of tracing, and publishes it, so the
        # pass asks, counts and stores exactly what it would alone. What is left is the caller's to hand on.
        self.traced_ahead: dict[str, TracedVariant] = {}
        self.parallel_traces = 0  # of `traces`, those made in another process
        self.traces_refused = 0  # handed-over traces another compiler made (bridge.port), traced here instead
        self.known_failures = 0  # kernels the tier knew this compiler fails on (negative entries): failed at once

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
        key_components, cache_key = self._op_key(inst)
        cached = self._get_cached_new_nki_frontend_binary(cache_key)
        if cached is not None:
            self.cache_hits += 1
            logger.info("Cache hit for %s (cache key: %s...)", func_name, cache_key[:CACHE_KEY_LOG_PREFIX])
            self._record_cache_usage(cache_key)
            self.in_pass_saved_seconds += self._compile_seconds.get(cache_key, 0.0)
            self._note_use(cache_key)
            result = cached
        else:
            self.cache_misses += 1
            logger.info("Cache miss for %s (cache key: %s...)", func_name, cache_key[:CACHE_KEY_LOG_PREFIX])
            result = self._take_traced_elsewhere(inst, cache_key)
            if result is None:
                result = self._read_through_tier(inst, cache_key)
            if result is None:
                result = self._trace_and_publish(inst, cache_key, key_components)
            self._cache_new_nki_frontend_binary(cache_key, result, key_components)
            self._note_use(cache_key)

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

        started = time.perf_counter()
        result = trace_beta3(call, self.target)
        self.trace_seconds += time.perf_counter() - started
        self.traces += 1
        return result

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

    # -- the persistent tier (beyond the specification) --------------------------------------------
    def _tier_reads(self) -> bool:
        return self.tier is not None and self.tier.reads

    def _read_through_tier(self, inst: InternalNkiKernel, cache_key: str) -> dict | None:
        """On a local miss, the tier's verified entry (counted in remote_hits), else None: trace it."""
        if not self._tier_reads():
            return None
        # The key names the kernel, not the func_name: resolve the op first so that an unknown func_name
        # or a kernel_name the registry would not select fails as it would without a tier.
        self._resolve_kernel_config(inst)
        self.tier_lookups += 1
        if cache_key in self._prefetched:
            stored = self._accepted(cache_key, self._prefetched.pop(cache_key))
            held = cache_key in self._prefetch_stored
        else:
            stored, held = self._find_trace(cache_key)
        waited = False
        if stored is None and self.tier.single_flight:
            if self.tier.acquire_lease(cache_key):
                # On a plain miss, the previous holder may have published and released between our lookup and
                # our lease: look once more (an entry just rejected is not read, nor counted, twice).
                stored = None if held else self._find_trace(cache_key)[0]
                if stored is None:
                    self._leases.add(cache_key)
                    self._count_tier_miss(inst, cache_key, MissObservation(self._tier_down, rejected=held))
                    return None
                self.tier.release_lease(cache_key)
            else:
                self.lease_waits += 1
                waited = True
                stored = self._accepted(cache_key, self.tier.wait_for_trace(cache_key))
        if stored is None:
            self._count_tier_miss(inst, cache_key, MissObservation(self._tier_down, held, lease_timed_out=waited))
            return None
        if stored.result["format"] == FAILED:  # this compiler fails on it: the same error, without compiling it again
            self.known_failures += 1
            raise KernelCompileError(stored.result["binary"].decode())
        self.remote_hits += 1
        self.tier_saved_seconds += stored.compile_seconds
        self._compile_seconds[cache_key] = stored.compile_seconds
        return dict(stored.result)

    def _count_tier_miss(self, inst: InternalNkiKernel, cache_key: str, seen: MissObservation) -> None:
        """Count a tier miss under its cause (bridge.miss_causes), for the pass and for its kernel."""
        facts = None if self._variant_facts is None else self._variant_facts.get(cache_key)
        self._count_cause(inst, cache_key, classify_miss(seen, facts))

    def _count_cause(self, inst: InternalNkiKernel, cache_key: str, cause: str) -> None:
        self.miss_causes[cause] += 1
        self.kernel_miss_causes[inst.kernel_name][cause] += 1
        logger.debug("Tier miss for %s (cache key: %s...): %s", inst.func_name, cache_key[:CACHE_KEY_LOG_PREFIX], cause)

    def _take_traced_elsewhere(self, inst: InternalNkiKernel, cache_key: str) -> dict | None:
        """On a local miss, the trace a trace task made of this variant for this pass, else None. It is taken as
        a remote hit is taken, and counted apart: the tier did not hold it (when the tier reads, it was asked,
        for the whole compile at once, and missed: a tier lookup, whose cause the plan found), and the pass
        did not trace it."""
        traced = self._own_compilers(cache_key, self.traced_elsewhere.pop(cache_key, None))
        if traced is None:
            return None
        if self._tier_reads():
            self.tier_lookups += 1
            self._count_cause(inst, cache_key, traced.miss_cause)
        self._count_trace(traced)
        if traced.failure is not None:  # its trace task failed, and stored the failure: the pass fails the same way
            raise KernelCompileError(traced.failure)
        self._compile_seconds[cache_key] = traced.seconds
        return dict(traced.result)

    def _own_compilers(self, cache_key: str, traced: TracedVariant | None) -> TracedVariant | None:
        """`traced` when this very compiler made it, else None, counted in traces_refused: the process that
        traced it ran other code than this one (imported from elsewhere), and the pass traces it itself."""
        if traced is None or traced.toolchain == toolchain_id():
            return traced
        self.traces_refused += 1
        logger.warning(
            "Refused a trace of %s... handed over by toolchain %r, not this compiler's (%s): traced here",
            cache_key[:CACHE_KEY_LOG_PREFIX],
            traced.toolchain,
            toolchain_id(),
        )
        return None

    def _count_trace(self, traced: TracedVariant) -> None:
        """A trace made for this pass by another process or ahead of it: counted as the pass's own trace."""
        self.traces += 1
        self.parallel_traces += int(traced.elsewhere)
        self.trace_seconds += traced.seconds

    def _find_trace(self, cache_key: str) -> tuple[StoredTrace | None, bool]:
        traces, held = self.tier.find_traces([cache_key])
        return self._accepted(cache_key, traces.get(cache_key)), cache_key in held

    def _accepted(self, cache_key: str, stored: StoredTrace | None) -> StoredTrace | None:
        """`stored` when it is what a fresh trace under `cache_key` would give, else the next copy the tier has
        that is (a stack's farther level), else None. Each refused one is told to the tier, which counts it in
        tier_rejected: a store's digest and signature say an entry is intact, not that it belongs under the key
        it was read from."""
        while stored is not None:
            problem = stored_trace_problem(cache_key, stored)
            if problem is None:
                return stored
            if not self.tier.reject(cache_key, problem):
                return None
            stored = self.tier.find_traces([cache_key])[0].get(cache_key)
        return None

    def _op_key(self, inst: InternalNkiKernel) -> tuple[dict[str, Any], str]:
        """(key components, cache key) of `inst`: the prefetch's when it computed them, else computed now."""
        known = self._op_keys.pop(id(inst), None)
        if known is not None and known[0] is inst:
            return known[1], known[2]
        key_components = self._key_components(inst)
        return key_components, self._compute_cache_key_from_components(key_components)

    def _prefetch_from_tier(self, graph: Graph) -> None:
        """Ask the tier for every kernel variant of the graph in one round trip, instead of one per miss.
        Entries are used (and counted as remote hits) only when the orchestrator misses on them. Each op's key
        is kept for the orchestrator, which would otherwise compute it a second time."""
        if not self._tier_reads():
            return
        for op in graph.ops:
            if isinstance(op, InternalNkiKernel):
                key_components = self._key_components(op)
                self._op_keys[id(op)] = (op, key_components, self._compute_cache_key_from_components(key_components))
        components = {cache_key: key_components for _, key_components, cache_key in self._op_keys.values()}
        traces, self._prefetch_stored = self.tier.find_traces(sorted(components))
        self._prefetched = {key: traces.get(key) for key in components}
        # For a pass that will miss, one more round trip: what the tier's index knows of the absent keys.
        self._tier_down, self._variant_facts = facts_of_absent(self.tier, components, self._prefetch_stored)

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

    def _trace_and_publish(self, inst: InternalNkiKernel, cache_key: str, key_components: dict) -> dict:
        holds_lease = cache_key in self._leases
        self._leases.discard(cache_key)
        ahead = self._own_compilers(cache_key, self.traced_ahead.pop(cache_key, None))
        started = time.perf_counter()
        try:
            result = dict(ahead.result) if ahead else self._trace_internal_kernel_to_new_nki_frontend(inst, cache_key)
        except NkiCacheError as exc:  # the kernel cannot compile: remembered (a negative entry), the lease released
            if self.tier is not None:
                self.tier.publish_failure(cache_key, key_components, " ".join(str(exc).split()), holds_lease)
            raise
        except BaseException:
            if holds_lease:
                self.tier.release_lease(cache_key)
            raise
        if ahead is not None:
            self._count_trace(ahead)
            if ahead.failure is not None:  # traced ahead and failed: remembered here, the pass fails the same way
                if self.tier is not None:
                    self.tier.publish_failure(cache_key, key_components, ahead.failure, holds_lease)
                raise KernelCompileError(ahead.failure)
        seconds = self._compile_seconds[cache_key] = ahead.seconds if ahead else time.perf_counter() - started
        if self.tier is not None:
            self.tier.publish_trace(cache_key, result, key_components, seconds, release_lease=holds_lease)
        return result

    def _note_use(self, cache_key: str) -> None:
        now = time.time()
        first, _ = self.key_use_times.get(cache_key, (now, now))
        self.key_use_times[cache_key] = (first, now)

    def tier_counts(self) -> dict[str, int]:
        """Tier errors, timeouts, rejections and drops during this pass."""
        if self.tier is None:
            return dict.fromkeys(TIER_COUNTERS, 0)
        now = self.tier.counts()
        return {name: now.get(name, 0) - self.tier_counts_at_start.get(name, 0) for name in TIER_COUNTERS}

    def pass_summary(self) -> dict[str, float]:
        """This pass's counters (bridge.port.PASS_COUNTERS), as `nkicache compile --json` and the reports
        name them."""
        return {
            "passes": 1,
            "kernels": self.cache_hits + self.cache_misses,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "remote_hits": self.remote_hits,
            "tier_lookups": self.tier_lookups,
            "traces": self.traces,
            "parallel_traces": self.parallel_traces,
            "traces_refused": self.traces_refused,
            "known_failures": self.known_failures,
            "compile_seconds": round(self.trace_seconds, 6),
            "tier_saved_seconds": round(self.tier_saved_seconds, 6),
            "in_pass_saved_seconds": round(self.in_pass_saved_seconds, 6),
            "lease_waits": self.lease_waits,
            **self.tier_counts(),
            **{f"misses_{cause}": count for cause, count in self.miss_causes.items()},
        }

    def pass_record(self, graph_name: str, started: float, finished: float) -> PassRecord:
        """What this pass tells the store: its counts and how it used each kernel variant."""
        variants = {}
        for cache_key, components in self._cache_key_components.items():
            first, last = self.key_use_times.get(cache_key, (started, finished))
            usage = self._cache_usage_counts.get(cache_key, 0)
            variants[cache_key] = VariantUse(components["kernel_name"], usage, first, last)
        kernel_misses = {kernel: dict(causes) for kernel, causes in sorted(self.kernel_miss_causes.items())}
        return PassRecord(graph_name, self.pass_id, started, finished, self.pass_summary(), variants, kernel_misses)

    def finish_pass(self, graph_name: str, started: float) -> None:
        """Hand this pass's metrics to the tier, without waiting for the tier to store them (nor the pass's
        entries): the store writes behind, and a caller that needs them stored when it goes on (a fleet job
        acknowledged, a process about to exit) calls the store's `flush` or `close` itself."""
        if self.tier is None:
            return
        self.tier.record_pass(self.pass_record(graph_name, started, time.time()))

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
        started = time.time()
        self._prefetch_from_tier(graph)
        for index, op in enumerate(graph.ops):
            codegen = dispatch.get(type(op).__name__)
            if codegen is None:
                raise NkiCacheError(f"{graph.source}: op {index}: no codegen for {type(op).__name__}")
            try:
                codegen(op, bb)
            except NkiCacheError as exc:
                raise OpCodegenError(graph.source, index, op, exc) from exc
        self.afterStmtTransform()
        self.finish_pass(graph.name, started)
        return bb


def _share(count: int, total: int) -> str:
    """`count` as a percentage of `total` for the statistics, 'n/a' of none: a cache filled before anything was
    looked up has processed nothing, which is no 100% miss rate."""
    return format(100.0 * count / total, ".1f") + "%" if total else "n/a"


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


def _failure_text(message: object) -> bool:
    """Whether a negative entry's message is one line of text a pass can fail with."""
    if not isinstance(message, bytes) or not 0 < len(message) <= MAX_FAILURE_BYTES:
        return False
    try:
        return message.decode().isprintable()
    except UnicodeDecodeError:
        return False


@functools.lru_cache(maxsize=64)
def _key_loop(target_name: str) -> BirCodeGenLoop:
    """A loop for `target_name`, kept for the key rule alone (which reads only its target): verify recomputes
    the key of every entry, and building a loop and its target each time was a fifth of its time."""
    try:
        return BirCodeGenLoop(make_target(target_name))
    except NkiCacheError as exc:
        raise ValueError(str(exc)) from None


def stored_trace_problem(cache_key: str, stored: StoredTrace) -> str | None:
    """Why a stored trace is not what this loop would emit under `cache_key`, or None. It must come from this
    very compiler (another toolchain's binary is what that compiler made), the bridge emits only 'bir' (the
    dispatcher never takes beta2), and an entry's key components must hash to the key it was read under,
    through the loop's own key rule: otherwise it is another variant's binary."""
    if stored.toolchain != toolchain_id():
        return f"traced by toolchain {stored.toolchain!r}, not by this compiler ({toolchain_id()})"
    if stored.result.get("format") == FAILED:
        if not _failure_text(stored.result.get("binary")):
            return "a failure entry without a readable message"
    elif stored.result.get("format") != "bir":
        return f"format {stored.result.get('format')!r}: the bridge only emits 'bir'"
    if not isinstance(stored.compile_seconds, int | float) or not 0 <= stored.compile_seconds < math.inf:
        return f"compile_seconds {stored.compile_seconds!r} is not a finite number >= 0"  # it enters every sum
    try:
        actual = cache_key_of_stored(stored.key_components)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        return f"key components are malformed: {exc}"
    if actual != cache_key:
        return f"key components hash to {actual[:16]}..., not to the key it was read under"
    return None
