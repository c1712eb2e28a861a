"""`nkicache report` and `nkicache serve-metrics` against a fleet run whose counts are known in advance, on
the local tier and on a real Redis: text, JSON and Prometheus output agree with what the passes counted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers_graphs import unique_namespace
from helpers_report import (
    EXPECTED_IN_PASS_HIT_RATE,
    EXPECTED_KERNELS,
    EXPECTED_SHARED_HIT_RATE,
    EXPECTED_TOTALS,
    EXPECTED_VARIANTS,
    EXPECTED_WORKERS,
    SECOND_VARIANT,
    TOP_VARIANT,
    Tier,
    make_tier,
    nkicache,
    run_known_fleet,
)
from prometheus_client.parser import text_string_to_metric_families

from bridge.errors import NkiCacheError
from bridge.identity import toolchain_id
from cachestore.api import TOTAL_COUNTERS, MetricsBatch
from cachestore.backends.redis import RedisBackend
from cachestore.json_text import json_text
from cachestore.keys import KeySpace
from cachestore.report import build_report, parse_duration, parse_since, parse_size
from cachestore.report_render import FleetCollector, render_html
from workers.passes import COUNT_KEYS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    yield from make_tier(request, tmp_path)


@pytest.fixture
def fleet(tier: Tier) -> tuple[Tier, list]:
    return tier, run_known_fleet(tier)


def report_json(tier: Tier, *args: str) -> dict:
    result = nkicache(tier, "report", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# -- JSON -----------------------------------------------------------------------------------------------
def test_json_totals_per_kernel_per_host_and_top_variants_match_the_run(fleet: tuple[Tier, list]) -> None:
    tier, loops = fleet
    report = report_json(tier)

    totals = report["totals"]
    # The same names as `nkicache compile --json` uses for its counters, and nothing else.
    rates = {"shared_hit_rate", "in_pass_hit_rate"}
    assert set(totals) == {"passes", *COUNT_KEYS, *rates} == {*TOTAL_COUNTERS, *rates}
    for name, value in EXPECTED_TOTALS.items():
        assert totals[name] == value, name
    assert totals["shared_hit_rate"] == pytest.approx(EXPECTED_SHARED_HIT_RATE, abs=1e-6)
    assert totals["in_pass_hit_rate"] == pytest.approx(EXPECTED_IN_PASS_HIT_RATE, abs=1e-6)
    assert totals["compile_seconds"] == pytest.approx(sum(loop.trace_seconds for loop in loops), abs=1e-4)
    for name in ("tier_saved_seconds", "in_pass_saved_seconds"):
        assert totals[name] == pytest.approx(sum(getattr(loop, name) for loop in loops), abs=1e-4), name
        assert totals[name] > 0, name

    assert report["per_kernel"] == EXPECTED_KERNELS
    assert list(report["per_kernel"])[-1] == "rmsnorm"  # most called first
    assert report["variants"] == EXPECTED_VARIANTS
    assert report["kernel_types"] == 3

    assert set(report["per_host"]) == {"hostA", "hostB"}
    for (host, worker), expected in EXPECTED_WORKERS.items():
        got = report["per_host"][host]["workers"][worker]
        assert {name: got[name] for name in expected} == expected
        assert report["per_host"][host]["totals"]["kernels"] == expected["kernels"]
    assert report["per_host"]["hostB"]["workers"]["w2"]["shared_hit_rate"] == 1.0

    first, second = report["top_variants"][:2]
    assert {name: first[name] for name in TOP_VARIANT} == TOP_VARIANT
    assert {name: second[name] for name in SECOND_VARIANT} == SECOND_VARIANT
    assert first["hosts"] == ["hostA", "hostB"]
    assert first["operand_dtypes"] == ["float32"] and first["target"] == "Trn2"
    assert len(report["top_variants"]) == EXPECTED_VARIANTS
    assert sum(v["usage"] for v in report["top_variants"]) == EXPECTED_TOTALS["kernels"]

    timeline = report["timeline"]
    assert timeline and report["bucket_seconds"] > 0
    assert sum(b["passes"] for b in timeline) == 3
    assert sum(b["kernels"] for b in timeline) == 24
    assert report["window"]["shared_hit_rate"] == pytest.approx(EXPECTED_SHARED_HIT_RATE, abs=1e-6)
    assert report["window"]["in_pass_hit_rate"] == pytest.approx(EXPECTED_IN_PASS_HIT_RATE, abs=1e-6)
    assert report["window"]["remote_hits"] == 10


def test_top_limits_the_variants_listed(fleet: tuple[Tier, list]) -> None:
    tier, _ = fleet
    report = report_json(tier, "--top", "2")
    assert [v["usage"] for v in report["top_variants"]] == [6, 4]
    assert report_json(tier, "--top", "0")["top_variants"] == []


def test_since_limits_the_timeline_not_the_totals(tier: Tier) -> None:
    now = time.time()
    old = {"passes": 1, "kernels": 10, "cache_hits": 0, "cache_misses": 10, "remote_hits": 0, "traces": 10}
    tier.backend.apply_metrics(MetricsBatch("old-pass", "hostC", "w9", dict(old), {}, {},
                                            {**old, "finished": now - 3 * 86400, "host": "hostC"}))  # fmt: skip
    run_known_fleet(tier)

    everything = report_json(tier)
    assert everything["totals"]["passes"] == 4 and everything["totals"]["kernels"] == 34
    assert sum(b["passes"] for b in everything["timeline"]) == 4
    assert everything["bucket_seconds"] == 6 * 3600  # three days in at most 48 buckets
    assert everything["window"]["kernels"] == 34

    recent = report_json(tier, "--since", "1d")
    assert recent["totals"] == everything["totals"]
    assert sum(b["passes"] for b in recent["timeline"]) == 3
    assert recent["window"]["kernels"] == 24
    assert recent["window"]["shared_hit_rate"] == pytest.approx(EXPECTED_SHARED_HIT_RATE, abs=1e-6)
    assert recent["since"] == pytest.approx(now - 86400, abs=60)

    later = report_json(tier, "--since", str(int(time.time()) + 3600))
    assert later["timeline"] == [] and later["window"]["passes"] == 0

    hourly = report_json(tier, "--since", "1d", "--bucket", "1h")
    assert hourly["bucket_seconds"] == 3600
    assert all(b["end"] - b["start"] == 3600 for b in hourly["timeline"])


# -- text -----------------------------------------------------------------------------------------------
def _row(text: str, *cells: str) -> bool:
    """Whether a table row holds these cells, in order, in the rich table output."""
    bar = r"[│|]"  # box drawing on a terminal, ASCII when piped
    pattern = bar + r"\s*" + (r"\s*" + bar + r"\s*").join(re.escape(cell) for cell in cells) + r"\s*" + bar
    return re.search(pattern, text) is not None


def test_text_tables_show_the_same_numbers(fleet: tuple[Tier, list]) -> None:
    tier, _ = fleet
    result = nkicache(tier, "report")
    assert result.exit_code == 0, result.output
    text = result.stdout
    for label, value in (("passes", "3"), ("kernels (internal kernel ops compiled)", "24"),
                         ("in-pass hits (the pass's own cache)", "6"), ("in-pass misses", "18"),
                         ("tier lookups (in-pass misses that asked the shared tier)", "18"),
                         ("remote hits (answered by the shared tier)", "10"),
                         ("traces (misses neither cache answered; beta3 compiles run)", "8"),
                         ("shared-cache hit rate (remote_hits / tier_lookups)", "55.6%"),
                         ("in-pass hit rate (cache_hits / kernels)", "25.0%"), ("tier errors", "0"),
                         ("tier entries rejected", "0"), ("distinct variants (cache keys)", "8")):  # fmt: skip
        assert _row(text, label, value), label
    assert _row(text, "matmul_tiled", "9", "4")
    assert _row(text, "softmax", "9", "2")
    assert _row(text, "rmsnorm", "6", "2")
    # passes, kernels, in-pass hits, tier lookups, remote hits, traces, shared-cache and in-pass hit rates
    assert _row(text, "hostA", "w1", "2", "16", "4", "12", "4", "8", "33.3%", "25.0%")
    assert _row(text, "hostB", "w2", "1", "8", "2", "6", "6", "0", "100.0%", "25.0%")
    assert _row(text, "1", "softmax", "6", "[32,48]", "[32,48]", "float32")
    assert _row(text, "2", "matmul_tiled", "4", "[64,32] [64,48]", "[32,48]", "float32")
    assert "Hit rates over time" in text
    assert "In these buckets: 3 passes, 24 kernels, shared-cache hit rate 55.6%, in-pass hit rate 25.0%" in text


# -- Prometheus -----------------------------------------------------------------------------------------
def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def assert_prometheus_matches_the_run(text: str) -> None:
    samples = _samples(text)
    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert families["nkicache_passes"] == "counter"
    assert families["nkicache_shared_hit_ratio"] == families["nkicache_in_pass_hit_ratio"] == "gauge"
    for name, value in EXPECTED_TOTALS.items():
        assert samples[(f"nkicache_{name}_total", ())] == value, name
    assert samples[("nkicache_shared_hit_ratio", ())] == pytest.approx(EXPECTED_SHARED_HIT_RATE, abs=1e-6)
    assert samples[("nkicache_in_pass_hit_ratio", ())] == pytest.approx(EXPECTED_IN_PASS_HIT_RATE, abs=1e-6)
    assert samples[("nkicache_variants", ())] == EXPECTED_VARIANTS
    assert samples[("nkicache_tier_up", ())] == 1
    for (host, worker), expected in EXPECTED_WORKERS.items():
        labels = (("host", host), ("worker", worker))
        for name, value in expected.items():
            assert samples[(f"nkicache_worker_{name}_total", labels)] == value, (host, worker, name)
    for kernel, stats in EXPECTED_KERNELS.items():
        assert samples[("nkicache_kernel_calls_total", (("kernel", kernel),))] == stats["call_count"]
        assert samples[("nkicache_kernel_variants", (("kernel", kernel),))] == stats["variants"]


def test_prometheus_text_parses_back_to_the_run(fleet: tuple[Tier, list]) -> None:
    tier, _ = fleet
    result = nkicache(tier, "report", "--prometheus")
    assert result.exit_code == 0, result.output
    assert_prometheus_matches_the_run(result.stdout)


def test_serve_metrics_reads_the_tier_on_every_scrape(fleet: tuple[Tier, list], tmp_path: Path) -> None:
    tier, _ = fleet
    process = subprocess.Popen(
        [sys.executable, "-m", "workers.cli", "serve-metrics", "--tier", tier.url, "--port", "0"],
        cwd=ROOT, env={**_environment(), **tier.env()}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = process.stderr.readline()
        match = re.search(r"serving http://127\.0\.0\.1:(\d+)/metrics", line)
        assert match, line
        url = f"http://127.0.0.1:{match.group(1)}/metrics"
        assert_prometheus_matches_the_run(_get(url))
        # Another pass lands in the tier: the next scrape sees it.
        run_known_fleet(tier)
        assert _samples(_get(url))[("nkicache_passes_total", ())] == 6
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert process.returncode == 0


def _environment() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("NKICACHE_")}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def test_a_tier_that_cannot_be_read_is_tier_up_0_not_a_failed_scrape() -> None:
    def broken() -> Any:
        raise NkiCacheError("redis://10.0.0.1:6379: ConnectionError")

    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(broken))
    assert _samples(generate_latest(registry).decode()) == {("nkicache_tier_up", ()): 0}


# -- per toolchain --------------------------------------------------------------------------------------
OLD_TOOLCHAIN = "0123456789abcdef"  # the compiler before an upgrade
OLD_PASS = {"passes": 1, "kernels": 10, "cache_hits": 4, "cache_misses": 6, "tier_lookups": 6, "remote_hits": 6,
            "traces": 0}  # fmt: skip


def test_the_fleet_is_broken_down_per_toolchain_in_every_output(tier: Tier) -> None:
    """The known fleet run by this compiler, after a warm pass of the compiler it replaced: the upgrade's cold
    start (8 traces, 66.7%) shows apart from the old compiler's warm cache (100%)."""
    tier.backend.apply_metrics(MetricsBatch("old-pass", "hostC", "w9", dict(OLD_PASS), {}, {},
                                            {**OLD_PASS, "finished": time.time() - 60}, OLD_TOOLCHAIN))  # fmt: skip
    run_known_fleet(tier)
    this = toolchain_id()

    report = report_json(tier)
    assert list(report["per_toolchain"]) == sorted([this, OLD_TOOLCHAIN])
    ours, old = report["per_toolchain"][this], report["per_toolchain"][OLD_TOOLCHAIN]
    assert set(ours) == set(report["totals"])  # the same counters, the hit rates included
    assert {name: ours[name] for name in EXPECTED_TOTALS} == EXPECTED_TOTALS
    assert ours["shared_hit_rate"] == pytest.approx(EXPECTED_SHARED_HIT_RATE, abs=1e-6)
    assert {name: old[name] for name in OLD_PASS} == OLD_PASS and old["shared_hit_rate"] == 1.0
    for name in TOTAL_COUNTERS:  # every batch named its toolchain: the toolchains sum to the fleet
        assert ours[name] + old[name] == pytest.approx(report["totals"][name], abs=1e-6), name
    # The pass log says which compiler ran each pass.
    assert [record.get("toolchain") for _, record in tier.backend.pass_log(None)] == [None] + [this] * 3

    text = nkicache(tier, "report").stdout
    assert "Per toolchain" in text
    assert _row(text, f"{this} (this compiler)", "3", "24", "6", "18", "10", "8", "55.6%", "25.0%")
    assert _row(text, OLD_TOOLCHAIN, "1", "10", "4", "6", "6", "0", "100.0%", "40.0%")

    samples = _samples(nkicache(tier, "report", "--prometheus").stdout)
    for toolchain, expected in ((this, EXPECTED_TOTALS), (OLD_TOOLCHAIN, OLD_PASS)):
        labels = (("toolchain", toolchain),)
        for name, value in expected.items():
            assert samples[(f"nkicache_toolchain_{name}_total", labels)] == value, (toolchain, name)
    assert samples[("nkicache_toolchain_shared_hit_ratio", (("toolchain", this),))] == pytest.approx(
        EXPECTED_SHARED_HIT_RATE
    )

    page = render_html(build_report(tier.backend))
    section = page[page.index('<h2 id="per-toolchain">') :]
    assert f"<td>{this} (this compiler)</td>" in section and f"<td>{OLD_TOOLCHAIN}</td>" in section
    assert '<td class="n">55.6%</td>' in section


def test_without_batches_naming_a_toolchain_there_is_no_breakdown(tier: Tier) -> None:
    tier.backend.apply_metrics(MetricsBatch("anonymous", "hostC", "w9", dict(OLD_PASS)))
    assert report_json(tier)["per_toolchain"] == {}
    assert "Per toolchain" not in nkicache(tier, "report").stdout
    assert "No pass named its toolchain." in render_html(build_report(tier.backend))


# -- edges ----------------------------------------------------------------------------------------------
def test_an_empty_tier_reports_zeros(tier: Tier) -> None:
    report = report_json(tier)
    assert report["totals"] == {**dict.fromkeys(TOTAL_COUNTERS, 0), "shared_hit_rate": None, "in_pass_hit_rate": None}
    assert report["per_kernel"] == {} and report["timeline"] == [] and report["top_variants"] == []
    assert "No passes in the pass log." in nkicache(tier, "report").stdout
    assert "nkicache_passes_total 0.0" in nkicache(tier, "report", "--prometheus").stdout


def _strict(text: str) -> Any:
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_counts_a_tier_holds_as_nan_or_infinity_never_reach_the_output(tmp_path: Path) -> None:
    """A local tier written before batches were checked: SQLite keeps an infinity (and a pass log record may
    hold anything). Every output still reads, and the JSON is JSON."""
    import sqlite3

    from cachestore.backends.sqlite import SqliteBackend

    path = tmp_path / "tier.sqlite"
    backend = SqliteBackend(path)
    backend.apply_metrics(MetricsBatch("p1", "h", "w", {"passes": 1, "kernels": 4, "traces": 2, "compile_seconds": 1.5},
                                       {}, {}, {"passes": 1, "kernels": 4, "finished": time.time()},
                                       "0123456789abcdef"))  # fmt: skip
    backend.close()
    db = sqlite3.connect(path, isolation_level=None)
    for table in ("totals", "worker_totals", "toolchain_totals"):
        db.execute(f"UPDATE {table} SET value = ? WHERE name IN ('kernels', 'compile_seconds')", (float("inf"),))
    db.execute("INSERT INTO pass_log (ts, record) VALUES (?, ?)",
               (time.time(), '{"passes": 1, "kernels": NaN, "traces": Infinity, "finished": NaN}'))  # fmt: skip
    db.close()
    tier = Tier("local", f"local:{path}", unique_namespace(), None)

    result = nkicache(tier, "report", "--json")
    assert result.exit_code == 0, result.output
    report = _strict(result.stdout)
    for counts in (report["totals"], report["per_toolchain"]["0123456789abcdef"],
                   report["per_host"]["h"]["workers"]["w"]):  # fmt: skip
        assert (counts["passes"], counts["kernels"], counts["traces"], counts["compile_seconds"]) == (1, 0, 2, 0.0)
    assert (report["window"]["passes"], report["window"]["kernels"], report["window"]["traces"]) == (2, 4, 0)
    for args in (("report",), ("report", "--prometheus")):
        assert nkicache(tier, *args).exit_code == 0


def test_json_text_refuses_a_non_finite_number_by_name() -> None:
    assert json_text({"a": [1.5, {"b": 2}]}) == '{"a": [1.5, {"b": 2}]}'
    nan_total = {"totals": {"compile_seconds": float("nan")}}
    infinite_in_a_list = {"graphs": [{"x": 1}, {"tier_saved_seconds": float("-inf")}]}
    for bad, where in ((nan_total, "$.totals.compile_seconds"), (infinite_in_a_list, "$.graphs[1].tier_saved_seconds")):
        with pytest.raises(NkiCacheError, match=re.escape(f"cannot print JSON: {where} is not a finite number")):
            json_text(bad)


def test_a_fresh_machine_reports_zeros_in_every_format(tmp_path: Path) -> None:
    """No local tier yet (nothing compiled): zeros and exit 0, as sccache -s, not an error."""
    missing = f"local:{tmp_path / 'nothing.sqlite'}"
    text = nkicache(None, "report", "--tier", missing)
    assert text.exit_code == 0, text.output
    assert "not created yet" in text.stdout and "No passes in the pass log." in text.stdout
    report = json.loads(nkicache(None, "report", "--tier", missing, "--json").stdout)
    assert report["totals"] == {**dict.fromkeys(TOTAL_COUNTERS, 0), "shared_hit_rate": None, "in_pass_hit_rate": None}
    exposition = nkicache(None, "report", "--tier", missing, "--prometheus")
    assert exposition.exit_code == 0 and "nkicache_passes_total 0.0" in exposition.stdout
    assert not (tmp_path / "nothing.sqlite").exists()  # reading never creates a tier
    # The default tier of a fresh machine (no config, nothing compiled) the same.
    assert nkicache(None, "report", "--json").exit_code == 0


def test_report_flags_are_checked(tmp_path: Path) -> None:
    assert nkicache(None, "report", "--json", "--prometheus").exit_code == 2
    assert "not a time" in nkicache(None, "report", "--since", "yesterday-ish").output
    assert nkicache(None, "report", "--tier", "off").exit_code == 2


@pytest.mark.redis
def test_redis_reads_stream_with_scan_never_keys(redis_url: str) -> None:
    """Every Redis call the report and inspection make, through a client that refuses KEYS."""
    import redis
    from helpers_graphs import delete_namespace, unique_namespace

    from cachestore.entry import SignaturePolicy
    from cachestore.inspect import disk_usage, list_entries
    from workers.verify import verify_entries

    namespace = unique_namespace()
    client = redis.Redis.from_url(redis_url)
    tier = Tier("redis", redis_url, namespace, None, client)
    try:
        run_known_fleet(tier)

        class NoKeys:
            def __init__(self, inner: Any):
                self.inner = inner

            def keys(self, *args: Any, **kwargs: Any) -> Any:
                raise AssertionError("KEYS must never be used")

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        reader = RedisBackend(NoKeys(client), KeySpace(namespace))
        assert build_report(reader).totals["kernels"] == 24
        assert len(list(list_entries(reader))) == 8
        assert disk_usage(reader)["total"]["entries"] == 8
        assert verify_entries(reader, SignaturePolicy()).ok == 8
    finally:
        delete_namespace(client, namespace)
        client.close()


def test_render_prometheus_needs_no_tier_access_at_registration() -> None:
    """The registry never calls collect() on registration (that would read the tier at start-up)."""
    calls = []

    def build() -> Any:
        calls.append(1)
        raise NkiCacheError("down")

    from prometheus_client import generate_latest

    from cachestore.report_render import prometheus_registry

    registry = prometheus_registry(build)
    assert calls == []
    assert "nkicache_tier_up 0.0" in generate_latest(registry).decode()
    assert calls == [1]


# -- parsing times and sizes ----------------------------------------------------------------------------
def test_durations_times_and_sizes() -> None:
    assert parse_duration("90") == 90 and parse_duration("30m") == 1800 and parse_duration("7d") == 7 * 86400
    assert parse_since("2h", now=10_000.0) == 10_000.0 - 7200
    assert parse_since("1700000000") == 1_700_000_000
    assert parse_since("2024-05-01T12:00:00+00:00") == 1_714_564_800
    assert parse_size("1000") == 1000 and parse_size("64MiB") == 64 * 1024**2 and parse_size("2G") == 2 * 10**9
    for bad, parse in (("soon", parse_duration), ("yesterday", parse_since), ("12 apples", parse_size)):
        with pytest.raises(ValueError):
            parse(bad)


# -- report --zero ----------------------------------------------------------------------------------------------
def test_zero_resets_the_counters_and_the_pass_log_shows_it(fleet: tuple[Tier, list]) -> None:
    tier, _ = fleet
    zeroed = nkicache(tier, "report", "--zero", "--json", env={"NKICACHE_HOST": "ops", "NKICACHE_WORKER": "alice"})
    assert zeroed.exit_code == 0, zeroed.output
    answer = json.loads(zeroed.stdout)
    assert answer["zeroed"] is True
    assert {name: answer["previous"][name] for name in EXPECTED_TOTALS} == EXPECTED_TOTALS

    report = report_json(tier)
    assert report["totals"] == {**dict.fromkeys(TOTAL_COUNTERS, 0), "shared_hit_rate": None, "in_pass_hit_rate": None}
    assert report["per_host"] == {} and report["per_toolchain"] == {}
    # History and what gc and warm rank by are kept: the pass log, the per-kernel counts, the key usage.
    assert sum(b["passes"] for b in report["timeline"]) == 3
    assert report["per_kernel"] == EXPECTED_KERNELS and report["variants"] == EXPECTED_VARIANTS
    assert [(z["host"], z["worker"]) for z in report["zeroed"]] == [("ops", "alice")]
    assert report["zeroed"][0]["when"] == pytest.approx(answer["when"], abs=1)
    assert "Counters zeroed " in nkicache(tier, "report").stdout and "by ops/alice" in nkicache(tier, "report").stdout

    run_known_fleet(tier)  # counting starts again from 0
    after = report_json(tier)
    # The same passes, now warm: every tier lookup is a remote hit, nothing is traced.
    warm = {**EXPECTED_TOTALS, "remote_hits": EXPECTED_TOTALS["tier_lookups"], "traces": 0}
    assert {name: after["totals"][name] for name in EXPECTED_TOTALS} == warm


def test_zero_makes_no_report(tmp_path: Path) -> None:
    assert nkicache(None, "report", "--zero", "--prometheus").exit_code == 2
