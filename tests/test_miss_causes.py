"""Every tier miss of a pass gets one cause (bridge.miss_causes), on the local tier and on Redis: each cause is
produced here by the situation it names, and the causes of a pass always add up to its tier misses."""

from __future__ import annotations

import copy
import logging
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers_graphs import delete_namespace, fresh_tier_backend, kernel_op, tensor, unique_namespace

from bridge.codegen import BirCodeGenLoop, kernel_cache_key
from bridge.graph import load_graph
from bridge.miss_causes import (
    MISS_CAUSES,
    MISS_COUNTERS,
    MissObservation,
    VariantFacts,
    classify_miss,
    variant_fingerprints,
)
from bridge.port import PASS_COUNTERS
from bridge.targets import make_target
from cachestore.backends.redis import RedisBackend
from cachestore.client import TierClient
from cachestore.keys import KeySpace
from cachestore.settings import Settings
from cachestore.stores import open_tier

OTHER_TOOLCHAIN = "0123456789abcdef"


@dataclass
class Tier:
    url: str
    namespace: str
    backend: Any

    def client(self, **changes: Any) -> TierClient:
        client = open_tier(Settings(tier=self.url, namespace=self.namespace, host="h", **changes))
        assert client is not None
        return client


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    for url, namespace, backend in fresh_tier_backend(request, tmp_path):
        yield Tier(url, namespace, backend)


def graph_of(*ops: tuple[str, tuple[int, int], dict | None], name: str = "g", target: str | None = None) -> dict:
    """One kernel op per (func name, input shape, attrs); RMSNorm gets its gain vector."""
    tensors: dict[str, dict] = {}
    graph_ops = []
    for i, (func_name, (rows, cols), attrs) in enumerate(ops):
        tensors[f"x{i}"] = tensor((rows, cols))
        tensors[f"y{i}"] = tensor((rows, cols))
        operands = [f"x{i}"]
        if func_name == "RMSNorm":
            tensors[f"g{i}"] = tensor((cols,))
            operands.append(f"g{i}")
        graph_ops.append(kernel_op(func_name, operands, [f"y{i}"], attrs))
    graph = {"name": name, "tensors": tensors, "ops": graph_ops}
    if target:
        graph["target"] = target
    return graph


def compile_with(client: Any, graph: dict, target: str = "Trn2") -> BirCodeGenLoop:
    """A pass, then its writes flushed: a pass does not wait for them, and what the next pass's misses are
    diagnosed with (the variant index), or what a test changes behind the client's back, is the stored tier."""
    loop = BirCodeGenLoop(make_target(target), tier=client)
    loop.run(load_graph(copy.deepcopy(graph)))
    client.flush(10)
    return loop


def causes(loop: BirCodeGenLoop) -> dict[str, int]:
    """The pass's causes that counted anything, after checking they add up to its tier misses."""
    summary = loop.pass_summary()
    assert sum(summary[name] for name in MISS_COUNTERS) == summary["tier_lookups"] - summary["remote_hits"]
    return {cause: count for cause, count in loop.miss_causes.items() if count}


SOFTMAX_64 = ("Softmax", (64, 32), None)
SOFTMAX_128 = ("Softmax", (128, 32), None)
RMS_A = ("RMSNorm", (64, 32), {"eps": 1e-6})
RMS_B = ("RMSNorm", (64, 32), {"eps": 1e-5})


def test_a_fresh_tier_misses_on_new_variants_and_a_warm_one_not_at_all(tier: Tier) -> None:
    client = tier.client()
    first = compile_with(client, graph_of(SOFTMAX_64, SOFTMAX_128, RMS_A))
    assert causes(first) == {"new_variant": 3}
    assert dict(first.kernel_miss_causes) == {"softmax": {"new_variant": 2}, "rmsnorm": {"new_variant": 1}}
    again = compile_with(client, graph_of(SOFTMAX_64, SOFTMAX_128, RMS_A))
    assert again.remote_hits == 3
    assert causes(again) == {}
    client.close()


def test_new_shape_attrs_and_target_are_told_apart(tier: Tier) -> None:
    client = tier.client()
    compile_with(client, graph_of(SOFTMAX_64, RMS_A))
    assert causes(compile_with(client, graph_of(SOFTMAX_128))) == {"new_shape": 1}
    assert causes(compile_with(client, graph_of(RMS_B))) == {"attrs_differ": 1}
    assert causes(compile_with(client, graph_of(SOFTMAX_64), target="Trn1")) == {"target_differs": 1}
    client.close()


def test_a_key_stored_before_and_gone_is_evicted(tier: Tier) -> None:
    client = tier.client()
    graph = graph_of(SOFTMAX_64, SOFTMAX_128)
    compile_with(client, graph)
    evicted_key = compile_with(client, graph)._cache_key_components  # both keys, now held
    gone = sorted(evicted_key)[0]
    tier.backend.delete_entries([gone])
    loop = compile_with(client, graph)
    assert causes(loop) == {"evicted": 1}
    assert loop.remote_hits == 1
    client.close()


def test_a_key_another_toolchain_stored_is_told_from_a_new_one(tier: Tier, monkeypatch: pytest.MonkeyPatch) -> None:
    import cachestore.backends.redis as redis_module
    import cachestore.backends.sqlite as sqlite_module
    import cachestore.client as client_module
    import cachestore.stores as stores_module

    graph = graph_of(SOFTMAX_64)
    for module in (client_module, redis_module, sqlite_module, stores_module):
        monkeypatch.setattr(module, "toolchain_id", lambda: OTHER_TOOLCHAIN)
    other = tier.client()
    compile_with(other, graph)
    other.close()
    monkeypatch.undo()

    ours = tier.client()
    loop = compile_with(ours, graph_of(SOFTMAX_64, SOFTMAX_128))
    assert causes(loop) == {"other_toolchain": 1, "new_variant": 1}
    ours.close()


def test_an_entry_that_fails_its_checks_is_a_rejected_miss(tier: Tier, caplog: pytest.LogCaptureFixture) -> None:
    client = tier.client()
    graph = graph_of(SOFTMAX_64)
    compile_with(client, graph)
    (cache_key,) = compile_with(client, graph)._cache_key_components
    from cachestore.api import WriteItem

    tier.backend.put_entries([WriteItem(cache_key, b"NKC\x03 not an entry", None, 3600)])
    with caplog.at_level(logging.DEBUG, logger="bridge.tier_seam"):
        loop = compile_with(client, graph)
    assert causes(loop) == {"rejected": 1}
    assert loop.pass_summary()["tier_rejected"] == 1
    lines = [record.getMessage() for record in caplog.records]
    assert any(line.startswith("Tier miss for Softmax") and line.endswith(": rejected") for line in lines)
    client.close()


def test_a_lease_nobody_answers_is_a_lease_timeout(tier: Tier) -> None:
    graph = graph_of(SOFTMAX_64)
    cache_key, _ = kernel_cache_key(load_graph(copy.deepcopy(graph)).ops[0], make_target("Trn2"))
    assert tier.backend.acquire_lease(cache_key, "a-worker-that-died", 60)
    client = tier.client(lease_wait=0.3)
    loop = compile_with(client, graph)
    assert causes(loop) == {"lease_timeout": 1}
    assert loop.lease_waits == 1
    client.close()


def test_a_tier_that_cannot_be_reached_is_the_cause(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for url in (f"redis://127.0.0.1:{port}/0", f"local:{blocker}/sub/tier.sqlite"):
        client = open_tier(Settings(tier=url, connect_timeout=0.5, op_timeout=1.0))
        loop = compile_with(client, graph_of(SOFTMAX_64, RMS_A))
        assert causes(loop) == {"tier_unavailable": 2}, url
        client.close(timeout=0.1)


def test_an_index_that_cannot_be_read_leaves_the_cause_unknown(tier: Tier, monkeypatch: pytest.MonkeyPatch) -> None:
    client = tier.client()
    monkeypatch.setattr(client, "variant_facts", lambda misses: None)
    assert causes(compile_with(client, graph_of(SOFTMAX_64))) == {"unknown": 1}
    client.close()


def test_the_index_asks_one_round_trip_per_pass_and_nothing_on_a_warm_pass(tier: Tier) -> None:
    client = tier.client()
    calls: list[int] = []
    real = client.variant_facts
    client.variant_facts = lambda misses: calls.append(len(misses)) or real(misses)  # type: ignore[method-assign]
    compile_with(client, graph_of(SOFTMAX_64, SOFTMAX_128, RMS_A, RMS_B))
    compile_with(client, graph_of(SOFTMAX_64, SOFTMAX_128, RMS_A, RMS_B))
    assert calls == [4]
    client.close()


def test_causes_reach_the_fleet_totals_and_the_pass_log(tier: Tier) -> None:
    client = tier.client()
    compile_with(client, graph_of(SOFTMAX_64, RMS_A))
    compile_with(client, graph_of(SOFTMAX_128, RMS_B))
    client.close()
    totals = tier.backend.totals()
    assert totals["misses_new_variant"] == 2
    assert totals["misses_new_shape"] == 1
    assert totals["misses_attrs_differ"] == 1
    records = [record for _, record in tier.backend.pass_log(None)]
    assert records[-1]["kernel_misses"] == {"rmsnorm": {"attrs_differ": 1}, "softmax": {"new_shape": 1}}


def test_the_counters_are_pass_counters_in_the_order_of_the_causes() -> None:
    assert PASS_COUNTERS[-len(MISS_COUNTERS) :] == MISS_COUNTERS
    assert [name.removeprefix("misses_") for name in MISS_COUNTERS] == list(MISS_CAUSES)


def test_what_the_pass_saw_comes_before_what_the_index_says() -> None:
    everything = VariantFacts(True, True, True, True, True)
    assert classify_miss(MissObservation(tier_unavailable=True, rejected=True), everything) == "tier_unavailable"
    assert classify_miss(MissObservation(rejected=True, lease_timed_out=True), everything) == "rejected"
    assert classify_miss(MissObservation(lease_timed_out=True), None) == "lease_timeout"
    assert classify_miss(MissObservation(), None) == "unknown"
    assert classify_miss(MissObservation(), VariantFacts()) == "new_variant"


def test_fingerprints_ignore_placement_and_match_a_stored_copy() -> None:
    op = load_graph(graph_of(RMS_A)).ops[0]
    _, on_trn2 = kernel_cache_key(op, make_target("Trn2"))
    _, on_trn1 = kernel_cache_key(op, make_target("Trn1"))
    assert variant_fingerprints(on_trn2) == variant_fingerprints(on_trn1)
    import json

    stored_copy = json.loads(json.dumps(on_trn2))  # tuples come back as lists, as from msgpack
    assert variant_fingerprints(stored_copy) == variant_fingerprints(on_trn2)
    other_attrs = load_graph(graph_of(RMS_B)).ops[0]
    mine, theirs = variant_fingerprints(on_trn2), variant_fingerprints(kernel_cache_key(other_attrs)[1])
    assert mine.shapes == theirs.shapes and mine.attrs != theirs.attrs


def test_report_text_json_and_prometheus_show_misses_by_cause(tier: Tier) -> None:
    from cachestore.report import build_report
    from cachestore.report_render import render_html, render_prometheus, render_text

    client = tier.client()
    compile_with(client, graph_of(SOFTMAX_64, RMS_A))
    compile_with(client, graph_of(SOFTMAX_128, RMS_B))
    client.close()
    report = build_report(tier.backend)

    document = report.as_json()
    assert document["misses"] == dict.fromkeys(MISS_CAUSES, 0) | {"new_variant": 2, "new_shape": 1, "attrs_differ": 1}
    assert document["kernel_misses"] == {"softmax": {"new_variant": 1, "new_shape": 1},
                                         "rmsnorm": {"new_variant": 1, "attrs_differ": 1}}  # fmt: skip
    assert sum(bucket["misses"]["new_variant"] for bucket in document["timeline"]) == 2

    text = render_text(report, width=200, ascii_only=True)
    by_cause = text[text.index("Tier misses by cause (all passes") :]
    assert "new_variant" in by_cause and "never stored this kernel" in by_cause
    assert "Tier misses by cause over time" in text
    per_kernel = text[text.index("Tier misses by cause per kernel") :]
    assert per_kernel.index("rmsnorm") < per_kernel.index("In these buckets")

    exposition = render_prometheus(report)
    assert 'nkicache_tier_misses_total{cause="new_variant"} 2.0' in exposition
    assert 'nkicache_tier_misses_total{cause="evicted"} 0.0' in exposition
    assert "nkicache_misses_new_variant" not in exposition  # one labelled family, not a family per cause

    page = render_html(report)
    assert 'id="misses"' in page and 'id="kernel-misses"' in page


@pytest.mark.redis
def test_another_tools_key_under_the_index_costs_causes_never_entries(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    namespace = unique_namespace()
    client.set(KeySpace(namespace).variant_index("softmax"), b"another tool's bytes")
    tier = Tier(redis_url, namespace, RedisBackend(client, KeySpace(namespace)))
    try:
        ours = tier.client()
        graph = graph_of(SOFTMAX_64, RMS_A)
        cold = compile_with(ours, graph)
        assert causes(cold) == {"unknown": 1, "new_variant": 1}  # a string, not a hash: softmax's has no cause
        warm = compile_with(ours, graph)
        assert (warm.remote_hits, warm.traces) == (2, 0)  # the entries were stored all the same
        assert ours.counts()["tier_errors"] == 0
        assert client.get(KeySpace(namespace).variant_index("softmax")) == b"another tool's bytes"
        assert causes(compile_with(ours, graph_of(RMS_B))) == {"attrs_differ": 1}  # the rmsnorm index works
        ours.close()
    finally:
        delete_namespace(client, namespace)
        client.close()


def test_a_key_another_scope_of_this_toolchain_stored_is_new_here_not_evicted() -> None:
    from cachestore.keys import partition
    from cachestore.variant_index import facts, partition_tag

    trusted, laptop = partition("0123456789abcdef"), partition("0123456789abcdef", "w-laptop")
    from_laptop = facts([partition_tag(laptop), None, None, None], trusted)
    assert not from_laptop.stored_here_before and not from_laptop.stored_by_other_toolchain
    assert classify_miss(MissObservation(), from_laptop) == "new_variant"
    assert facts([partition_tag(trusted), None, None, None], laptop).stored_by_other_toolchain is False
    assert facts([partition_tag(partition("fedcba9876543210")), None, None, None], trusted).stored_by_other_toolchain
    assert facts([partition_tag(trusted), None, None, None], trusted).stored_here_before
    # Ids of other lengths and text ids: a toolchain's part is read back whole, never a prefix of another's.
    assert facts([partition_tag("0123456789abcdef0123"), None, None, None], trusted).stored_by_other_toolchain
    assert facts([partition_tag("other-compiler"), None, None, None], "other-compiler").stored_here_before
    assert facts([partition_tag("other:scope:x"), None, None, None], "other").stored_by_other_toolchain is False


@pytest.mark.parametrize("planted", [b"", b"\xff", b"\x08short", "0123456789abcdef", b"\x00" * 300])
def test_a_hand_written_index_value_is_never_taken_for_this_partition(planted: bytes | str) -> None:
    """Truncated, garbage or old-layout (hex text) values: no crash, and never 'stored here before'."""
    from cachestore.variant_index import facts

    found = facts([planted, None, None, None], "0123456789abcdef")
    assert not found.stored_here_before and found.stored_by_other_toolchain


@pytest.mark.redis
def test_a_stacks_misses_take_the_shared_levels_index_and_its_outage(tmp_path: Path, redis_url: str) -> None:
    namespace = unique_namespace()
    client = redis.Redis.from_url(redis_url)
    try:
        near = f"local:{tmp_path / 'near.sqlite'}"
        stacked = open_tier(Settings(tier=f"{near} {redis_url}", namespace=namespace, host="h"))
        compile_with(stacked, graph_of(SOFTMAX_64, RMS_A))
        assert causes(compile_with(stacked, graph_of(SOFTMAX_128, RMS_B))) == {"new_shape": 1, "attrs_differ": 1}
        stacked.close()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            down = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"
        behind_down = open_tier(Settings(tier=f"{near} {down}", connect_timeout=0.3, host="h"))
        loop = compile_with(behind_down, graph_of(SOFTMAX_64, SOFTMAX_128, ("Softmax", (192, 32), None)))
        assert loop.remote_hits == 2  # the near level serves what it holds
        assert causes(loop) == {"tier_unavailable": 1}  # and the one it lacks the shared level could have held
        behind_down.close(timeout=0.1)
    finally:
        delete_namespace(client, namespace)
        client.close()


def test_a_pass_s_causes_do_not_depend_on_how_far_the_write_behind_got(
    tier: Tier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two passes in a row, the first one's entries still queued (the flusher stopped): the second pass's
    misses have the causes they have once those are stored, as its reads already find the queued entries."""
    from cachestore.write_behind import WriteBehind

    client = tier.client()
    with monkeypatch.context() as patch:
        patch.setattr(WriteBehind, "start", lambda self: None)
        BirCodeGenLoop(make_target("Trn2"), tier=client).run(load_graph(graph_of(SOFTMAX_64, RMS_A)))
        second = BirCodeGenLoop(make_target("Trn2"), tier=client)
        second.run(load_graph(graph_of(SOFTMAX_64, SOFTMAX_128, RMS_B)))
    assert second.remote_hits == 1
    assert causes(second) == {"new_shape": 1, "attrs_differ": 1}
    client.close()
