"""`miss_cause_coverage` and `miss_classification_overhead` for `nkicache bench`: a workload built so that
every cause of a tier miss (bridge.miss_causes) happens, compiled against Redis, and what share of its tier
misses got a cause other than `unknown`; and the share of a cold compile's time spent finding the causes
(the variant index read that a pass with misses makes once)."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from bridge.codegen import BirCodeGenLoop, kernel_cache_key
from bridge.graph import Graph, load_graph
from bridge.ir import InternalNkiKernel
from bridge.miss_causes import MISS_CAUSES
from bridge.targets import make_target
from cachestore.api import WriteItem
from cachestore.client import TierClient
from cachestore.keys import partition
from cachestore.settings import load_settings
from cachestore.stores import open_backend, open_tier

NAMESPACE = "nkibench-misses"
OTHER_TOOLCHAIN = "bench0ther0tc000"  # 16 characters, as a toolchain id


def miss_cause_coverage(graphs: list[Graph], redis_url: str) -> dict[str, Any]:
    # The faults this workload makes on purpose (a rejected entry, a dead lease holder, a closed port) would
    # each print a warning on the bench's stderr.
    with _quiet("cachestore"):
        return _miss_cause_coverage(graphs, redis_url)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _miss_cause_coverage(graphs: list[Graph], redis_url: str) -> dict[str, Any]:
    if len(graphs) < 2:
        raise ValueError("the miss-cause workload needs at least 2 graphs")
    settings = _settings(redis_url)
    causes: Counter[str] = Counter()
    first, second = graphs[:2]
    foreign = _rmsnorm_graph("foreign", rows=96, eps=1e-6)

    other = _other_toolchain_client(settings)
    _compile(other, foreign, causes=Counter())  # stored by another compiler before ours ever asks
    other.close(timeout=30)

    ours = open_tier(settings)
    spent = _time_variant_facts(ours)
    started = time.perf_counter()
    keys = {graph.name: _compile(ours, graph, causes) for graph in graphs}  # new variants and shapes
    cold_seconds = time.perf_counter() - started
    _compile(ours, _rmsnorm_graph("eps-a", rows=80, eps=1e-6), causes)  # new_shape (or new_variant)
    _compile(ours, _rmsnorm_graph("eps-b", rows=80, eps=1e-5), causes)  # attrs_differ
    _compile(ours, first, causes, target=_other_target(first))  # target_differs
    backend = ours._backend
    evicted, rejected = sorted(keys[first.name])[:2], sorted(keys[second.name])[:1]
    backend.delete_entries(list(evicted))
    backend.put_entries([WriteItem(key, b"NKC\x03 not an entry", None, 3600) for key in rejected])
    _compile(ours, first, causes)  # evicted
    _compile(ours, second, causes)  # rejected
    leased = _rmsnorm_graph("leased", rows=112, eps=1e-6)
    for key in _keys_of(leased):
        backend.acquire_lease(key, "a-worker-that-died", 60)
    _compile(ours, leased, causes)  # lease_timeout
    _compile(ours, foreign, causes)  # other_toolchain
    ours.close(timeout=30)

    down = open_tier(load_settings({"tier": f"redis://127.0.0.1:{_closed_port()}/0", "connect_timeout": 0.3}))
    _compile(down, first, causes)  # tier_unavailable
    down.close(timeout=0.1)

    total = sum(causes.values())
    return {
        "miss_cause_coverage": 1 - causes["unknown"] / total if total else 0.0,
        "miss_classification_overhead": 1 + spent[0] / cold_seconds,
        "tier_misses": total,
        "by_cause": {cause: causes[cause] for cause in MISS_CAUSES},
        "causes_missing": [cause for cause in MISS_CAUSES if cause != "unknown" and not causes[cause]],
        "cold_seconds": cold_seconds,
        "classification_seconds": spent[0],
        "graphs": len(graphs),
    }


def _rmsnorm_graph(name: str, rows: int, eps: float, cols: int = 64) -> Graph:
    """One RMSNorm op: the variants the workload's models may not have (a kernel with attrs, odd row counts)."""
    tensors = {
        "x": {"shape": [rows, cols], "dtype": "float32"},
        "g": {"shape": [cols], "dtype": "float32"},
        "y": {"shape": [rows, cols], "dtype": "float32"},
    }
    op = {
        "type": "InternalNkiKernel",
        "func_name": "RMSNorm",
        "kernel_name": "rmsnorm",
        "operands": ["x", "g"],
        "results": ["y"],
        "attrs": {"eps": eps},
    }
    return load_graph({"name": f"miss-{name}", "tensors": tensors, "ops": [op]})


def _settings(redis_url: str) -> Any:
    # Single flight on, with a short lease_wait: the lease the bench holds for a dead worker runs out quickly.
    return load_settings({"tier": redis_url, "namespace": NAMESPACE, "lease_wait": 0.3})


def _other_toolchain_client(settings: Any) -> TierClient:
    client = TierClient(
        partial(open_backend, settings, partition=partition(OTHER_TOOLCHAIN)), settings, "other compiler"
    )
    client.toolchain = OTHER_TOOLCHAIN
    return client


def _compile(tier: Any, graph: Graph, causes: Counter[str], target: str | None = None) -> set[str]:
    loop = BirCodeGenLoop(make_target(target or graph.target or "Trn2"), tier=tier)
    loop.run(graph)
    tier.flush(30)  # the pass does not wait for its writes; the next compile's diagnosis reads them
    causes.update(loop.miss_causes)
    return set(loop._cache_key_components)


def _keys_of(graph: Graph) -> set[str]:
    target = make_target(graph.target or "Trn2")
    return {kernel_cache_key(op, target)[0] for op in graph.ops if isinstance(op, InternalNkiKernel)}


def _other_target(graph: Graph) -> str:
    return "Trn1" if (graph.target or "Trn2") == "Trn2" else "Trn2"


def _time_variant_facts(tier: TierClient) -> list[float]:
    """Wrap the client's variant index read so that the seconds it takes add up in the returned list."""
    spent = [0.0]
    real: Callable = tier.variant_facts

    def timed(misses: Any) -> Any:
        started = time.perf_counter()
        try:
            return real(misses)
        finally:
            spent[0] += time.perf_counter() - started

    tier.variant_facts = timed  # type: ignore[method-assign]
    return spent


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
