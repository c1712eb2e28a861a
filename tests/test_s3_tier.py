"""The S3 tier (`s3://BUCKET/PREFIX`, cachestore.backends.s3) end to end against moto's S3 server: compiles
cold and warm, two at once, reports and inspection, a server stopped mid-compile, and a stack in front of it.
The store contract runs on it in tests/test_store_contract.py."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_tier_cli import GRAPHS, artifacts, cli, compile_json, compile_process, listed_keys

from bench.dev_s3 import S3Server
from cachestore.api import TierTimeout, TierUnavailable
from cachestore.backends import s3
from workers.cli import main
from workers.workload import generate_workload


def test_the_module_is_at_most_200_lines() -> None:
    assert len(Path(s3.__file__).read_text().splitlines()) <= 200


def test_a_cold_then_a_warm_compile_match_a_compile_without_a_tier(s3_tier: str, tmp_path: Path) -> None:
    off = compile_json(GRAPHS, "off", tmp_path / "off")
    cold = compile_json(GRAPHS, s3_tier, tmp_path / "cold")
    warm = compile_json(GRAPHS, s3_tier, tmp_path / "warm")
    assert cold["traces"] == off["traces"] > 0 and cold["tier_errors"] == 0
    assert warm["traces"] == 0 and warm["remote_hits"] == warm["tier_lookups"] == cold["traces"]
    assert (warm["tier_errors"], warm["tier_rejected"], warm["tier_dropped"]) == (0, 0, 0)
    assert artifacts(tmp_path / "cold") == artifacts(tmp_path / "off") == artifacts(tmp_path / "warm")
    # The reader side on the same bucket: ls, verify and the fleet report.
    assert len(listed_keys(s3_tier)) == cold["traces"]
    assert "0 problems" in cli("inspect", "verify", "--tier", s3_tier)
    report = json.loads(cli("report", "--tier", s3_tier, "--json"))
    assert report["totals"]["passes"] == cold["passes"] + warm["passes"]
    assert report["totals"]["traces"] == cold["traces"]


@pytest.mark.slow
def test_two_compiles_of_overlapping_workloads_at_once_trace_each_variant_once(s3_tier: str, tmp_path: Path) -> None:
    workloads = [tmp_path / "two-models", tmp_path / "three-models"]
    generate_workload(workloads[0], 2, 0)
    generate_workload(workloads[1], 3, 0)  # the same seed: the two models and one more
    # One process each: a pass takes a lease before it traces, which is what this tests on S3 (the variants a
    # `--workers 2` compile traces ahead are in hand before any lease, and its pass takes them without one).
    processes = [compile_process(graphs, s3_tier, tmp_path / f"out-{graphs.name}", 1) for graphs in workloads]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        results.append(json.loads(out))
    for result in results:
        assert (result["tier_errors"], result["tier_timeouts"], result["tier_rejected"]) == (0, 0, 0), result
    stored = listed_keys(s3_tier)
    assert sum(result["traces"] for result in results) == len(stored) > 0  # no variant traced twice
    for graphs in workloads:
        compile_json(graphs, "off", tmp_path / f"off-{graphs.name}")
        assert artifacts(tmp_path / f"out-{graphs.name}") == artifacts(tmp_path / f"off-{graphs.name}")


@pytest.mark.slow
def test_a_server_stopped_mid_compile_costs_counted_faults_not_the_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = S3Server()  # its own: stopped by this test
    try:
        for name, value in server.environment.items():
            monkeypatch.setenv(name, value)
        bucket = server.new_bucket()
        generate_workload(tmp_path / "graphs", 6, 0)  # 31 variants: the server stops a third of the way
        process = compile_process(tmp_path / "graphs", f"s3://{bucket}", tmp_path / "out")
        deadline = time.monotonic() + 120
        while len(server.object_names(bucket, "entries/")) < 10 and process.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        server.stop()
        out, err = process.communicate(timeout=300)
    finally:
        server.stop()
    assert process.returncode == 0, err
    done = json.loads(out)
    assert done["tier_errors"] + done["tier_timeouts"] >= 1 and done["traces"] > 10, done
    compile_json(tmp_path / "graphs", "off", tmp_path / "off")
    assert artifacts(tmp_path / "out") == artifacts(tmp_path / "off")


def test_a_local_level_in_front_of_s3_fills_from_it(s3_tier: str, tmp_path: Path) -> None:
    first = f"local:{tmp_path / 'first.sqlite'} {s3_tier}"
    cold = compile_json(GRAPHS, first, tmp_path / "cold")
    second = f"local:{tmp_path / 'second.sqlite'} {s3_tier}"  # another machine: a new local level, the same bucket
    warm = compile_json(GRAPHS, second, tmp_path / "warm")
    again = compile_json(GRAPHS, second, tmp_path / "again")
    assert cold["traces"] > 0 and warm["traces"] == again["traces"] == 0
    assert warm["remote_hits"] == cold["traces"] and (warm["tier_errors"], again["tier_errors"]) == (0, 0)
    assert artifacts(tmp_path / "cold") == artifacts(tmp_path / "warm") == artifacts(tmp_path / "again")
    assert listed_keys(f"local:{tmp_path / 'second.sqlite'}") == listed_keys(s3_tier)


def test_a_missing_bucket_is_counted_and_the_compile_goes_on(s3_tier: str, tmp_path: Path) -> None:
    done = compile_json(GRAPHS, "s3://nkicache-no-such-bucket/x", tmp_path / "out")
    assert done["tier_errors"] >= 1 and done["traces"] > 0 and done["remote_hits"] == 0, done
    compile_json(GRAPHS, "off", tmp_path / "off")
    assert artifacts(tmp_path / "out") == artifacts(tmp_path / "off")
    result = CliRunner().invoke(main, ["inspect", "ls", "--tier", "s3://nkicache-no-such-bucket/x"])
    assert result.exit_code != 0 and "s3://nkicache-no-such-bucket/x" in result.output


def test_plain_http_goes_to_a_loopback_endpoint_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3.example.com:9000")
    with pytest.raises(TierUnavailable, match=r"plain http to http://s3.example.com:9000 \(only to a loopback"):
        s3.ObjectStore("bucket", "", op_timeout=1.0, connect_timeout=1.0)
    for endpoint in ("http://127.0.0.1:9000", "http://localhost:9000", "http://[::1]:9000", "https://s3.example.com"):
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        s3.ObjectStore("bucket", "", op_timeout=1.0, connect_timeout=1.0).close()


def test_a_foreign_object_under_an_entrys_name_is_rejected_and_never_served(
    s3_tier: str, s3_server: S3Server, tmp_path: Path
) -> None:
    cold = compile_json(GRAPHS, s3_tier, tmp_path / "cold")
    bucket, _, prefix = s3_tier.removeprefix("s3://").partition("/")
    entries = s3_server.object_names(bucket, f"{prefix}/entries/")
    s3_server.client.put_object(Bucket=bucket, Key=entries[0], Body=b"another tool's bytes")  # no expiry metadata
    s3_server.client.put_object(
        Bucket=bucket, Key=entries[1], Body=b"forged", Metadata={"nkicache-expires": "nan"}
    )  # fmt: skip
    warm = compile_json(GRAPHS, s3_tier, tmp_path / "warm")
    assert warm["traces"] == 2 and warm["remote_hits"] == cold["traces"] - 2 and warm["tier_errors"] == 0
    assert artifacts(tmp_path / "warm") == artifacts(tmp_path / "cold")


def test_a_server_that_never_answers_is_a_timeout_within_op_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nkicache-tests")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nkicache-tests")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # takes connections, says nothing
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        store = s3.ObjectStore("nkicache-test", "", op_timeout=0.3, connect_timeout=0.3)
        started = time.monotonic()
        with pytest.raises(TierTimeout, match=r"s3://nkicache-test: .*GET"):
            store.get(["a"], 10)
        assert time.monotonic() - started < 3.0
        store.close()
