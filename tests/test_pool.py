"""The local pool (`nkicache compile --workers N`) in real processes: a cold then a warm run on the embedded
tier, byte-identical artifacts, plain progress lines, and Ctrl-C that keeps what finished and nothing else."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers_graphs import mixed_graph, write_graph

from bridge.artifact import ARTIFACT_SUFFIX, load_artifact
from workers.cli_common import EXIT_INTERRUPTED
from workers.workload import generate_workload

NKICACHE = str(Path(sys.executable).with_name("nkicache"))
PROCESS_TIMEOUT = 120


def nkicache(*args: object, timeout: float = PROCESS_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [NKICACHE, *map(str, args)], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def default_tier_path() -> Path:
    """The embedded tier every test gets its own copy of (conftest's isolated_default_tier)."""
    return Path(os.environ["XDG_CACHE_HOME"]) / "nkicache" / "tier.sqlite"


def tier_rows(sql: str) -> list[tuple]:
    db = sqlite3.connect(default_tier_path(), timeout=5)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


def compile_json(graphs: Path, out: Path, *extra: object) -> dict:
    done = nkicache("compile", graphs, "--workers", 2, "--json", "--out", out, *extra)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return json.loads(done.stdout)


def artifact_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_two_workers_compile_a_workload_and_a_second_run_traces_nothing(tmp_path: Path) -> None:
    graphs = tmp_path / "graphs"
    names = sorted(path.stem for path in generate_workload(graphs, 6, seed=3))

    cold = compile_json(graphs, tmp_path / "cold")
    assert (cold["passes"], cold["compiled"], cold["failed"], cold["interrupted"]) == (6, 6, [], False)
    assert (cold["workers"], cold["tier_mode"]) == (2, "read-through")
    assert cold["tier"] == f"local:{default_tier_path()}"
    assert sorted(Path(a).name for a in cold["artifacts"]) == [f"{name}{ARTIFACT_SUFFIX}" for name in names]
    assert cold["kernels"] == cold["cache_hits"] + cold["cache_misses"] > 0
    assert cold["cache_hits"] > 0  # the workload repeats layers inside a model
    # Every variant was traced exactly once across the two processes (the rest came from the tier), by a trace
    # task (parallel_traces) or by its pass.
    entries = tier_rows("SELECT COUNT(*) FROM entries")[0][0]
    traced = cold["traces"]
    assert traced == entries and traced + cold["remote_hits"] == cold["cache_misses"]
    assert cold["parallel_traces"] > 0
    assert cold["tier_errors"] == cold["tier_timeouts"] == cold["tier_rejected"] == cold["tier_dropped"] == 0
    # Both pool processes' passes count under one stable worker label (no new metrics series per process).
    workers = {json.loads(record)["worker"] for (record,) in tier_rows("SELECT record FROM pass_log")}
    assert workers == {"local"}, workers
    assert {worker for (worker,) in tier_rows("SELECT DISTINCT worker FROM worker_totals")} == {"local"}
    # The tier's fleet totals are the sum of this run's passes.
    totals = dict(tier_rows("SELECT name, value FROM totals"))
    for key in ("kernels", "cache_hits", "cache_misses", "remote_hits", "traces", "parallel_traces"):
        assert totals[key] == cold[key], key
    assert totals["passes"] == 6

    warm = compile_json(graphs, tmp_path / "warm")
    assert (warm["passes"], warm["compiled"], warm["failed"]) == (6, 6, [])
    assert warm["traces"] == warm["parallel_traces"] == 0 and warm["compile_seconds"] == 0
    assert warm["remote_hits"] == warm["cache_misses"] == cold["cache_misses"]
    assert (warm["kernels"], warm["cache_hits"]) == (cold["kernels"], cold["cache_hits"])
    assert warm["shared_hit_rate"] == 1.0 and warm["tier_lookups"] == warm["cache_misses"]
    assert warm["in_pass_hit_rate"] == round(warm["cache_hits"] / warm["kernels"], 4)
    for cold_pass, warm_pass in zip(cold["graphs"], warm["graphs"], strict=True):
        assert warm_pass["file"] == cold_pass["file"]
        assert (warm_pass["traces"], warm_pass["remote_hits"]) == (0, cold_pass["cache_misses"])

    cold_files, warm_files = artifact_bytes(tmp_path / "cold"), artifact_bytes(tmp_path / "warm")
    assert cold_files == warm_files and len(cold_files) == 6
    for path in (tmp_path / "warm").iterdir():
        assert load_artifact(path).graph == path.stem


def test_plain_progress_lines_when_stdout_is_not_a_terminal(tmp_path: Path) -> None:
    graphs = tmp_path / "graphs"
    generate_workload(graphs, 3, seed=5)
    done = nkicache("compile", graphs, "--workers", 2, "--out", tmp_path / "out", "--tier", "off")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4, done.stdout
    for i, line in enumerate(lines[:3], start=1):
        assert re.fullmatch(
            rf"\[{i}/3\] {re.escape(str(graphs))}/\S+\.json -> \S+\.nkibb: Trn2, .* traces?"
            rf"( \(\d+ in parallel\))?, .* s",
            line,
        )
    assert lines[3].startswith("3 passes (3 compiled, 0 failed): ")
    assert "\x1b[" not in done.stdout + done.stderr  # no terminal control sequences


@pytest.mark.slow
@pytest.mark.parametrize("whom", ["process group", "parent only"])
def test_ctrl_c_keeps_finished_artifacts_and_nothing_half_written(tmp_path: Path, whom: str) -> None:
    """SIGINT while a larger workload compiles with the tier off (every pass traces): a terminal's Ctrl-C
    reaches the whole process group; `kill -INT` only the parent."""
    graphs = tmp_path / "graphs"
    total = 40
    generate_workload(graphs, total, seed=1)
    out = tmp_path / "out"
    process = subprocess.Popen(
        [NKICACHE, "compile", str(graphs), "--workers", "2", "--tier", "off", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        first = process.stdout.readline()  # the first finished pass: the pool is up and compiling
        assert first.startswith(f"[1/{total}] "), first + process.stderr.read()
        signalled = time.monotonic()
        if whom == "process group":
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGINT)
        rest, stderr = process.communicate(timeout=60)
        stopped_after = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    stdout = first + rest

    assert process.returncode == EXIT_INTERRUPTED, (stdout, stderr)
    assert "Traceback" not in stderr and stderr == "", stderr
    match = re.search(rf"^interrupted: (\d+) of {total} graphs compiled; their artifacts are in {re.escape(str(out))}$",
                      stdout, re.MULTILINE)  # fmt: skip
    assert match, stdout
    compiled = int(match.group(1))
    assert 1 <= compiled < total
    assert stopped_after < 30  # running passes finish, nothing new starts
    summary = [line for line in stdout.splitlines() if " passes (" in line or line.startswith("1 pass (")]
    passes = f"{compiled} pass" if compiled == 1 else f"{compiled} passes"
    assert summary and summary[0].startswith(f"{passes} ({compiled} compiled, 0 failed)"), stdout

    # Every file in --out is a whole, loadable artifact; no temporary files are left behind.
    files = sorted(out.iterdir())
    assert [f.name for f in files if f.suffix != ARTIFACT_SUFFIX or f.name.startswith(".")] == []
    assert len(files) == compiled
    for path in files:
        artifact = load_artifact(path)
        assert artifact.graph == path.stem and artifact.kernels
    # And each is the artifact an uninterrupted compile writes.
    again = tmp_path / "again"
    done = nkicache("compile", *(graphs / f"{path.stem}.json" for path in files), "--workers", 2, "--tier", "off",
                    "--out", again, "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert artifact_bytes(again) == artifact_bytes(out)


def test_ctrl_c_while_the_pool_starts_is_a_clean_interrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the helper processes start (workers/variant_pool.py) is held as a flag, then stops the
    compile like any other Ctrl-C: the passes done are complete, the helpers are joined, SIGINT is restored."""
    from multiprocessing.process import BaseProcess

    from cachestore.settings import load_settings
    from workers.pool import compile_run

    paths = [str(p) for p in generate_workload(tmp_path / "graphs", 8, seed=2)]
    # What SIGINT did before: a process started in the background by a non-interactive shell ignores it.
    before = signal.getsignal(signal.SIGINT)
    real_start = BaseProcess.start
    sent: list[int] = []

    def start_then_ctrl_c(self, *args, **kwargs):
        real_start(self, *args, **kwargs)
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(BaseProcess, "start", start_then_ctrl_c)
    out = tmp_path / "out"
    run = compile_run(paths, settings=load_settings({"tier": "off"}), workers=2, out_dir=str(out))
    results, interrupted = run.results, run.interrupted
    assert sent and interrupted
    assert len(results) < len(paths)
    assert all(r.error is None and Path(r.artifact).exists() for r in results)
    assert sorted(p.name for p in out.iterdir()) == sorted(Path(r.artifact).name for r in results)
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_ctrl_c_with_one_worker_finishes_the_running_pass_and_stops(tmp_path: Path) -> None:
    """--workers 1 compiles in the command's own process: Ctrl-C there also lets the running pass finish."""
    from cachestore.settings import load_settings
    from workers.pool import compile_run

    paths = [str(p) for p in generate_workload(tmp_path / "graphs", 4, seed=2)]
    before = signal.getsignal(signal.SIGINT)
    seen = []

    def ctrl_c_after_the_first(result) -> None:
        seen.append(result)
        if len(seen) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    out = tmp_path / "out"
    run = compile_run(
        paths, settings=load_settings({"tier": "off"}), workers=1, out_dir=str(out), on_result=ctrl_c_after_the_first
    )
    results, interrupted = run.results, run.interrupted
    assert interrupted and len(results) == 1 and results[0].error is None
    assert [p.name for p in out.iterdir()] == [Path(results[0].artifact).name]
    assert signal.getsignal(signal.SIGINT) is before


def test_a_long_running_process_keeps_one_passs_kernel_records(tmp_path: Path) -> None:
    """The process-wide KernelMetricsCollector describes a compilation; a worker process runs thousands."""
    from bridge.metrics import KernelMetricsCollector
    from workers.passes import compile_graph

    graph = write_graph(tmp_path, mixed_graph())
    for _ in range(50):
        result, _ = compile_graph(graph)
        assert result.error is None
    records = KernelMetricsCollector.get_instance().records
    assert len(records) == len({record.kernel_name for record in records}) == 3  # the last pass's kernels
