"""Read-through asks the tier for a whole graph's kernel variants in one round trip."""

from __future__ import annotations

from pathlib import Path

from helpers_graphs import MIXED_DISTINCT_KEYS, MIXED_KERNEL_OPS, binary_digests, mixed_graph

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from cachestore.backends.sqlite import SqliteBackend
from cachestore.client import TierClient
from cachestore.settings import Settings


class CountingTier(SqliteBackend):
    def __init__(self, path: Path):
        super().__init__(path)
        self.fetches: list[int] = []

    def fetch(self, cache_keys, ttl):
        self.fetches.append(len(cache_keys))
        return super().fetch(cache_keys, ttl)


def _client(backend: SqliteBackend, **changes) -> TierClient:
    return TierClient(lambda: backend, Settings(tier="test", flush_interval=0.05, **changes), "test")


def test_a_warm_pass_fetches_every_variant_in_one_round_trip(tmp_path: Path) -> None:
    graph = load_graph(mixed_graph())
    backend = CountingTier(tmp_path / "tier.sqlite")
    cold_client = _client(backend)
    cold = BirCodeGenLoop(tier=cold_client)
    cold_bb = cold.run(graph)
    assert cold.traces == MIXED_DISTINCT_KEYS
    cold_client.close()

    backend.fetches.clear()
    warm = BirCodeGenLoop(tier=_client(backend))
    warm_bb = warm.run(graph)
    assert backend.fetches == [MIXED_DISTINCT_KEYS]  # one fetch for the graph, none per op
    assert (warm.traces, warm.remote_hits) == (0, MIXED_DISTINCT_KEYS)
    assert (warm.cache_hits, warm.cache_misses) == (MIXED_KERNEL_OPS - MIXED_DISTINCT_KEYS, MIXED_DISTINCT_KEYS)
    assert binary_digests(warm_bb) == binary_digests(cold_bb)


def test_a_cold_pass_does_not_look_again_for_what_the_prefetch_missed(tmp_path: Path) -> None:
    backend = CountingTier(tmp_path / "tier.sqlite")
    loop = BirCodeGenLoop(tier=_client(backend, single_flight=False))
    loop.run(load_graph(mixed_graph()))
    assert backend.fetches == [MIXED_DISTINCT_KEYS]
    assert loop.traces == MIXED_DISTINCT_KEYS
