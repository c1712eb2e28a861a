"""Never a wrong binary, end to end through the command line: entries swapped between keys (signed and
unsigned), a 'klir' entry and entries with NaN or 1e300 compile seconds are each refused and counted; the artifacts
are the `--tier off` artifacts, `nkicache run --check` passes, and the fleet totals are the sums of what
the passes reported."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_graphs import MIXED_DISTINCT_KEYS, TierView, mixed_graph, write_graph
from helpers_report import Tier, make_tier, nkicache

from bridge.port import PASS_COUNTERS
from cachestore.entry import SignaturePolicy, decode_entry, encode_entry

KEY = "fleet-signing-key-for-tests-0001"


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    yield from make_tier(request, tmp_path)


def compile_json(tier: Tier, env: dict, graph: Path, out: Path, *flags: str) -> dict:
    result = nkicache(tier, "compile", str(graph), "--out", str(out), "--json", *flags, env=env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout, parse_constant=lambda name: pytest.fail(f"{name} in compile --json"))


def reencoded(data: bytes, key: bytes | None, **changes: object) -> bytes:
    """The entry with `changes`, signed again with the fleet's key: intact by digest and signature."""
    entry = decode_entry(data, SignaturePolicy(key, require_signed=False))
    for name, value in changes.items():
        setattr(entry, name, value)
    return encode_entry(entry, key)


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_swapped_klir_and_nan_entries_are_refused_and_the_build_stays_right(
    tier: Tier, tmp_path: Path, signed: bool
) -> None:
    env = {"NKICACHE_HMAC_KEY": KEY} if signed else {}
    key = KEY.encode() if signed else None
    graph = write_graph(tmp_path, mixed_graph())
    cold = compile_json(tier, env, graph, tmp_path / "cold")

    view = TierView.of(tier.backend)
    stored = {raw.cache_key: raw.data for raw in tier.backend.scan_entries()}
    by_kernel = collections.defaultdict(list)
    for cache_key, data in sorted(stored.items()):
        by_kernel[decode_entry(data, SignaturePolicy(key, require_signed=False)).key_components["kernel_name"]].append(
            cache_key
        )
    a, b = by_kernel["rmsnorm"]  # eps 1e-6 and 1e-5: the same shapes, other maths
    klir, nan = by_kernel["matmul_tiled"][:2]
    view.put_raw(a, stored[b])
    view.put_raw(b, stored[a])
    view.put_raw(klir, reencoded(stored[klir], key, format="klir"))
    view.put_raw(nan, reencoded(stored[nan], key, compile_seconds=float("nan")))

    warm = compile_json(tier, env, graph, tmp_path / "warm")
    assert (warm["tier_rejected"], warm["traces"], warm["remote_hits"]) == (4, 4, MIXED_DISTINCT_KEYS - 4)
    off = compile_json(tier, env, graph, tmp_path / "off", "--tier", "off")
    for artifact in (tmp_path / "off").glob("*.nkibb"):
        assert (tmp_path / "warm" / artifact.name).read_bytes() == artifact.read_bytes()
    checked = nkicache(tier, "run", *map(str, (tmp_path / "warm").glob("*.nkibb")), "--check", env=env)
    assert checked.exit_code == 0, checked.output

    totals = json.loads(nkicache(tier, "report", "--json", env=env).stdout)["totals"]
    for name in PASS_COUNTERS:
        assert totals[name] == pytest.approx(cold[name] + warm[name], abs=1e-5), name
    assert off["traces"] == MIXED_DISTINCT_KEYS


def test_entries_claiming_1e300_compile_seconds_are_refused_and_every_pass_stays_in_the_report(
    tier: Tier, tmp_path: Path
) -> None:
    """Issue 35: an entry claiming 1e300 compile seconds (finite and >= 0) was accepted, and every pass that read
    it sent a metrics batch whose saved seconds no tier may record (over 2**53), so the report lost those passes,
    while each read refreshed the entry's TTL. Three such entries, planted under real keys of a small workload:
    each is refused and counted, traced again and replaced, and the report's totals are the passes' sums."""
    graphs = tmp_path / "graphs"
    assert nkicache(None, "workload", "--out", str(graphs), "--models", "4").exit_code == 0
    cold = compile_json(tier, {}, graphs, tmp_path / "cold", "--workers", "1")
    stored = {raw.cache_key: raw.data for raw in tier.backend.scan_entries()}
    planted = sorted(stored)[:3]
    view = TierView.of(tier.backend)
    for cache_key in planted:
        view.put_raw(cache_key, reencoded(stored[cache_key], None, compile_seconds=1e300))

    warm = compile_json(tier, {}, graphs, tmp_path / "warm", "--workers", "1")
    assert warm["tier_rejected"] >= 3 and warm["traces"] == 3, warm
    for cache_key in planted:  # replaced by the trace, not kept alive
        assert decode_entry(view.raw(cache_key), SignaturePolicy()).compile_seconds < 60
    again = compile_json(tier, {}, graphs, tmp_path / "again", "--workers", "1")
    assert again["tier_rejected"] == 0 and again["traces"] == 0, again
    for artifact in (tmp_path / "cold").glob("*.nkibb"):
        assert (tmp_path / "warm" / artifact.name).read_bytes() == artifact.read_bytes()

    totals = json.loads(nkicache(tier, "report", "--json").stdout)["totals"]
    for name in ("passes", "kernels", "tier_rejected"):
        assert totals[name] == cold[name] + warm[name] + again[name], name
    for name in ("compile_seconds", "tier_saved_seconds", "in_pass_saved_seconds"):
        assert totals[name] == pytest.approx(cold[name] + warm[name] + again[name], abs=1e-5), name
