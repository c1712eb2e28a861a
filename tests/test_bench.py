"""The benchmark measurements run and produce the figures `nkicache bench` reports (tiny workload; the
figures themselves are recorded in bench/RESULTS.md, not asserted here)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench import figures as bench
from bridge.ir import NKIKLIRKernel
from workers.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[bench.BenchConfig, list]:
    config = bench.BenchConfig(models=2, seed=3, repeats=1, quick=True, process_rounds=1)
    return config, bench.workload_graphs(tmp_path_factory.mktemp("graphs"), config)


def test_in_process_measurements_without_redis(tiny, tmp_path: Path) -> None:
    """The in-process measurements on the local tier (those on Redis: the keys test below)."""
    config, graphs = tiny
    warm = bench.warm_speedup(graphs, config, tmp_path)
    assert warm["warm_traces"] == 0 and warm["warm_speedup"] > 1
    assert bench.local_hit_cost(graphs, config)["local_hit_us"] > 0
    assert 0 < bench.key_throughput(graphs, config)["key_throughput_ratio"] < 1  # hashing alone is cheaper


@pytest.mark.redis  # report_scale.py starts a redis-server of its own
def test_bench_scripts_answer_json() -> None:
    """The scripts behind `nkicache bench` print one JSON object with their keys."""
    report = bench.bench_script("report_scale", "--sizes", "300", "--quick")
    assert {"report_seconds_300", "verify_seconds_300", "peak_rss_mib"} <= set(report)
    flood = bench.bench_script("fleet_flood", "--jobs", "20")
    assert flood["jobs"] == 20 and flood["flood_jobs_per_second"] > 0 and flood["floor_jobs_per_second"] > 0
    latency = bench.bench_script("fleet_latency", "--rounds", "1")
    assert latency["fleet_job_latency_vs_local"] == round(latency["submit_wait_ms"] / latency["local_ms"], 3) > 0


# What test_a_measurement_that_cannot_run_is_reported_as_skipped does not measure again (the tests above and below
# do), and the figures that then go unmeasured: those functions' own and what is computed from their details.
COVERED_ELSEWHERE = ("whole_process", "broken_tier", "mirror_overhead", "remote_hit_vs_raw_get", "signature_overhead",
                     "upgrade", "miss_cause_coverage", "l1_redis_read_reduction", "value_retention")  # fmt: skip
COVERED_FIGURES = (
    "warm_compile_local_vs_floor",
    *bench.PROCESS_FIGURES,
    "broken_tier_overhead",
    "mid_compile_fault_overhead",
    "mirror_overhead",
    "remote_hit_vs_raw_get",
    "signature_overhead",
    "upgrade_first_pass_hit_rate",
    "miss_cause_coverage",
    "miss_classification_overhead",
    "l1_redis_read_reduction",
    "value_retention_ratio",
)


def test_a_measurement_that_cannot_run_is_reported_as_skipped(
    tiny, private_redis_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A measurement that cannot run (here: every one behind a bench/ script) is skipped with its reason, with
    those measured from it; the in-process ones still run, and the exit status says the figures are incomplete.
    Measured once, with --json; the text output is then printed from the same figures."""
    config, _graphs = tiny

    def not_run(name: str, *args: str) -> dict:
        raise bench.MeasurementSkipped(f"bench/{name}.py is not run in this test")

    def covered(*args: object) -> dict:
        raise bench.MeasurementSkipped("measured by its own test")

    monkeypatch.setattr(bench, "bench_script", not_run)
    for name in COVERED_ELSEWHERE:  # the slow in-process ones; a few cheap ones run, to show the rest still do
        monkeypatch.setattr(bench, name, covered)
    monkeypatch.setattr(bench.BenchConfig, "for_mode", classmethod(lambda cls, quick: config))
    url = private_redis_server().url
    as_json = CliRunner().invoke(main, ["bench", "--redis-url", url, "--json"])
    assert as_json.exit_code == 1, as_json.output
    results = json.loads(as_json.stdout)
    skipped = results["skipped"]
    assert {name: why for name, why in skipped.items() if name not in COVERED_FIGURES} == {
        "pool_scaling": "bench/pool_scaling.py is not run in this test",
        "single_graph_scaling": "measured with pool_scaling, which was not",
        "fleet_single_graph_scaling": "bench/fleet_single_graph.py is not run in this test",
        "fleet_job_latency_vs_local": "bench/fleet_latency.py is not run in this test",
        "flood_jobs_per_second": "bench/fleet_flood.py is not run in this test",
        "report_seconds_100k": "bench/report_scale.py is not run in this test",
        "warm_compile_s3_vs_floor": "bench/s3_warm.py is not run in this test",
    }
    assert skipped["mid_compile_fault_overhead"] == "broken_tier_overhead was not measured"
    assert set(COVERED_FIGURES) <= set(skipped)
    assert "pool_scaling" not in results and "report_seconds_100k_detail" not in results
    assert 0 < results["storage_ratio"] < 1 and results["local_hit_us"] > 0
    assert results["wire_bytes_ratio"] == results["storage_ratio_detail"]["wire_bytes_ratio"]
    assert results["warm_speedup_redis"] > 1

    monkeypatch.setattr(bench, "run_benchmarks", lambda config, redis_url, progress: results)
    text = CliRunner().invoke(main, ["bench", "--redis-url", url])
    assert text.exit_code == 1, text.output
    lines = text.stdout.splitlines()
    assert "pool_scaling             skipped: bench/pool_scaling.py is not run in this test" in lines
    assert "report_seconds_100k      skipped: bench/report_scale.py is not run in this test" in lines
    assert any(line.startswith("warm_speedup ") and "goal >= 100.0" in line for line in lines)
    assert any(line.startswith(f"{'storage_ratio':24} {results['storage_ratio']:.3f}") for line in lines)


def test_the_s3_figure_times_a_warm_compile_that_reads_every_entry_from_s3() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "s3_warm.py"), "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["warm_compile_s3_ms"] > 0 and figures["floor_s3_ms"] > 0 and figures["objects_read"] > 1
    assert figures["warm_compile_s3_vs_floor"] == round(figures["warm_compile_s3_ms"] / figures["floor_s3_ms"], 3)


def test_bench_help_names_every_goal() -> None:
    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0
    for key in ("warm_speedup", "mirror_overhead", "remote_hit_vs_raw_get", "local_hit_us", "key_throughput_ratio",
                "pool_scaling", "report_seconds_100k", "storage_ratio", "upgrade_first_pass_hit_rate",
                "warm_speedup_redis", "wire_bytes_ratio", "mirror_overhead_direct", "signature_overhead",
                "l1_redis_read_reduction", "value_retention_ratio", "single_graph_scaling",
                "fleet_single_graph_scaling"):  # fmt: skip
        assert key in result.output


@pytest.mark.redis  # the measurement starts a redis-server of its own (it counts commands with INFO)
def test_l1_measurement(tiny, tmp_path: Path) -> None:
    """A second compile through a local level asks Redis (nearly) nothing; the measurement compares artifacts."""
    config, _graphs = tiny
    measured = bench.l1_redis_read_reduction(config, tmp_path)
    assert measured["redis_reads_alone"] > 0 and measured["traces_second_compile"] == 0
    assert measured["l1_redis_read_reduction"] >= 0.9 and measured["artifacts_identical"]
    local, remote = measured["level_hits_stacked"].values()
    assert local > 0 and remote == 0


def test_upgrade_measurement(tiny, tmp_path: Path) -> None:
    config, _graphs = tiny
    upgrade = bench.upgrade(config, tmp_path)
    assert upgrade["variants"] > 0 and upgrade["warmed"] == upgrade["variants"]
    assert upgrade["upgrade_first_pass_hit_rate"] == 1.0 and upgrade["first_pass_traces"] == 0
    assert upgrade["warm_seconds_per_variant"] > 0 and upgrade["cold_seconds_per_trace"] > 0


def test_the_redis_measurements_answer_and_delete_the_keys_they_wrote(
    tiny, private_redis_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every measurement that writes to the Redis `bench --redis-url` names produces its figures, and as that Redis
    may be in use, its own nkibench-* keys go at the end and nothing else does."""
    import redis

    config, _graphs = tiny
    url = private_redis_server().url
    client = redis.Redis.from_url(url)
    client.set("someone-else:key", b"kept")

    def skipped(*args: object) -> dict:
        raise bench.MeasurementSkipped("not measured in this test")

    for name in (  # what never writes to the Redis it is given (no tier, or a server of its own)
        "broken_tier",
        "warm_speedup",
        "local_hit_cost",
        "key_throughput",
        "pool_scaling",
        "report_scale",
        "upgrade",
        "fleet_single_graph_scaling",
        "fleet_latency",
        "fleet_flood",
        "s3_warm",
        "l1_redis_read_reduction",
        "value_retention",
    ):
        monkeypatch.setattr(bench, name, skipped)
    results = bench.run_benchmarks(config, url, lambda name: None)
    assert set(results["skipped"]) == {
        "broken_tier_overhead", "mid_compile_fault_overhead", "warm_compile_s3_vs_floor", "warm_speedup",
        "local_hit_us", "key_throughput_ratio", "pool_scaling", "single_graph_scaling", "fleet_single_graph_scaling",
        "fleet_job_latency_vs_local", "flood_jobs_per_second", "report_seconds_100k", "upgrade_first_pass_hit_rate",
        "l1_redis_read_reduction", "value_retention_ratio",
    }, results["skipped"]  # fmt: skip

    # Every whole-process figure from real `nkicache` processes beside its floor; the warm compiles traced nothing
    # (the measurement refuses a warm figure that traced).
    figures = results["warm_compile_local_vs_floor_detail"]
    for name in ("warm_compile_local_vs_floor", *bench.PROCESS_FIGURES):
        assert figures[name] > 0, name
    assert figures["warm_compile_local_vs_floor"] == round(
        figures["warm_compile_local_ms"] / figures["floor_local_ms"], 3
    )
    assert figures["version_goal_ms"] == round(3 * figures["python_ms"] + 60, 1)
    assert figures["floor_local_ms"] > figures["python_ms"] * 0.5 and figures["kernels"] > 0

    warm_redis = results["warm_speedup_redis_detail"]
    assert warm_redis["warm_traces"] == 0 and warm_redis["warm_speedup_redis"] > 1
    mirror = results["mirror_overhead_detail"]
    assert mirror["mirror_overhead"] > 0 and 1 <= mirror["mirror_overhead_direct"] < 2
    runs = mirror["tier_seconds_in_compile_thread_runs"]
    assert len(runs) == config.repeats and mirror["tier_seconds_in_compile_thread"] == statistics.median(runs) > 0
    hits = results["remote_hit_vs_raw_get_detail"]
    assert hits["entries"] > 0 and hits["remote_hit_us"] > 0 and hits["batched_hit_us"] > 0
    signed = results["signature_overhead_detail"]
    assert signed["entries"] > 0 and signed["rejected"] == 0 and signed["first_check_us"] > signed["memo_check_us"] > 0
    # Each entry is signed alone: a first hit verifies it once, a later pass's hit of it not again.
    assert 0 < signed["prefetch_verifies_per_hit"] <= 1 and signed["first_hit_verifies_per_hit"] == 1
    assert signed["signed"] == signed["entries"] and signed["big_pass_hits"] > 0
    assert signed["signature_overhead"] >= signed["signature_overhead_prefetch"]
    # Every first-hit figure a median of fresh readers.
    assert len(signed["signature_overhead_prefetch_runs"]) == len(signed["signature_overhead_first_hit_runs"]) == 5
    assert signed["signature_overhead_prefetch"] in signed["signature_overhead_prefetch_runs"]
    storage = results["storage_ratio_detail"]
    assert 0 < storage["storage_ratio"] < 1 and storage["entries"] == storage["unique_binaries"]  # compressed
    assert 0 < storage["wire_bytes_ratio"] < 1 and storage["wire_bytes"] > 0
    assert results["wire_bytes_ratio"] == storage["wire_bytes_ratio"]

    # Then their keys were deleted. (SCAN may return a key twice while Redis rehashes the keyspace the cleanup
    # just shrank.)
    assert {key.decode() for key in client.scan_iter()} == {"someone-else:key"}
    client.close()


@pytest.mark.redis  # a redis-server of its own, stopped with SIGSTOP
def test_broken_tier_measurement(tmp_path: Path) -> None:
    """A Redis down, frozen or trickling from the start, or frozen or killed mid-compile, each gives tier off's
    artifacts; each figure is the worst of its kind over off."""
    from bench.broken_tier import broken_tier_overhead
    from workers.workload import generate_workload

    generate_workload(tmp_path / "graphs", 2, 3)
    figures = broken_tier_overhead(tmp_path / "graphs", tmp_path / "work", rounds=1)
    worse = max(figures["down_ms"], figures["frozen_ms"], figures["trickling_ms"])
    assert figures["broken_tier_overhead"] == round(worse / figures["off_ms"], 3) > 0
    mid = max(figures["frozen_mid_ms"], figures["killed_mid_ms"])
    assert figures["mid_compile_fault_overhead"] == round(mid / figures["off_ms"], 3) > 0
    traces = figures["traces"]
    assert traces["down"] == traces["frozen"] == traces["trickling"] == traces["off"] > 0
    assert 0 < traces["frozen_mid"] <= traces["off"] and 0 < traces["killed_mid"] <= traces["off"]


def test_a_timed_store_times_the_loops_calls_and_changes_nothing(tiny, tmp_path: Path) -> None:
    """The figures time a compile's tier calls through a wrapper: the compile through it is the compile without
    it (same traces, same binaries, same counts), and each call the loop made is timed under its name."""
    from bench.timed_store import TimedStore
    from cachestore.settings import load_settings
    from cachestore.stores import open_tier

    _config, graphs = tiny
    bare_settings = load_settings({"tier": f"local:{tmp_path / 'bare.db'}"})
    timed_settings = load_settings({"tier": f"local:{tmp_path / 'timed.db'}"})
    bare, inner = open_tier(bare_settings), open_tier(timed_settings)
    timed = TimedStore(inner)
    try:
        bare_traces, bare_blocks = bench.compile_all(graphs, bare)
        timed_traces, timed_blocks = bench.compile_all(graphs, timed)
        assert timed_traces == bare_traces > 0
        assert binaries(timed_blocks) == binaries(bare_blocks) != []
        assert bare.flush(30) and inner.flush(30)  # the metrics batches are sent behind the compile
        assert timed.counts() == bare.counts()
        assert {"find_traces", "publish_trace", "record_pass"} <= set(timed.seconds)
        assert all(seconds > 0 for seconds in timed.seconds.values())
        assert timed.total == pytest.approx(sum(timed.seconds.values()))
    finally:
        bare.close()
        inner.close()


def binaries(blocks: list) -> list[bytes]:
    return [inst.klir_binary for block in blocks for inst in block.instructions if isinstance(inst, NKIKLIRKernel)]
