"""The compiler behind its port: bridge imports nothing of cachestore, any `bridge.port.KernelStore` plugs
into the loop, and the key rule that checks stored entries is the loop's own."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from helpers_graphs import MIXED_DISTINCT_KEYS, MIXED_KERNEL_OPS, binary_digests, mixed_graph

from bridge.codegen import BirCodeGenLoop, cache_key_of_stored
from bridge.graph import load_graph
from bridge.identity import toolchain_id
from bridge.miss_causes import VariantFacts
from bridge.port import (
    PASS_COUNTERS,
    TIER_COUNTERS,
    KernelStore,
    PassRecord,
    StoredTrace,
    in_pass_hit_rate,
    shared_hit_rate,
)
from bridge.targets import make_target


class DictStore:
    """A KernelStore in a dict: what a store must do for the loop, and nothing of cachestore."""

    reads = True
    writes = True
    single_flight = False
    available = True

    def __init__(self) -> None:
        self.traces: dict[str, StoredTrace] = {}
        self.passes: list[PassRecord] = []
        self.rejected: dict[str, str] = {}

    def find_traces(self, cache_keys: Sequence[str]) -> tuple[dict[str, StoredTrace], set[str]]:
        found = {key: self.traces[key] for key in cache_keys if key in self.traces}
        return found, set(found)

    def acquire_lease(self, cache_key: str) -> bool:
        return True

    def release_lease(self, cache_key: str) -> None:
        pass

    def wait_for_trace(self, cache_key: str) -> StoredTrace | None:
        return None

    def variant_facts(self, misses: Mapping[str, Mapping[str, Any]]) -> dict[str, VariantFacts]:
        kernels = {trace.key_components["kernel_name"] for trace in self.traces.values()}
        return {key: VariantFacts(kernel_stored=parts["kernel_name"] in kernels) for key, parts in misses.items()}

    def reject(self, cache_key: str, reason: str) -> None:
        self.rejected[cache_key] = reason

    def publish_trace(self, cache_key: str, result: dict, key_components: Mapping[str, Any], compile_seconds: float,
                      release_lease: bool = False) -> None:  # fmt: skip
        self.traces[cache_key] = StoredTrace(dict(result), compile_seconds, dict(key_components), toolchain_id())

    def record_pass(self, record: PassRecord) -> None:
        self.passes.append(record)

    def send_now(self) -> None:
        pass

    def flush(self) -> bool:
        return True

    def counts(self) -> dict[str, int]:
        return dict.fromkeys(TIER_COUNTERS, 0)


def test_bridge_imports_nothing_of_cachestore() -> None:
    code = (
        "import sys, bridge, bridge.codegen, bridge.port, bridge.toolchain, bridge.graph_runner, bridge.artifact\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('cachestore', 'workers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_any_kernel_store_plugs_into_the_loop() -> None:
    store: KernelStore = DictStore()
    graph = load_graph(mixed_graph())
    cold = BirCodeGenLoop(make_target("Trn2"), tier=store)
    cold_bb = cold.run(graph)
    warm = BirCodeGenLoop(make_target("Trn2"), tier=store)
    warm_bb = warm.run(graph)
    assert (cold.traces, cold.remote_hits) == (MIXED_DISTINCT_KEYS, 0)
    assert (warm.traces, warm.remote_hits) == (0, MIXED_DISTINCT_KEYS)
    assert binary_digests(warm_bb) == binary_digests(cold_bb)
    # Each pass handed over its own record, built by the loop from its three maps.
    first, second = store.passes
    assert set(first.counts) == set(PASS_COUNTERS)
    assert first.counts["kernels"] == second.counts["kernels"] == MIXED_KERNEL_OPS
    assert sum(use.usage for use in first.variants.values()) == MIXED_KERNEL_OPS
    assert set(first.variants) == set(store.traces)
    # Every in-pass miss asked the store; the second pass found all of them there.
    assert first.counts["tier_lookups"] == second.counts["tier_lookups"] == first.counts["cache_misses"]
    assert shared_hit_rate(second.counts) == 1.0 and shared_hit_rate(first.counts) == 0.0
    assert in_pass_hit_rate(second.counts) == in_pass_hit_rate(first.counts) < 1.0
    # The store's facts gave each of the first pass's tier misses its cause.
    assert first.counts["misses_new_variant"] == MIXED_DISTINCT_KEYS
    assert first.kernel_misses == {"matmul_tiled": {"new_variant": 2}, "rmsnorm": {"new_variant": 2},
                                   "softmax": {"new_variant": 2}}  # fmt: skip


def test_stored_components_hash_to_the_key_the_loop_made() -> None:
    store = DictStore()
    BirCodeGenLoop(make_target("Trn1"), tier=store).run(load_graph(mixed_graph()))
    for key, trace in store.traces.items():
        # As msgpack brings them back: every tuple a list.
        stored = {name: _as_lists(value) for name, value in trace.key_components.items()}
        assert cache_key_of_stored(stored) == key


def test_stored_components_the_loop_cannot_have_built_are_refused() -> None:
    store = DictStore()
    BirCodeGenLoop(make_target("Trn2"), tier=store).run(load_graph(mixed_graph()))
    components = dict(next(iter(store.traces.values())).key_components)
    with pytest.raises(ValueError, match="no target"):
        cache_key_of_stored({k: v for k, v in components.items() if k != "target"})
    with pytest.raises(ValueError, match="unknown target"):
        cache_key_of_stored({**components, "target": "Trn9"})
    with pytest.raises(ValueError, match="num_neuroncores"):
        cache_key_of_stored({**components, "num_neuroncores": components["num_neuroncores"] + 1})


def _as_lists(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_as_lists(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _as_lists(v) for k, v in value.items()}
    return value


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -1.0, "1"])
def test_a_stored_trace_with_a_time_that_is_not_a_finite_number_is_refused(seconds: object) -> None:
    store = DictStore()
    graph = load_graph(mixed_graph())
    BirCodeGenLoop(make_target("Trn2"), tier=store).run(graph)
    key, trace = next(iter(store.traces.items()))
    store.traces[key] = StoredTrace(trace.result, seconds, trace.key_components, trace.toolchain)  # type: ignore[arg-type]
    loop = BirCodeGenLoop(make_target("Trn2"), tier=store)
    loop.run(graph)
    assert "not a finite number" in store.rejected[key]
    assert (loop.traces, loop.remote_hits) == (1, MIXED_DISTINCT_KEYS - 1) and math.isfinite(loop.tier_saved_seconds)
