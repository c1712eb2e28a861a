"""`nkicache warm`: a new compiler traces the old one's most used variants before it takes traffic, and
then compiles the workload without tracing anything, producing its own binaries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_graphs import mixed_graph, write_graph
from test_toolchain_tier import SOFTMAX_MATHS, compiler_copy

from bridge.identity import fingerprint, toolchain_id
from workers.workload import generate_workload


def nkicache(folder: Path | None, cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The command line of the compiler in `folder` (None: the installed one), in a process of its own."""
    environment = {**os.environ, **(env or {})}
    if folder is not None:
        environment["PYTHONPATH"] = os.pathsep.join([str(folder), environment.get("PYTHONPATH", "")])
    command = [sys.executable, "-c", "from workers.cli import main; main()", *args]
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=600)


def one_graph(tmp_path: Path) -> Path:
    """A folder holding the mixed graph (8 kernel ops, 6 variants)."""
    (tmp_path / "g").mkdir()
    write_graph(tmp_path / "g", mixed_graph())
    return tmp_path / "g"


def compiled(folder: Path | None, cwd: Path, graphs: Path, out: str, tier: str) -> dict:
    done = nkicache(folder, cwd, "compile", str(graphs), "--out", out, "--tier", tier, "--json", "--workers", "2")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_new_compiler_warmed_from_the_old_ones_entries_traces_nothing(tmp_path: Path) -> None:
    graphs = tmp_path / "graphs"
    generate_workload(graphs, 4, seed=0)  # softmax among them (the maths this test changes)
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    new = compiler_copy(tmp_path, "new", ("kernels/softmax.py", *SOFTMAX_MATHS))
    assert fingerprint(new / "bridge") != toolchain_id()

    old_cold = compiled(None, tmp_path, graphs, "old", tier)
    assert old_cold["traces"] > 0

    dry = nkicache(new, tmp_path, "warm", "--tier", tier, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    plan = json.loads(dry.stdout)
    assert plan["source"] == toolchain_id() and plan["traced"] == 0 and plan["to_trace"] == plan["considered"] > 0

    warmed = nkicache(new, tmp_path, "warm", "--tier", tier, "--json")
    assert warmed.returncode == 0, warmed.stderr
    report = json.loads(warmed.stdout)
    assert report["toolchain"] == fingerprint(new / "bridge") and report["source"] == toolchain_id()
    assert report["traced"] == report["considered"] and report["skipped"] == report["failed"] == []

    shown = nkicache(None, tmp_path, "report", "--tier", tier, "--json")
    coverage = json.loads(shown.stdout)["coverage"]
    assert coverage[report["toolchain"]][toolchain_id()]["share"] == 1.0  # warm: switch traffic

    first = compiled(new, tmp_path, graphs, "new", tier)
    assert first["traces"] == first["parallel_traces"] == 0 and first["remote_hits"] == first["cache_misses"]
    alone = compiled(new, tmp_path, graphs, "new-off", "off")
    for artifact in (tmp_path / "new-off").glob("*.nkibb"):
        assert (tmp_path / "new" / artifact.name).read_bytes() == artifact.read_bytes(), artifact.name
    assert alone["traces"] > 0
    # The maths change is real: the old compiler's artifacts differ where softmax is used.
    assert any((tmp_path / "old" / a.name).read_bytes() != a.read_bytes() for a in (tmp_path / "new-off").glob("*"))

    again = nkicache(new, tmp_path, "warm", "--tier", tier, "--json")
    assert json.loads(again.stdout)["present"] == report["considered"]  # nothing left to trace


def test_warm_with_nothing_to_warm_from_is_one_line(tmp_path: Path) -> None:
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    compiled(None, tmp_path, one_graph(tmp_path), "out", tier)
    done = nkicache(None, tmp_path, "warm", "--tier", tier)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "no entries of another toolchain" in done.stderr


def test_a_dry_run_with_nothing_to_warm_from_says_so_and_exits_0(tmp_path: Path) -> None:
    """Issue 34: a dry run asked what a warm would do; "nothing" is its answer, not an error."""
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    compiled(None, tmp_path, one_graph(tmp_path), "out", tier)
    done = nkicache(None, tmp_path, "warm", "--tier", tier, "--dry-run")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("nothing to warm: ") and "no entries of another toolchain" in done.stdout
    assert done.stdout.count("\n") == 1 and "warmed" not in done.stdout
    plan = json.loads(nkicache(None, tmp_path, "warm", "--tier", tier, "--dry-run", "--json").stdout)
    assert plan["source"] is None and plan["would_trace"] == [] and plan["to_trace"] == 0
    assert "no entries of another toolchain" in plan["nothing_to_warm"]


def test_warming_from_this_compiler_s_own_toolchain_is_one_line(tmp_path: Path) -> None:
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    compiled(None, tmp_path, one_graph(tmp_path), "out", tier)
    for dry_run in ((), ("--dry-run",)):
        done = nkicache(None, tmp_path, "warm", "--tier", tier, "--from", toolchain_id(), *dry_run)
        assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
        assert "is this compiler's own toolchain" in done.stderr and done.stdout == ""


def test_a_dry_run_lists_each_variant_it_would_trace(tmp_path: Path) -> None:
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    compiled(None, tmp_path, one_graph(tmp_path), "out", tier)  # 6 variants
    new = compiler_copy(tmp_path, "new", ("kernels/softmax.py", *SOFTMAX_MATHS))
    done = nkicache(new, tmp_path, "warm", "--tier", tier, "--dry-run")
    assert done.returncode == 0, done.stderr
    head, *listed = done.stdout.splitlines()
    assert head.startswith(f"would warm {fingerprint(new / 'bridge')} from {toolchain_id()}: 6 variants, would trace 6")
    assert len(listed) == 6 and all(line.startswith("  would trace ") for line in listed), listed
    assert any(" softmax Trn2 [32,48] -> [32,48]" in line for line in listed), listed
    plan = json.loads(nkicache(new, tmp_path, "warm", "--tier", tier, "--dry-run", "--json").stdout)
    assert sorted(item["key"][:16] for item in plan["would_trace"]) == sorted(line.split()[2] for line in listed)
    assert plan["traced"] == 0 and plan["nothing_to_warm"] is None


@pytest.mark.parametrize("top", [1, 3])
def test_top_picks_the_most_used_variants(tmp_path: Path, top: int) -> None:
    from cachestore.settings import Settings
    from cachestore.stores import open_backend
    from workers.warm import pick_variants

    tier = f"local:{tmp_path / 'tier.sqlite'}"
    compiled(None, tmp_path, one_graph(tmp_path), "out", tier)
    reader = open_backend(Settings(tier=tier), reading=True)
    try:
        every = pick_variants(reader, toolchain_id())
        chosen = pick_variants(reader, toolchain_id(), top=top)
    finally:
        reader.close()
    assert [v.cache_key for v in chosen] == [v.cache_key for v in sorted(every, reverse=True)[:top]]
    assert chosen[0].usage == max(v.usage for v in every) == 2  # the softmax and matmul used twice a pass


def test_a_variant_that_cannot_be_rebuilt_is_skipped_with_its_reason(tmp_path: Path) -> None:
    from cachestore.settings import Settings
    from cachestore.stores import open_tier
    from workers.warm import Variant, warm

    components = {"kernel_name": "a_kernel_no_longer_in_the_library", "operands": {"shapes": [[8, 8]],
                  "dtypes": ["float32"]}, "results": {"shapes": [[8, 8]], "dtypes": ["float32"]}, "attrs": {},
                  "target": "Trn2", "num_neuroncores": 2}  # fmt: skip
    future_format = {"kernel_name": "softmax", "operands": "a key format of the future"}
    tier = open_tier(Settings(tier=f"local:{tmp_path / 'tier.sqlite'}"))
    try:
        report = warm(tier, [Variant(5, 0.0, "a" * 64, components), Variant(3, 0.0, "b" * 64, future_format)],
                      "0" * 16)  # fmt: skip
    finally:
        tier.close()
    assert (report.traced, report.failed) == (0, [])
    reasons = {item["key"][:1]: item["reason"] for item in report.skipped}
    assert "no registered kernel compiles 'a_kernel_no_longer_in_the_library'" in reasons["a"]
    assert reasons["b"].startswith("cannot be rebuilt into a kernel call")


@pytest.mark.redis
def test_the_fleet_warms_a_new_compiler_through_jobs_its_own_workers_trace(tmp_path: Path, redis_url: str) -> None:
    import redis
    from helpers_graphs import delete_namespace, unique_namespace

    namespace = unique_namespace()
    env = {"NKICACHE_TIER": redis_url, "NKICACHE_NAMESPACE": namespace, "NKICACHE_HEARTBEAT_INTERVAL": "0.5"}
    graphs = one_graph(tmp_path)
    new = compiler_copy(tmp_path, "new", ("kernels/softmax.py", *SOFTMAX_MATHS))
    client = redis.Redis.from_url(redis_url)
    worker = None
    try:
        old = nkicache(None, tmp_path, "compile", str(graphs), "--out", "old", "--json", env=env)
        assert old.returncode == 0 and json.loads(old.stdout)["traces"] == 6, old.stderr
        # A worker of the new compiler, deployed before traffic switches: it takes only the new toolchain's jobs.
        worker_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(new), os.environ.get("PYTHONPATH", "")])}
        worker = subprocess.Popen([sys.executable, "-c", "from workers.cli import main; main()", "worker", "--name",
                                   "new-w", "--max-jobs", "2"], cwd=tmp_path, env=worker_env,
                                  stderr=subprocess.PIPE, text=True)  # fmt: skip
        warmed = nkicache(new, tmp_path, "warm", "--fleet", "--per-job", "4", "--timeout", "240", "--json", env=env)
        assert warmed.returncode == 0, warmed.stderr
        report = json.loads(warmed.stdout)
        assert len(report["jobs"]) == 2 and report["failed"] == [] and report["skipped"] == []
        assert report["traced"] == report["to_trace"] == report["considered"] == 6
        assert worker.wait(timeout=60) == 0  # its two jobs done

        first = nkicache(new, tmp_path, "compile", str(graphs), "--out", "new", "--json", env=env)
        first_counts = json.loads(first.stdout)
        assert first_counts["traces"] == first_counts["parallel_traces"] == 0  # warm: all from the fleet's traces
        alone = nkicache(new, tmp_path, "compile", str(graphs), "--out", "new-off", "--tier", "off", "--json")
        alone_counts = json.loads(alone.stdout)
        assert alone_counts["traces"] == 6
        for artifact in (tmp_path / "new-off").glob("*.nkibb"):
            assert (tmp_path / "new" / artifact.name).read_bytes() == artifact.read_bytes(), artifact.name
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        delete_namespace(client, namespace)
        client.close()
