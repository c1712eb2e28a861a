"""Two hit rates, each with one meaning in every output: the shared cache's (remote_hits / tier_lookups, the
headline) and the in-pass one (the specification's cache_hits / kernels), named as such.

A compile with the tier off asked no shared cache anything: its shared-cache hit rate must be absent (n/a,
null, no Prometheus sample), never the in-pass cache's hits passed off as the tier's."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from workers.cli import main

GRAPHS = Path(__file__).parent / "data" / "graphs"
GRAPH = GRAPHS / "attention_tiles.json"  # 5 kernels: 2 in-pass hits, 3 in-pass misses
IN_PASS = 2 / 5


def invoke(*args: object):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def rate_names(text: str) -> set[str]:
    """The word before every 'hit rate' in the lines of `text` outside tables ('' for a bare one)."""
    lines = "\n".join(line for line in text.splitlines() if not re.match(r"\s*[|│┃+]", line))
    return {match.group(1) for match in re.finditer(r"([\w-]*) hit rate", lines)}


def test_compile_with_the_tier_off_has_no_shared_hit_rate_in_text_or_json(tmp_path: Path) -> None:
    text = invoke("compile", GRAPH, "--out", tmp_path, "--tier", "off").stdout
    summary = text.splitlines()[-1]
    assert "shared-cache hit rate n/a (no tier lookups)" in summary
    assert "in-pass hit rate 40%" in summary
    assert rate_names(text) == {"shared-cache", "in-pass"}  # no bare "hit rate" left to guess at

    report = json.loads(invoke("compile", GRAPH, "--out", tmp_path, "--tier", "off", "--json").stdout)
    assert report["tier_lookups"] == 0 and report["remote_hits"] == 0
    assert report["shared_hit_rate"] is None
    assert report["in_pass_hit_rate"] == IN_PASS
    assert "hit_rate" not in report


def test_compile_with_a_tier_counts_its_lookups(tmp_path: Path) -> None:
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    cold = json.loads(invoke("compile", GRAPH, "--out", tmp_path / "a", "--tier", tier, "--json").stdout)
    warm = json.loads(invoke("compile", GRAPH, "--out", tmp_path / "b", "--tier", tier, "--json").stdout)
    assert cold["tier_lookups"] == warm["tier_lookups"] == 3  # every in-pass miss asked the tier
    assert (cold["shared_hit_rate"], warm["shared_hit_rate"]) == (0.0, 1.0)
    assert cold["in_pass_hit_rate"] == warm["in_pass_hit_rate"] == IN_PASS
    assert (
        "shared-cache hit rate 100% (3 of 3 tier lookups), in-pass hit rate 40%"
        in invoke("compile", GRAPH, "--out", tmp_path / "c", "--tier", tier).stdout
    )


def test_a_tier_never_asked_reports_no_shared_hit_rate_in_any_format(tmp_path: Path) -> None:
    """Mirror mode writes the passes' metrics to the tier but never looks anything up in it: the report, in
    text, JSON, Prometheus and HTML, has an in-pass rate and no shared one."""
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    invoke("compile", GRAPH, "--out", tmp_path / "out", "--tier", tier, "--tier-mode", "mirror")

    report = json.loads(invoke("report", "--tier", tier, "--json").stdout)
    for counts in (report["totals"], report["window"], *report["timeline"]):
        assert counts["shared_hit_rate"] is None and counts["tier_lookups"] == 0
        assert counts["in_pass_hit_rate"] == IN_PASS and "hit_rate" not in counts

    text = invoke("report", "--tier", tier).stdout
    assert re.search(r"shared-cache hit rate \(remote_hits / tier_lookups\)\s*[│|]\s*n/a", text)
    assert re.search(r"in-pass hit rate \(cache_hits / kernels\)\s*[│|]\s*40\.0%", text)
    assert "shared-cache hit rate n/a, in-pass hit rate 40.0%" in text
    assert rate_names(text) == {"shared-cache", "in-pass"}
    assert not re.search(r"[│┃]", text)  # piped: ASCII tables

    exposition = invoke("report", "--tier", tier, "--prometheus").stdout
    samples = {s.name: s.value for f in text_string_to_metric_families(exposition) for s in f.samples}
    assert "nkicache_shared_hit_ratio" not in samples and "nkicache_hit_ratio" not in samples
    assert samples["nkicache_in_pass_hit_ratio"] == IN_PASS
    assert samples["nkicache_tier_lookups_total"] == 0

    page = tmp_path / "report.html"
    invoke("report", "--tier", tier, "--html", page)
    html = page.read_text()
    assert '<div class="v">n/a</div><div class="k">shared-cache hit rate</div>' in html
    assert '<div class="v">40.0%</div><div class="k">in-pass hit rate</div>' in html
    plot = re.search(r'<figure id="plot-hit-rate">(.*?)</figure>', html, re.S).group(1)
    # The plot's legend uses the tables' words; "misses" names nothing in it (the tables' misses are in-pass ones).
    for words in ("in-pass hits", "remote hits", "traces", "shared-cache hit rate", "in-pass hit rate"):
        assert words in plot, words
    assert "misses" not in plot


def test_quickstart_names_both_rates(tmp_path: Path) -> None:
    result = invoke("quickstart", "--dir", tmp_path / "qs", "--models", "2", "--workers", "1")
    assert rate_names(result.stdout) == {"shared-cache", "in-pass"}
    assert "shared-cache hit rate 100%" in result.stdout  # the warm run: every lookup answered by the tier


def test_a_rate_with_nothing_asked_is_n_a_in_report_text_never_0(tmp_path: Path) -> None:
    """Issue 34: a worker that compiled no kernel (`nkicache warm` names its toolchain with a batch of no pass)
    had an in-pass hit rate of 0%, which reads as a cache that never hits: no kernels, no rate."""
    from cachestore.api import MetricsBatch
    from cachestore.settings import Settings
    from cachestore.stores import open_tier

    tier = f"local:{tmp_path / 'tier.sqlite'}"
    client = open_tier(Settings(tier=tier))
    try:
        client.record(MetricsBatch("no-pass", "host", "warm", {"passes": 0}))
        assert client.flush()
    finally:
        client.close()
    text = invoke("report", "--tier", tier).stdout
    assert re.search(r"in-pass hit rate \(cache_hits / kernels\)\s*[│|]\s*n/a", text)
    assert "0.0%" not in text and "0%" not in text
    totals = json.loads(invoke("report", "--tier", tier, "--json").stdout)["totals"]
    assert totals["shared_hit_rate"] is None and totals["in_pass_hit_rate"] is None
