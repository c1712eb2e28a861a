"""Tiers, writer keys and clients for the trust tests (test_scopes, test_sentinel)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers_graphs import delete_namespace, unique_namespace

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from cachestore.client import TierClient
from cachestore.entry import SignaturePolicy
from cachestore.settings import Settings
from cachestore.stores import open_tier
from cachestore.trust import TrustPolicy, WriterKey, write_writer_key


def fresh_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """Settings of one fresh tier (request.param "local": an embedded file; "redis": a namespace of its own on
    the test Redis, deleted afterwards)."""
    if request.param == "local":
        yield Settings(tier=f"local:{tmp_path / 'tier.sqlite'}", host="h", flush_interval=0.05)
        return
    import redis

    url = request.getfixturevalue("redis_url")
    namespace = unique_namespace()
    yield Settings(tier=url, namespace=namespace, host="h", flush_interval=0.05)
    client = redis.Redis.from_url(url)
    delete_namespace(client, namespace)
    client.close()


def writer_keys(directory: Path) -> dict[str, Any]:
    """Two writer keys, ci and laptop, and a trust policy that lists ci alone."""
    ci = write_writer_key(directory / "ci.key", "ci")
    laptop = write_writer_key(directory / "laptop.key", "laptop")
    policy = directory / "trust.toml"
    policy.write_text(ci.policy_entry("ci"))
    return {"ci": ci, "laptop": laptop, "policy": str(policy), "dir": directory}


def client_of(base: Settings, keys: dict[str, Any], writer: str | None, **changes: Any) -> TierClient:
    key_file = str(keys["dir"] / f"{writer}.key") if writer else ""
    client = open_tier(base.replace(writer_key_file=key_file, trust_policy=keys["policy"], worker=writer or "r",
                                    **changes))  # fmt: skip
    assert client is not None
    return client


def compile_with(client: TierClient, graph: dict) -> BirCodeGenLoop:
    loop = BirCodeGenLoop(tier=client)
    loop.run(load_graph(graph))
    client.flush(10)
    return loop


def trust_of(*writers: WriterKey) -> TrustPolicy:
    """A trust policy listing `writers`."""
    policy = TrustPolicy([])
    for writer in writers:
        policy = policy.adding(writer, "w")
    return policy


def trusting(*writers: WriterKey) -> SignaturePolicy:
    """A reader's signature policy trusting `writers`."""
    return SignaturePolicy(trust=trust_of(*writers))
