"""Shared configuration keys no single writer can turn into an outage (issue 35): with `metrics-shards` and
`job-shards` holding no count, compiles record every metrics batch, `report` answers in every format with the
fleet's totals, a scrape is `tier_up 1`, and the job queue goes on; each process warns of a bad value once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from helpers_graphs import delete_namespace, unique_namespace

from cachestore.keys import DEFAULT_JOB_SHARDS, KeySpace
from cachestore.report import build_report
from cachestore.report_render import prometheus_registry
from cachestore.settings import Settings
from cachestore.stores import open_backend
from workers.cli import main
from workers.fleet import fix_job_shards, job_shards

GRAPHS = Path(__file__).parent / "data" / "graphs"
COMPILES = 2


@pytest.fixture(params=["abc", "100000000"])
def garbage_namespace(request: pytest.FixtureRequest, redis_client: redis.Redis) -> tuple[str, str]:
    """(namespace, the garbage) with both shard counts holding the garbage before anything is recorded."""
    namespace = unique_namespace()
    keys = KeySpace(namespace)
    redis_client.set(keys.metrics_shard_count, request.param)
    redis_client.set(keys.job_shard_count, request.param)
    yield namespace, request.param
    delete_namespace(redis_client, namespace)


def invoke(namespace: str, *args: str):
    return CliRunner().invoke(main, [str(a) for a in args], env={"NKICACHE_NAMESPACE": namespace})


def test_garbage_shard_counts_lose_no_batch_and_fail_no_report(
    garbage_namespace: tuple[str, str], redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    namespace, garbage = garbage_namespace
    compiled = {"passes": 0, "kernels": 0}
    for n in range(COMPILES):
        result = invoke(namespace, "compile", GRAPHS, "--json", "--tier", redis_url, "--out", tmp_path / f"out{n}")
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        assert (summary["tier_dropped"], summary["tier_errors"]) == (0, 0), summary
        compiled = {name: compiled[name] + summary[name] for name in compiled}

    result = invoke(namespace, "report", "--json", "--tier", redis_url)
    assert result.exit_code == 0, result.output
    totals = json.loads(result.stdout)["totals"]
    assert {name: totals[name] for name in compiled} == compiled
    text = invoke(namespace, "report", "--tier", redis_url)
    assert text.exit_code == 0 and f"{compiled['passes']} passes" in text.stdout.replace(",", ""), text.output
    prometheus = invoke(namespace, "report", "--prometheus", "--tier", redis_url)
    assert prometheus.exit_code == 0, prometheus.output
    assert f"nkicache_passes_total {float(compiled['passes'])}" in prometheus.stdout, prometheus.stdout
    html = invoke(namespace, "report", "--html", tmp_path / "report.html", "--tier", redis_url)
    assert html.exit_code == 0 and (tmp_path / "report.html").stat().st_size > 0, html.output

    # serve-metrics' collector, as a scrape reads it
    settings = Settings(tier=redis_url, namespace=namespace)

    def build():
        reader = open_backend(settings, reading=True)
        try:
            return build_report(reader, top=0, timeline=False, coverage=False)
        finally:
            reader.close()

    samples = {m.name: m.samples[0].value for m in prometheus_registry(build).collect() if m.samples}
    assert samples["nkicache_tier_up"] == 1

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and garbage in r.getMessage()]
    assert warnings and all("metrics-shards" in w and "\n" not in w for w in warnings), warnings
    assert len(set(warnings)) == 1  # one warning of the one bad value, not one per read


def test_a_garbage_job_shard_count_is_the_setting(garbage_namespace: tuple[str, str], redis_client) -> None:
    namespace, _ = garbage_namespace
    keys = KeySpace(namespace)
    assert job_shards(redis_client, keys) == DEFAULT_JOB_SHARDS
    assert fix_job_shards(redis_client, keys, 4) == 4  # a submitter and a worker of job_shards = 4 agree on 4
