"""Issue 34: saved time, each cache's apart. `tier_saved_seconds` is what the shared tier saved (the compile
seconds stored with each entry it answered), `in_pass_saved_seconds` what the pass's own cache saved: a
compile with the tier off saved nothing by the shared tier, whatever its in-pass hits saved."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from cachestore.api import MetricsBatch
from cachestore.entry import SignaturePolicy, decode_entry
from cachestore.settings import Settings
from cachestore.stores import open_backend, open_tier
from workers.cli import main

GRAPH = Path(__file__).parent / "data" / "graphs" / "attention_tiles.json"  # 5 kernels: 2 in-pass hits


def invoke(*args: object):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_a_compile_with_the_tier_off_saved_nothing_by_the_shared_tier(tmp_path: Path) -> None:
    summary = json.loads(invoke("compile", GRAPH, "--out", tmp_path, "--tier", "off", "--json").stdout)
    assert summary["cache_hits"] == 2 and summary["remote_hits"] == 0
    assert summary["tier_saved_seconds"] == 0 and summary["in_pass_saved_seconds"] > 0
    assert "saved_seconds" not in summary  # no figure that sums both caches' savings
    for graph in summary["graphs"]:
        assert graph["tier_saved_seconds"] == 0

    line = invoke("compile", GRAPH, "--out", tmp_path, "--tier", "off").stdout.splitlines()[-1]
    assert "saved 0.00 s by the shared tier, " in line and " s in-pass" in line


def test_a_warm_compile_s_tier_savings_are_the_stored_compile_seconds_of_its_hits(tmp_path: Path) -> None:
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    cold = json.loads(invoke("compile", GRAPH, "--out", tmp_path / "cold", "--tier", tier, "--json").stdout)
    assert cold["remote_hits"] == 0 and cold["tier_saved_seconds"] == 0
    reader = open_backend(Settings(tier=tier), reading=True)
    try:
        stored = [decode_entry(raw.data, SignaturePolicy()).compile_seconds for raw in reader.scan_entries()]
    finally:
        reader.close()

    warm = json.loads(invoke("compile", GRAPH, "--out", tmp_path / "warm", "--tier", tier, "--json").stdout)
    assert warm["remote_hits"] == len(stored) == 3  # each entry answered once: a remote hit
    assert warm["tier_saved_seconds"] == round(sum(stored), 6) > 0
    assert warm["in_pass_saved_seconds"] > 0

    report = json.loads(invoke("report", "--tier", tier, "--json").stdout)["totals"]
    assert report["tier_saved_seconds"] == round(cold["tier_saved_seconds"] + warm["tier_saved_seconds"], 6)
    assert report["in_pass_saved_seconds"] == round(cold["in_pass_saved_seconds"] + warm["in_pass_saved_seconds"], 6)
    text = invoke("report", "--tier", tier).stdout
    assert "compile seconds the shared tier saved" in text and "compile seconds the in-pass cache saved" in text
    exposition = invoke("report", "--tier", tier, "--prometheus").stdout
    assert "nkicache_tier_saved_seconds_total" in exposition
    assert "nkicache_in_pass_saved_seconds_total" in exposition
    assert "nkicache_saved_seconds_total" not in exposition


def test_a_batch_from_before_the_split_is_still_read(tmp_path: Path) -> None:
    """A batch of an older build carries one saved_seconds (both caches' sum): it cannot be split again, so the
    report reads the new counters of it as 0, and its other counts as they are."""
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    client = open_tier(Settings(tier=tier))
    try:
        client.record(MetricsBatch("old-batch", "host", "worker", {"passes": 1, "kernels": 4, "cache_hits": 1,
                                                                   "saved_seconds": 2.5}))  # fmt: skip
        assert client.flush()
    finally:
        client.close()
    totals = json.loads(invoke("report", "--tier", tier, "--json").stdout)["totals"]
    assert (totals["passes"], totals["kernels"], totals["cache_hits"]) == (1, 4, 1)
    assert totals["tier_saved_seconds"] == totals["in_pass_saved_seconds"] == 0
    assert "saved_seconds" not in totals
    invoke("report", "--tier", tier)
    invoke("report", "--tier", tier, "--prometheus")
