"""Scopes (issue 22): an untrusted writer works in a partition of its own (cachestore.keys.partition), so a
trusted reader never reads its entries, never waits on its leases, and its entries never replace, deduplicate
against or evict a trusted writer's; entries it plants in the trusted scope are rejected. On the embedded tier
and on Redis."""

from __future__ import annotations

import json
import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers_graphs import MIXED_DISTINCT_KEYS, mixed_graph
from helpers_trust import client_of, compile_with, fresh_tier, writer_keys
from test_entry import make_entry

from bridge.identity import toolchain_id
from cachestore.api import WriteItem
from cachestore.entry import MAGIC, encode_entry
from cachestore.keys import partition
from cachestore.report import build_report, toolchain_coverage
from cachestore.settings import Settings
from cachestore.stores import open_backend
from cachestore.trust import WriterKey
from workers.cli import main as nkicache
from workers.warm import WarmError, default_source

CRAFTED = 100


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    yield from fresh_tier(request, tmp_path)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    return writer_keys(tmp_path)


def test_an_untrusted_writer_neither_feeds_nor_blocks_a_trusted_reader(base: Settings, keys: dict[str, Any]) -> None:
    graph = mixed_graph("scoped")
    laptop = client_of(base, keys, "laptop")
    assert laptop.credentials.scope == f"w-{keys['laptop'].key_id_hex}"
    first = compile_with(laptop, graph)
    assert first.traces == MIXED_DISTINCT_KEYS
    graph_keys = sorted(first._new_nki_frontend_kernel_cache)
    # The laptop (hung, say) holds a lease on every one of the graph's keys, in its scope.
    assert all(laptop.acquire_lease(key) for key in graph_keys)

    ci = client_of(base, keys, "ci")
    assert ci.credentials.scope == ""
    trusted = compile_with(ci, graph)
    ci.close(timeout=10)
    # Every variant traced: none of the laptop's entries used, none even seen (no rejection), no lease waited on.
    assert (trusted.traces, trusted.remote_hits, trusted.lease_waits) == (MIXED_DISTINCT_KEYS, 0, 0)
    assert ci.counts()["tier_rejected"] == 0
    # For the trusted scope these keys were never stored: new variants, not evicted nor another toolchain's.
    assert {cause: n for cause, n in trusted.miss_causes.items() if n} == {"new_variant": MIXED_DISTINCT_KEYS}

    # The trusted writer's entries are stored and served to a trusted reader.
    reader = client_of(base, keys, None, tier_mode="read-only")
    served = compile_with(reader, graph)
    assert (served.remote_hits, served.traces) == (MIXED_DISTINCT_KEYS, 0)
    entries, _ = reader.find_many(graph_keys)
    assert {entry.writer for entry in entries.values()} == {keys["ci"].key_id_hex}
    reader.close()

    # Each writer's entries stored and served show per key id in the report (the second pass served ci's own).
    again_ci = client_of(base, keys, "ci")
    compile_with(again_ci, graph)
    again_ci.close(timeout=10)
    store = open_backend(base, reading=True)
    writers = build_report(store, top=0, timeline=False).trust["writers"]
    store.close()
    assert writers[keys["ci"].key_id_hex] == {"stored": MIXED_DISTINCT_KEYS, "served": MIXED_DISTINCT_KEYS,
                                              "quarantined": 0}  # fmt: skip

    # The laptop's entries are still where the laptop reads them, its own.
    again = compile_with(laptop, graph)
    assert (again.remote_hits, again.traces) == (MIXED_DISTINCT_KEYS, 0)
    mine, _ = laptop.find_many(graph_keys)
    assert {entry.writer for entry in mine.values()} == {keys["laptop"].key_id_hex}
    laptop.close(timeout=10)


def crafted_entries(keys: dict[str, Any], cache_keys: list[str]) -> list[tuple[str, bytes]]:
    """CRAFTED entries made with the laptop's key (and one transplanted ci signature), every way a forger
    might try: signed honestly by the untrusted key, its signature under ci's key id, no writer signature,
    a genuine ci entry copied under another cache key, and the planted binary under the writer signature (key
    id and signature, 80 bytes) of a genuine ci entry for its key."""
    laptop: WriterKey = keys["laptop"]
    ci: WriterKey = keys["ci"]
    section = len(MAGIC) + 2 + 32
    made = []
    for number, cache_key in enumerate(cache_keys):
        entry = make_entry(binary=b"planted %d" % number)
        kind = number % 5
        if kind == 0:
            data = encode_entry(entry, writer=laptop, cache_key=cache_key)
        elif kind == 1:
            honest = encode_entry(entry, writer=laptop, cache_key=cache_key)
            data = honest[:section] + ci.key_id + honest[section + 16 :]
        elif kind == 2:
            data = encode_entry(entry)
        elif kind == 3:
            data = encode_entry(entry, writer=ci, cache_key=secrets.token_hex(32))  # transplanted
        else:  # the planted binary under the writer signature section of a genuine ci entry for this very key
            genuine = encode_entry(make_entry(binary=b"genuine"), writer=ci, cache_key=cache_key)
            planted = encode_entry(entry, writer=laptop, cache_key=cache_key)
            data = planted[:section] + genuine[section : section + 80] + planted[section + 80 :]
        made.append((cache_key, data))
    return made


def test_crafted_entries_in_the_trusted_scope_are_all_rejected(base: Settings, keys: dict[str, Any]) -> None:
    graph = mixed_graph("crafted")
    ci = client_of(base, keys, "ci")
    graph_keys = sorted(compile_with(ci, graph)._new_nki_frontend_kernel_cache)
    ci.close(timeout=10)
    # Planted straight into the trusted partition, over the trusted writer's own entries too.
    cache_keys = graph_keys + [secrets.token_hex(32) for _ in range(CRAFTED - len(graph_keys))]
    store = open_backend(base, partition=partition(toolchain_id()))
    store.put_entries([WriteItem(key, data, None, 3600) for key, data in crafted_entries(keys, cache_keys)])
    store.close()

    reader = client_of(base, keys, None, tier_mode="read-only")
    accepted, held = reader.find_many(cache_keys)
    assert accepted == {} and held == set(cache_keys)
    assert reader.counts()["tier_rejected"] == CRAFTED
    # The graph's variants, their entries replaced by forgeries, are traced again rather than served.
    loop = compile_with(reader, graph)
    assert (loop.remote_hits, loop.traces) == (0, MIXED_DISTINCT_KEYS)
    reader.close()


def test_gc_by_writer_purges_a_writer_in_every_scope_and_ls_du_show_writers(
    base: Settings, keys: dict[str, Any]
) -> None:
    graph = mixed_graph("purged")
    for writer, changes in (("laptop", {}), ("laptop", {"scope": "trusted"}), ("ci", {})):
        client = client_of(base, keys, writer, **changes)
        compile_with(client, graph)
        client.close(timeout=10)
    laptop, ci = keys["laptop"].key_id_hex, keys["ci"].key_id_hex
    env = {"NKICACHE_NAMESPACE": base.namespace}
    runner = CliRunner()

    def inspect(*args: str) -> Any:
        result = runner.invoke(nkicache, ["inspect", "--tier", base.tier, *args], env=env)
        assert result.exit_code == 0, result.output
        return json.loads(result.output)

    # The laptop wrote its scope and (by hand) the trusted one; ci then replaced the trusted scope's entries.
    assert Counter(row["writer"] for row in inspect("ls", "--json")) == {laptop: MIXED_DISTINCT_KEYS,
                                                                         ci: MIXED_DISTINCT_KEYS}  # fmt: skip
    assert set(inspect("du", "--json")["writers"]) == {laptop, ci}
    # An untrusted scope is no other toolchain: no coverage table, nothing for warm to start from.
    store = open_backend(base, reading=True)
    try:
        assert toolchain_coverage(store) == {}
        with pytest.raises(WarmError, match="no entries of another toolchain"):
            default_source(store)
    finally:
        store.close()
    purged = inspect("gc", "--writer", laptop.upper(), "--json")
    assert purged["evicted"] == MIXED_DISTINCT_KEYS and purged["reasons"] == {f"writer {laptop}": MIXED_DISTINCT_KEYS}
    assert {row["writer"] for row in inspect("ls", "--json")} == {ci}
    bad = runner.invoke(nkicache, ["inspect", "--tier", base.tier, "gc", "--writer", "xyz"], env=env)
    assert bad.exit_code != 0 and "32 hex digits" in bad.output
    # The trusted reader still hits every variant.
    reader = client_of(base, keys, None, tier_mode="read-only")
    assert compile_with(reader, graph).remote_hits == MIXED_DISTINCT_KEYS
    reader.close()


def test_inspect_verify_and_show_apply_the_trust_policy(base: Settings, keys: dict[str, Any]) -> None:
    graph = mixed_graph("verified")
    ci = client_of(base, keys, "ci")
    graph_keys = sorted(compile_with(ci, graph)._new_nki_frontend_kernel_cache)
    ci.close(timeout=10)
    env = {"NKICACHE_NAMESPACE": base.namespace, "NKICACHE_TRUST_POLICY": keys["policy"]}
    runner = CliRunner()
    clean = runner.invoke(nkicache, ["inspect", "--tier", base.tier, "verify", "--json"], env=env)
    assert clean.exit_code == 0, clean.output
    assert json.loads(clean.output)["ok"] == MIXED_DISTINCT_KEYS
    planted = encode_entry(make_entry(), writer=keys["laptop"], cache_key=graph_keys[0])
    store = open_backend(base, partition=partition(toolchain_id()))
    store.put_entries([WriteItem(graph_keys[0], planted, None, 3600)])
    store.close()
    found = runner.invoke(nkicache, ["inspect", "--tier", base.tier, "verify", "--json"], env=env)
    assert found.exit_code == 1
    (bad,) = json.loads(found.output)["bad"]
    assert bad["key"] == graph_keys[0] and "does not trust" in bad["reason"]
    shown = runner.invoke(nkicache, ["inspect", "--tier", base.tier, "show", graph_keys[0], "--json"], env=env)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["verified"] is False
    assert json.loads(shown.output)["writer"] == keys["laptop"].key_id_hex
