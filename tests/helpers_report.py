"""A fleet run whose counts are known in advance, on the local tier or a real Redis, and the command line
pointed at it (the report and inspection tests share them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result
from helpers_graphs import delete_namespace, mixed_graph, unique_namespace

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from cachestore.backends.redis import RedisBackend
from cachestore.backends.sqlite import SqliteBackend
from cachestore.keys import KeySpace
from cachestore.settings import Settings
from cachestore.stores import open_tier

# Three passes of the mixed graph (8 kernel ops, 6 distinct keys, 2 local hits per pass), one at a time:
#   hostA/w1 rows=64: all 6 keys traced;  hostB/w2 rows=64: all 6 from the tier;
#   hostA/w1 rows=96: its 2 Matmul keys are new (traced), the other 4 come from the tier.
FLEET_RUN = (("hostA", "w1", 64), ("hostB", "w2", 64), ("hostA", "w1", 96))
EXPECTED_TOTALS = {
    "passes": 3, "kernels": 24, "cache_hits": 6, "cache_misses": 18, "tier_lookups": 18, "remote_hits": 10, "traces": 8,
    "lease_waits": 0, "tier_errors": 0, "tier_timeouts": 0, "tier_rejected": 0, "tier_dropped": 0,
}  # fmt: skip
# Read-through: every in-pass miss asks the tier.
EXPECTED_SHARED_HIT_RATE = 10 / 18  # remote_hits / tier_lookups
EXPECTED_IN_PASS_HIT_RATE = 6 / 24  # cache_hits / kernels
EXPECTED_WORKERS = {
    ("hostA", "w1"): {
        "passes": 2,
        "kernels": 16,
        "cache_hits": 4,
        "cache_misses": 12,
        "tier_lookups": 12,
        "remote_hits": 4,
        "traces": 8,
    },
    ("hostB", "w2"): {
        "passes": 1,
        "kernels": 8,
        "cache_hits": 2,
        "cache_misses": 6,
        "tier_lookups": 6,
        "remote_hits": 6,
        "traces": 0,
    },
}
# Per kernel name, as _export_new_nki_fe_metrics would record it over the three passes.
EXPECTED_KERNELS = {
    "matmul_tiled": {"call_count": 9, "variants": 4},
    "softmax": {"call_count": 9, "variants": 2},
    "rmsnorm": {"call_count": 6, "variants": 2},
}
EXPECTED_VARIANTS = 8
# The most used variant: Softmax on [32, 48], twice per pass.
TOP_VARIANT = {"kernel_name": "softmax", "usage": 6, "operand_shapes": [[32, 48]], "result_shapes": [[32, 48]]}
SECOND_VARIANT = {"kernel_name": "matmul_tiled", "usage": 4, "operand_shapes": [[64, 32], [64, 48]],
                  "result_shapes": [[32, 48]]}  # fmt: skip


@dataclass
class Tier:
    kind: str
    url: str
    namespace: str
    backend: Any  # a backend of our own on the same store
    client: Any = None  # the redis-py client, for the Redis tier

    def settings(self, **changes: Any) -> Settings:
        return Settings(tier=self.url, namespace=self.namespace, **changes)

    def env(self, **extra: str) -> dict[str, str]:
        return {"NKICACHE_NAMESPACE": self.namespace, "NKICACHE_TIER": self.url, **extra}


def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    namespace = unique_namespace()
    if request.param == "local":
        path = tmp_path / "tier.sqlite"
        backend = SqliteBackend(path)
        yield Tier("local", f"local:{path}", namespace, backend)
        backend.close()
        return
    url = request.getfixturevalue("redis_url")
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        yield Tier("redis", url, namespace, RedisBackend(client, KeySpace(namespace)), client)
    finally:
        delete_namespace(client, namespace)
        client.close()


def run_known_fleet(tier: Tier, **settings: Any) -> list[BirCodeGenLoop]:
    """The three passes of FLEET_RUN, each with its own tier client (its own host and worker)."""
    loops = []
    for host, worker, rows in FLEET_RUN:
        client = open_tier(tier.settings(host=host, worker=worker, **settings))
        loop = BirCodeGenLoop(tier=client)
        loop.run(load_graph(mixed_graph(f"mixed-{rows}", rows=rows)))
        assert client.flush(timeout=10), "the tier did not take the pass's writes"
        client.close(timeout=10)
        loops.append(loop)
    return loops


def nkicache(tier: Tier | None, *args: str, env: dict[str, str] | None = None, input: str | None = None) -> Result:
    from workers.cli import main

    environment = {**(tier.env() if tier else {}), **(env or {})}
    return CliRunner().invoke(main, list(args), env=environment, input=input, catch_exceptions=False)
