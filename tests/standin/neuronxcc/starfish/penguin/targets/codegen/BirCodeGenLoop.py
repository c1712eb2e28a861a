"""A stand-in of neuronx-cc's BirCodeGenLoop, written from the specification's roster alone
(`../shared/seeds/000_5f48db0a07319a91.txt`), at neuronx-cc's import path. It is NOT neuronx-cc: the tests of
`nkicache exec` compile it with Cython, as neuronx-cc's module is compiled, and attach the tier to it through
the specification's seams. Its trace leaf does real work: the beta3 compile of nkicache's own kernel library.
"""

import hashlib
import logging
import os
from collections import defaultdict

from bridge.ir import NKIKLIRKernel
from bridge.metrics import KernelCategory, KernelMetricsCollector
from bridge.targets import get_platform_target
from bridge.toolchain import compile_kernel

logger = logging.getLogger("neuronxcc.standin")


class BirCodeGenLoop:
    def __init__(self, target=None):
        self.target = target if target is not None else get_platform_target()
        self._new_nki_frontend_kernel_cache = {}
        self._cache_key_components = {}
        self._cache_usage_counts = {}
        self.cache_hits = 0
        self.cache_misses = 0

    def codegenInternalNativeNkiKernel(self, inst, bb):
        """Codegen for internal NKI kernels using new NKI frontend path.
        Traces the kernel to new NKI frontend at codegen time and creates BIR NKIKLIRKernel instruction.
        Uses caching to avoid redundant tracing of identical kernels."""
        os.environ.get("nki_frontend", "beta2")  # noqa: SIM112 - the specification's lowercase key, read as data
        key_components = {
            "kernel_name": inst.kernel_name,
            "operands": self._extract_tensor_info(inst.operands),
            "results": self._extract_tensor_info(inst.results),
            "attrs": inst.get_attrs_dict(),
        }
        if inst.func_name == "ResizeNearest":
            key_components["out_shape"] = self._extract_tensor_info(inst.results[:1])["shapes"][0]
        cache_key = self._compute_cache_key_from_components(key_components)
        result = self._get_cached_new_nki_frontend_binary(cache_key)
        if result is not None:
            self.cache_hits += 1
            self._record_cache_usage(cache_key)
        else:
            self.cache_misses += 1
            logger.info("Cache miss for %s (cache key: %s...)", inst.func_name, cache_key[:16])
            result = self._trace_internal_kernel_to_new_nki_frontend(inst, cache_key)
            self._cache_new_nki_frontend_binary(cache_key, result, key_components)
        kernel = NKIKLIRKernel(inst.kernel_name, [t.name for t in inst.operands], [t.name for t in inst.results])
        kernel.set_klir_binary(result["binary"])
        kernel.set_kernel_format(result["format"])
        kernel.set_nki_binary_version_identifier("stand-in")
        kernel.set_func_args(result["input_names"])
        kernel.set_func_outs(result["output_names"])
        bb.addInstruction(kernel)

    def _extract_tensor_info(self, tensors):
        """Helper to extract shape and dtype info from tensors for cache key."""
        result = {"shapes": [], "dtypes": []}
        for t in tensors:
            try:
                shape = t.access_shape
            except AttributeError:
                shape = t.shape
            result["shapes"].append(shape)
            result["dtypes"].append(t.dtype)
        return result

    def _compute_cache_key_from_components(self, key_components):
        """Compute a cache key from key components."""
        key_components["target"] = self.target.__class__.__name__
        key_components["num_neuroncores"] = self.target.num_neuroncores_per_sengine
        key_str = str(sorted(key_components.items()))
        return hashlib.sha256(key_str.encode()).hexdigest()

    def _get_cached_new_nki_frontend_binary(self, cache_key):
        return self._new_nki_frontend_kernel_cache.get(cache_key)

    def _cache_new_nki_frontend_binary(self, cache_key, binary, key_components):
        self._new_nki_frontend_kernel_cache[cache_key] = binary
        self._cache_key_components[cache_key] = key_components
        self._cache_usage_counts[cache_key] = 1

    def _record_cache_usage(self, cache_key):
        if cache_key in self._cache_usage_counts:
            self._cache_usage_counts[cache_key] += 1

    def _trace_internal_kernel_to_new_nki_frontend(self, inst, cache_key):
        """Trace an internal NKI kernel using beta2 (KLIR) or beta3 (BIR) path.
        Environment variable NKI_FRONTEND controls the path:
        - "beta2": Use beta2 KLIR tracing (default)
        - "beta3": Use beta3 BIR compilation
        Returns a dict with keys: 'binary', 'input_names', 'output_names', 'format' ('klir' or 'bir')."""
        leaf = self._trace_kernel_beta3
        args = (inst, cache_key)
        return leaf(*args)

    def _trace_kernel_beta3(self, inst, cache_key):
        return compile_kernel(inst.func_name, inst.operands, inst.results, inst.get_attrs_dict(), target=self.target)

    def _trace_kernel_beta2(self, inst, cache_key):
        raise NotImplementedError("the dormant leaf: no caller")

    def _print_new_nki_frontend_cache_statistics(self):
        total = self.cache_hits + self.cache_misses
        if not self._new_nki_frontend_kernel_cache and total == 0:
            return
        logger.debug("New NKI Frontend Kernel Cache Statistics")
        logger.debug("Total kernels processed: " + str(total))

    def _export_new_nki_fe_metrics(self):
        """Export new NKI FE kernel metrics to the collector."""
        if not self._cache_key_components:
            return
        collector = KernelMetricsCollector.get_instance()
        agg = defaultdict(lambda: {"call_count": 0, "variances": 0})
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

    def afterStmtTransform(self):
        self._export_new_nki_fe_metrics()
        self._print_new_nki_frontend_cache_statistics()
