"""Issue 14: the fleet survives bad jobs, dead processes and time. Real `nkicache worker` processes on a
private Redis: every bad job (deeply nested, malformed, over a limit, its compiling process killed, too slow)
ends dead-lettered with its reason while the good ones complete and every worker lives on; finished jobs
leave the stream and their results expire; the queue can be inspected, requeued and purged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers_graphs import softmax_graph
from test_fleet import BEAT, NKICACHE, WAIT, Fleet, slow_graphs, wait_until

from bridge.identity import toolchain_id
from workers.cli_common import EXIT_CHECK_FAILED, EXIT_PROJECT_ERROR
from workers.workload import generate_workload


def hand_job(f: Fleet, job_id: str, graph_text: str) -> None:
    job = {"id": job_id, "batch": "hand", "file": f"{job_id}.json", "graph": graph_text, "attempt": 1,
           "toolchain": toolchain_id()}  # fmt: skip
    f.redis.xadd(f.keys.job_shard(0).stream(toolchain_id()), {"job": json.dumps(job)})


def kill_compiles_of(f: Fleet, job_id: str, times: int) -> list[int]:
    """SIGKILL the compiling process of `job_id` each time a worker compiles it (once per attempt), as the
    out-of-memory killer would; returns the pids killed."""
    killed: list[int] = []

    def kill_one() -> bool:
        for beat in f.heartbeats().values():
            pid = beat.get("compiler_pid")
            if beat.get("job") == job_id and pid and pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return True
        return False

    for _ in range(times):
        wait_until(kill_one, interval=0.02)
    return killed


def test_bad_jobs_are_dead_lettered_with_their_reason_and_no_worker_dies(fleet, tmp_path: Path) -> None:
    f = fleet(job_max_attempts=2, max_tensor_elements=1_000_000)
    good = generate_workload(tmp_path / "graphs", 3, seed=11)
    over = softmax_graph(tmp_path / "over", "over", 2000)  # 2 M elements: over the limit set above
    [slow] = slow_graphs(tmp_path / "slow", [144])  # seconds of tracing: time to kill its compile
    f.start_worker("w1")
    f.start_worker("w2")
    f.wait_live("w1", "w2")
    # Each worker starts its compiling process before it takes a job, and says so in its heartbeat.
    wait_until(lambda: all(f.heartbeats()[name].get("compiler_pid") for name in ("w1", "w2")))

    hand_job(f, "deep-00000", '{"name": "deep", "tensors": {}, "ops": ' + "[" * 1500 + "]" * 1500 + "}")
    stream = f.keys.job_shard(0).stream(toolchain_id())
    f.redis.xadd(stream, {"not-a-job": "x"})
    f.redis.xadd(stream, {"job": json.dumps({"id": 5, "graph": {}})})
    report = f.submit(*good, over, slow, wait=False)
    slow_job = next(job for job, info in report["jobs"].items() if info["file"] == str(slow))
    over_job = next(job for job, info in report["jobs"].items() if info["file"] == str(over))
    killed = kill_compiles_of(f, slow_job, times=2)
    wait_until(lambda: len(f.results()) == 6)

    results = f.results()
    for job, info in report["jobs"].items():
        if info["file"] in map(str, good):
            assert results[job]["status"] == "completed", results[job]
    assert results["deep-00000"]["status"] == "dead_letter" and "nested deeper" in results["deep-00000"]["error"]
    over_error = results[over_job]["error"]
    assert results[over_job]["status"] == "dead_letter", results[over_job]
    assert over_error.startswith(f"{over}: op 0 (Softmax): tensor 'x' has 2000000 elements") and (
        "max_tensor_elements = 1000000" in over_error
    ), over_error
    killed_result = results[slow_job]
    assert killed_result["status"] == "dead_letter" and killed_result["attempts"] == 2, killed_result
    assert f"{slow}: the compiling process was killed by SIGKILL" in killed_result["error"], killed_result
    assert len(killed) == 2
    dead = {fields[b"job"].decode(): fields[b"error"].decode() for fields in f.dead_letters()}
    assert len(dead) == 5 and {"deep-00000", over_job, slow_job} <= set(dead)
    malformed = sorted(error for job, error in dead.items() if job not in {"deep-00000", over_job, slow_job})
    assert malformed == ["the job's 'id' is not a string", "the message has no job field"], dead

    # Every worker is alive and beating, and took jobs after the failures; each says what it did, a line a job.
    assert all(process.poll() is None for process in f.workers.values())
    assert all(time.time() - beat["time"] < 3 * BEAT for beat in f.heartbeats().values())
    logs = f.log("w1") + f.log("w2")
    assert logs.count(" taken, attempt ") >= 7 and logs.count(" finished in ") == 3, logs
    assert f"job {slow_job} failed (attempt 2 of 2, dead-lettered)" in logs and "Traceback" not in logs
    extra = f.submit(*generate_workload(tmp_path / "more", 1, seed=12))
    assert extra["completed"] == 1
    for name in ("w1", "w2"):
        assert f.stop(name)[0] == 0, f.log(name)


def test_a_compile_process_runs_under_the_memory_limit(fleet, tmp_path: Path) -> None:
    f = fleet(job_memory=3 * 1024**3)
    f.start_worker("w1")
    report = f.submit(*generate_workload(tmp_path / "graphs", 1, seed=13))
    assert report["completed"] == 1
    pid = f.heartbeats()["w1"]["compiler_pid"]
    limits = Path(f"/proc/{pid}/limits").read_text()
    [line] = [line for line in limits.splitlines() if line.startswith("Max address space")]
    assert line.split()[3:5] == [str(3 * 1024**3)] * 2, line
    assert f.stop("w1")[0] == 0


def test_a_job_over_its_time_limit_is_killed_and_the_next_one_compiles(fleet, tmp_path: Path) -> None:
    # Three seconds leave the quick job's process time to start with both cores busy elsewhere, and the slow
    # graph (five UNet kernels at size 1000: 4-9 s of tracing here) never finishes within them.
    f = fleet(job_timeout=3.0, job_max_attempts=1)
    [slow] = slow_graphs(tmp_path / "slow", [1000])
    quick = softmax_graph(tmp_path / "quick", "quick", 4, 8)
    f.start_worker("w1")
    report = f.submit(slow, quick, expect_code=EXIT_CHECK_FAILED)
    by_file = {info["file"]: info for info in report["jobs"].values()}
    assert by_file[str(slow)]["status"] == "dead_letter"
    assert "compiling took longer than the limit job_timeout = 3 s; killed" in by_file[str(slow)]["error"]
    assert by_file[str(quick)]["status"] == "completed"
    assert f.workers["w1"].poll() is None and f.stop("w1")[0] == 0


def test_finished_jobs_leave_the_stream_and_their_results_expire(fleet, tmp_path: Path) -> None:
    """Completed and dead-lettered jobs alike: the stream holds no finished job, and results, artifacts and
    batches expire after job_ttl, so the queue's keys do not grow with the jobs it has run."""
    ttl = 8
    f = fleet(job_ttl=ttl, job_max_attempts=1)
    f.start_worker("w1")
    f.wait_live("w1")
    streams = [shard.stream(toolchain_id()) for shard in f.shards()]
    every_shard = f"{{{f.keys.prefix}:jobs*"  # shard 0's tag and shard i's, {NS:v1:jobs:i}
    base_keys = set(f.redis.keys(every_shard))
    per_shard = [(shard.stream(toolchain_id()), shard.dead_letters, shard.counts) for shard in f.shards()]
    fixed = {key.encode() for keys in per_shard for key in keys} | {f.keys.job_toolchains.encode()}

    for round_ in range(2):
        good = generate_workload(tmp_path / f"graphs{round_}", 4, seed=20 + round_)
        report = f.submit(*good, expect_code=0)
        assert report["completed"] == 4
        bad = softmax_graph(tmp_path / f"bad{round_}", "bad", 2, 3)
        hand_job(f, f"bad-{round_}", bad.read_text().replace('"Softmax"', '"FlashAttention"'))
        wait_until(lambda round_=round_: len(f.dead_letters()) == round_ + 1)
        # Acknowledged and deleted: no graph stays behind in any shard's stream.
        assert sum(map(f.redis.xlen, streams)) == 0
        assert f.in_flight() == 0 and f.failures() == 0
        # Everything a finished job left (results, artifacts, the batch) has a TTL of at most job_ttl...
        leftovers = set(f.redis.keys(every_shard)) - base_keys - fixed
        # (In milliseconds: TTL reads a key under a second from expiry as 0, and one gone since KEYS as -2.)
        untimed = {k: ms for k in leftovers if (ms := f.redis.pttl(k)) == -1 or ms > ttl * 1000}
        # (Under load the first jobs' keys may have expired already: at least the last batch's are there.)
        assert leftovers and untimed == {}
        # ...and is gone after it: the keys are back to what they were before the round (plus the fixed ones).
        wait_until(lambda: not f.results(), timeout=3 * ttl, interval=0.25)  # (seconds away: no need to spin)
        assert set(f.redis.keys(every_shard)) - base_keys <= fixed
        assert sum(map(f.redis.xlen, streams)) == 0
    assert len(f.dead_letters()) == 2  # dead letters stay until `purge` or `requeue`
    assert f.stop("w1")[0] == 0


def test_wait_stops_at_its_timeout_and_says_no_worker_is_there(fleet, tmp_path: Path) -> None:
    f = fleet(wait_timeout=2)
    [graph] = generate_workload(tmp_path / "graphs", 1, seed=30)
    started = time.monotonic()
    done = f.run("submit", graph, "--tier", f.url, "--wait", check=False)
    assert done.returncode == EXIT_CHECK_FAILED and time.monotonic() - started < 20, done.stderr
    lines = done.stderr.splitlines()
    assert any(line.startswith(f"warning: no live worker has toolchain {toolchain_id()}") for line in lines), lines
    assert lines[-1].startswith("nkicache: error: 1 of 1 job unfinished after 2 s"), lines
    [batch_line, job_line, *_] = done.stdout.splitlines()
    assert ": 1 job submitted for toolchain " in batch_line, batch_line
    batch = batch_line.split()[1].rstrip(":")
    job = job_line.split()[0]
    assert job_line.split()[1] == str(graph) and job.startswith(batch)
    shown = f.run("job", "show", job, "--tier", f.url, "--json")
    assert json.loads(shown.stdout)["status"] == "waiting"
    purged = f.run("purge", "--waiting", "--tier", f.url)
    assert "0 dead letters, 1 waiting job" in purged.stdout  # issue 34: a count of one is worded so
    assert sum(f.redis.xlen(shard.stream(toolchain_id())) for shard in f.shards()) == 0


def test_a_dead_letter_is_shown_requeued_and_then_completes(fleet, tmp_path: Path) -> None:
    f = fleet(job_max_attempts=1, max_tensor_elements=1000)
    over = softmax_graph(tmp_path / "g", "over", 4, 1000)
    f.start_worker("w1")
    report = f.submit(over, expect_code=EXIT_CHECK_FAILED)
    [job] = report["jobs"]
    shown = f.run("job", "show", job, "--tier", f.url, check=False)
    assert (
        shown.returncode == EXIT_CHECK_FAILED
        and "dead_letter" in shown.stdout
        and "max_tensor_elements" in shown.stdout
    )
    batch = json.loads(f.run("batch", "show", report["batch"], "--tier", f.url, "--json", check=False).stdout)
    assert batch["dead_letter"] == 1 and batch["jobs"][job]["status"] == "dead_letter"
    batch_text = f.run("batch", "show", report["batch"], "--tier", f.url, check=False).stdout
    assert batch_text.startswith(f"batch {report['batch']}: 1 job, 0 completed, 1 dead-lettered"), batch_text
    assert f.stop("w1")[0] == 0

    # A worker with a higher limit, then the job again: the same id, completed.
    f.env["NKICACHE_MAX_TENSOR_ELEMENTS"] = "100000"
    f.start_worker("w2")
    assert f"1 job requeued: {job}" in f.run("requeue", job, "--tier", f.url).stdout
    wait_until(lambda: f.results().get(job, {}).get("status") == "completed")
    assert f.dead_letters() == []
    assert json.loads(f.run("job", "show", job, "--tier", f.url, "--json").stdout)["artifact_stored"] is True
    missing = f.run("requeue", "nope-00000", "--tier", f.url, check=False)
    assert missing.returncode == EXIT_CHECK_FAILED and "job nope-00000: no dead letter" in missing.stderr
    assert f.stop("w2")[0] == 0


@pytest.mark.parametrize("level", ["WARNING", None])
def test_a_worker_logs_one_line_per_job_at_info_unless_told_otherwise(fleet, tmp_path: Path, level) -> None:
    f = fleet()
    if level:
        f.env["NKICACHE_LOG_LEVEL"] = level
    f.start_worker("w1")
    assert f.submit(*generate_workload(tmp_path / "graphs", 2, seed=31))["completed"] == 2
    assert f.stop("w1")[0] == 0
    log = f.log("w1")
    lines = [line for line in log.splitlines() if " finished in " in line]
    assert len(lines) == (0 if level else 2), log
    if not level:
        assert all("kernels" in line and "traces" in line and " INFO workers.fleet: " in line for line in lines)
        assert "Cache hit for" not in log and "Cache miss for" not in log  # per-kernel lines only at DEBUG


def submit_waiting(f: Fleet, graph: Path) -> tuple[subprocess.Popen, str]:
    """`submit --wait --json` started with no worker; returns it once its batch is in Redis, and the batch id."""
    process = subprocess.Popen([NKICACHE, "submit", str(graph), "--tier", f.url, "--wait", "--json", "--timeout",
                                str(WAIT)], env=f.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               stdin=subprocess.DEVNULL)  # fmt: skip
    wait_until(lambda: f.redis.keys(f.keys.job_batch("*")))
    [batch_key] = f.redis.keys(f.keys.job_batch("*"))
    return process, batch_key.decode().rsplit(":", 1)[1]


def test_wait_says_at_once_that_redis_lost_the_jobs_and_prints_the_batch(private_redis_server, tmp_path) -> None:
    """Issue 35: Redis restarts empty under `submit --wait --json` (down for about 0.3 s): the wait rides out the
    restart, sees the batch is gone, says so in one line and exits 2 at once with the batch id in its JSON,
    instead of waiting out --timeout and saying the jobs stay queued."""
    server = private_redis_server()
    f = Fleet(server.url, tmp_path)
    [graph] = generate_workload(tmp_path / "graphs", 1, seed=31)
    process, batch = submit_waiting(f, graph)
    server.stop()
    time.sleep(0.3)
    server.start()
    restarted = time.monotonic()
    stdout, stderr = process.communicate(timeout=WAIT)
    assert process.returncode == EXIT_PROJECT_ERROR and time.monotonic() - restarted < 10, (stdout, stderr)
    report = json.loads(stdout)
    assert report["batch"] == batch and report["lost"] == 1 and report["unfinished"] == 0
    assert "gone from the fleet's Redis" in report["error"] and batch in report["error"]
    errors = [line for line in stderr.splitlines() if not line.startswith("warning: no live worker")]
    assert errors == [f"nkicache: error: {report['error']}"], stderr


def test_wait_on_a_redis_that_stays_down_prints_the_batch(private_redis_server, tmp_path, monkeypatch) -> None:
    """Redis goes away for longer than the wait rides out (shortened here): one line, exit 2, and the batch id
    in the JSON object all the same."""
    from click.testing import CliRunner

    from workers import fleet as fleet_module
    from workers.cli import main as nkicache

    server = private_redis_server()
    f = Fleet(server.url, tmp_path)
    [graph] = generate_workload(tmp_path / "graphs", 1, seed=32)
    monkeypatch.setattr(fleet_module, "RECONNECT_SECONDS", 1.0, raising=False)  # not there before issue 35
    real_wait_for = fleet_module.wait_for

    def stopped_then_waited(*args, **kwargs):
        server.stop()
        return real_wait_for(*args, **kwargs)

    monkeypatch.setattr(fleet_module, "wait_for", stopped_then_waited)
    argv = ["submit", str(graph), "--tier", f.url, "--wait", "--json", "--timeout", str(WAIT)]
    result = CliRunner().invoke(nkicache, argv, env={"NKICACHE_NAMESPACE": f.namespace})
    assert result.exit_code == EXIT_PROJECT_ERROR, result.output
    report = json.loads(result.stdout)
    assert report["batch"] and "the fleet's Redis" in report["error"] and report["batch"] in report["error"]
    assert result.stderr.strip().splitlines() == [f"nkicache: error: {report['error']}"]


def test_a_wait_longer_than_job_ttl_keeps_its_batch_and_a_lost_batch_is_told(redis_client) -> None:
    """The submitter's polls keep the batch list it waits on (a slow batch is not taken for one Redis lost),
    and a batch whose list is gone is reported lost at the next poll."""
    from helpers_graphs import delete_namespace, unique_namespace

    from cachestore.keys import KeySpace
    from workers.fleet import lost_jobs

    namespace = unique_namespace()
    keys = KeySpace(namespace)
    jobs = ["b1-00000", "b1-00001"]
    try:
        redis_client.rpush(keys.job_batch("b1"), *jobs)
        redis_client.pexpire(keys.job_batch("b1"), 300)  # job_ttl shorter than the wait
        for _ in range(4):
            time.sleep(0.2)
            assert lost_jobs(redis_client, keys, jobs, keep_for=1) == []
        assert 0 < redis_client.pttl(keys.job_batch("b1")) <= 1000
        redis_client.delete(keys.job_batch("b1"))  # Redis restarted empty
        assert lost_jobs(redis_client, keys, jobs, keep_for=1) == jobs
    finally:
        delete_namespace(redis_client, namespace)


def test_a_result_seen_once_is_kept_though_it_expires_before_the_batch_ends(monkeypatch) -> None:
    """A result expires job_ttl after its job finished: a batch longer than that still reports its first jobs."""
    import workers.fleet as fleet

    answers = iter([{"b-00000": {"status": "completed"}}, {}, {"b-00001": {"status": "completed"}}])
    asked: list[list[str]] = []

    def results_of(client, keys, job_ids):
        asked.append(list(job_ids))
        return next(answers)

    monkeypatch.setattr(fleet, "results_of", results_of)
    monkeypatch.setattr(fleet, "lost_jobs", lambda client, keys, unfinished, keep_for: [])
    monkeypatch.setattr(fleet, "LOOK_SECONDS", 0.0)  # every round reads every result still missing
    monkeypatch.setattr(fleet, "finished_jobs", lambda client, keys, batches, seconds: [])
    waited = fleet.wait_for(None, None, ["b-00000", "b-00001"], timeout=60, on_progress=lambda done: None, job_ttl=5)
    assert set(waited.results) == {"b-00000", "b-00001"} and waited.lost == []
    assert asked == [["b-00000", "b-00001"], ["b-00001"], ["b-00001"]]  # a finished job is not asked for again
