"""The fleet on a real Redis (a private redis-server per test): `nkicache worker` processes, `submit --wait`,
`queue`, a worker killed mid-job, poison jobs, SIGTERM, and fleet metrics equal to the sum of the passes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from helpers_graphs import summed_metrics_hash

from bridge.artifact import load_artifact
from bridge.identity import toolchain_id
from cachestore.keys import JobKeys, KeySpace, job_shard
from workers.fleet import queue_status
from workers.workload import GraphBuilder, generate_workload, unet_block

NKICACHE = str(Path(sys.executable).with_name("nkicache"))
COUNTS = ("kernels", "cache_hits", "cache_misses", "remote_hits", "traces")
WAIT = 60  # seconds: the bound of every wait below; none should come close
BEAT = 1.0  # seconds between heartbeats; a worker is live while its last one is at most 3 BEATs old


def wait_until(predicate: Callable[[], object], timeout: float = WAIT, interval: float = 0.05) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


class Fleet:
    """Workers as `nkicache worker` processes on one private Redis, configured through NKICACHE_* variables."""

    def __init__(self, url: str, tmp_path: Path, **settings: object):
        self.url = url
        self.tmp_path = tmp_path
        self.namespace = f"fleettest{uuid.uuid4().hex[:12]}"
        self.keys = KeySpace(self.namespace)
        self.redis = redis.Redis.from_url(url)
        self.env = {**os.environ, "NKICACHE_NAMESPACE": self.namespace, "NKICACHE_HEARTBEAT_INTERVAL": str(BEAT)}
        self.env.update({f"NKICACHE_{name.upper()}": str(value) for name, value in settings.items()})
        self.workers: dict[str, subprocess.Popen] = {}

    def start_worker(self, name: str, *extra: str) -> subprocess.Popen:
        log = open(self.tmp_path / f"{name}.log", "w")  # noqa: SIM115 - the process owns it
        process = subprocess.Popen([NKICACHE, "worker", "--tier", self.url, "--name", name, *extra], env=self.env,
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        log.close()
        self.workers[name] = process
        return process

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text()

    def run(self, *args: object, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([NKICACHE, *map(str, args)], env=self.env, capture_output=True, text=True,
                              timeout=WAIT * 2, stdin=subprocess.DEVNULL)  # fmt: skip
        if check:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done

    def submit(self, *paths: Path, wait: bool = True, out: Path | None = None, expect_code: int = 0) -> dict:
        args = ["submit", *paths, "--tier", self.url, "--json"]
        if wait:
            args += ["--wait", "--timeout", WAIT]
        if out is not None:
            args += ["--out", out]
        done = self.run(*args, check=False)
        assert done.returncode == expect_code, (done.stdout, done.stderr)
        return json.loads(done.stdout)

    def queue(self, *extra: str) -> dict:
        return json.loads(self.run("queue", "--tier", self.url, "--json", *extra).stdout)

    def heartbeats(self) -> dict[str, dict]:
        raw = self.redis.hgetall(self.keys.worker_heartbeats)
        return {name.decode(): json.loads(beat) for name, beat in raw.items()}

    def wait_live(self, *names: str) -> None:
        wait_until(lambda: set(names) <= set(self.heartbeats()))

    def busy_job(self, name: str) -> str | None:
        """The job the worker is compiling now, None when it compiles none (it may be tracing another job's trace
        task: its heartbeat then names `trace-<message id>`, which is no job)."""
        job = self.heartbeats().get(name, {}).get("job")
        return None if job is None or job.startswith("trace-") else job

    def shards(self) -> list[JobKeys]:
        """The namespace's job shards (shard 0 alone before a submit or worker fixed their count)."""
        return [self.keys.job_shard(i) for i in range(int(self.redis.get(self.keys.job_shard_count) or 1))]

    def results(self) -> dict[str, dict]:
        results = {}
        for shard in self.shards():
            # (Tests poll this: count=1000 scans the shared server's keyspace in a few round trips, not hundreds.)
            keys = list(self.redis.scan_iter(match=shard.result_pattern(), count=1000))
            prefix = len(shard.result(""))
            results.update({k.decode()[prefix:]: json.loads(v) for k, v in zip(keys, self.redis.mget(keys),
                                                                             strict=True) if v})  # fmt: skip
        return results

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for shard in self.shards():
            for name, value in self.redis.hgetall(shard.counts).items():
                counts[name.decode()] = counts.get(name.decode(), 0) + int(value)
        return counts

    def dead_letters(self) -> list[dict[bytes, bytes]]:
        return [fields for shard in self.shards() for _, fields in self.redis.xrange(shard.dead_letters)]

    def failures(self) -> int:
        """Jobs with a failed attempt that is not yet retried to success or dead-lettered."""
        return sum(self.redis.hlen(shard.failures) for shard in self.shards())

    def totals(self) -> dict[str, float]:
        return summed_metrics_hash(self.redis, self.keys, lambda shard: shard.totals)

    def in_flight(self) -> int:
        # The workers here are `nkicache worker` processes: they compile with this process's toolchain.
        streams = [shard.stream(toolchain_id()) for shard in self.shards()]
        return sum(
            self.redis.xpending(stream, "nkicache-workers")["pending"]
            for stream in streams
            if self.redis.exists(stream)
        )

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20) -> tuple[int, float]:
        """Signal a worker and wait for it: (exit code, seconds it took)."""
        process = self.workers[name]
        sent = time.monotonic()
        process.send_signal(sig)
        code = process.wait(timeout=timeout)
        return code, time.monotonic() - sent

    def close(self) -> None:
        for process in self.workers.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        self.redis.close()


def slow_graphs(folder: Path, sizes: list[int]) -> list[Path]:
    """UNet blocks at large image sizes: each distinct size traces five kernels in about a second."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for size in sizes:
        g = GraphBuilder(f"slow-{size}")
        unet_block(g, 0, (32, 32, size), "float32")
        paths.append(folder / f"slow-{size}.json")
        paths[-1].write_text(json.dumps(g.document()))
    return paths


def assert_metrics_are_the_sum_of_the_passes(f: Fleet, results: dict[str, dict]) -> None:
    completed = [r for r in results.values() if r["status"] == "completed"]
    totals = f.totals()
    assert totals["passes"] == len(completed), "a job was compiled to the end more than once"
    for key in COUNTS:
        assert totals[key] == sum(r[key] for r in completed), key


# -- a healthy fleet --------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_workers_complete_a_workload_whose_artifacts_run(fleet, tmp_path: Path) -> None:
    f = fleet()
    graphs = tmp_path / "graphs"
    paths = generate_workload(graphs, 4, seed=0)
    f.start_worker("w1")
    f.start_worker("w2")
    f.wait_live("w1", "w2")
    before = f.queue()
    assert [w["name"] for w in before["workers"]] == ["w1", "w2"]
    assert all(w["job"] is None and w["done"] == 0 and w["host"] for w in before["workers"])
    assert (before["pending"], before["in_flight"], before["completed"], before["dead_letter"]) == (0, 0, 0, 0)

    out = tmp_path / "artifacts"
    report = f.submit(graphs, out=out)
    assert {k: report[k] for k in ("submitted", "completed", "failed", "dead_letter", "unfinished")} == {
        "submitted": 4, "completed": 4, "failed": 0, "dead_letter": 0, "unfinished": 0
    }  # fmt: skip
    assert {job["status"] for job in report["jobs"].values()} == {"completed"}
    assert sorted(Path(job["file"]).name for job in report["jobs"].values()) == sorted(p.name for p in paths)
    assert sorted(Path(a).name for a in report["artifacts"]) == sorted(f"{p.stem}.nkibb" for p in paths)
    for artifact in report["artifacts"]:
        assert load_artifact(artifact).graph == Path(artifact).stem
    check = json.loads(f.run("run", out, "--check", "--json").stdout)
    assert check["ok"] and check["checked"] and len(check["artifacts"]) == 4 and check["failed"] == []

    # The fleet's artifacts are byte for byte what a local compile writes.
    local = tmp_path / "local"
    f.run("compile", graphs, "--tier", "off", "--workers", 1, "--out", local, "--json")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes() for p in local.iterdir()}

    status = f.queue()
    assert (status["pending"], status["in_flight"], status["completed"], status["failed"], status["dead_letter"]) == (
        0, 0, 4, 0, 0
    )  # fmt: skip
    assert [w["name"] for w in status["workers"]] == ["w1", "w2"]
    assert sum(w["done"] for w in status["workers"]) == 4
    assert all(w["job"] is None and time.time() - w["time"] < 3 * BEAT + 2 for w in status["workers"])
    results = f.results()
    assert set(results) == set(report["jobs"]) and {r["worker"] for r in results.values()} <= {"w1", "w2"}

    # SIGTERM on idle workers: both exit 0 promptly and leave the live list.
    for name in ("w1", "w2"):
        code, seconds = f.stop(name)
        assert code == 0 and seconds < 10, (name, code, seconds, f.log(name))
        assert f"worker {name}: " in f.log(name) and "Traceback" not in f.log(name)
    assert f.queue()["workers"] == []
    # Workers flushed their metrics before exiting: the fleet's totals are the sum of the passes' counts.
    assert_metrics_are_the_sum_of_the_passes(f, results)
    assert f.counts() == {"completed": 4}


# -- a worker dies ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_worker_killed_mid_job_loses_nothing_and_completes_nothing_twice(fleet, tmp_path: Path) -> None:
    """SIGKILL one of two workers while it compiles: the other reclaims its job after job_claim_idle. The
    claim idle (1 s) is shorter than a job (about 1 s to several s here), so this also shows that a live
    worker keeps its job however long it compiles: no job is compiled to the end twice."""
    f = fleet(job_claim_idle=1.0, lease_ttl=2.0)  # a dead worker's trace leases expire soon too
    paths = slow_graphs(tmp_path / "graphs", [80, 88, 96, 104])
    f.start_worker("w1")
    f.start_worker("w2")
    f.wait_live("w1", "w2")
    submission = f.submit(*paths, wait=False)
    assert submission["submitted"] == 4

    killed_job = wait_until(lambda: f.busy_job("w1"), interval=0.01)
    code, _ = f.stop("w1", signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert killed_job not in f.results()

    wait_until(lambda: len(f.results()) == 4)
    results = f.results()
    assert {r["status"] for r in results.values()} == {"completed"}
    assert results[killed_job]["worker"] == "w2"  # reclaimed by the survivor
    assert f.counts() == {"completed": 4}  # each job completed exactly once
    # The killed job's compiling process died with its worker, leaving the trace tasks it dealt on the streams: the
    # survivor works through them (finding their variants traced), so nothing is in flight a moment later.
    wait_until(lambda: f.in_flight() == 0)
    assert f.dead_letters() == []
    assert f.failures() == 0

    # SIGTERM on a busy worker: it finishes its job, records it, then exits 0.
    extra = f.submit(*slow_graphs(tmp_path / "more", [128]), wait=False)
    busy = f"{extra['batch']}-00000"
    wait_until(lambda: f.busy_job("w2") == busy, interval=0.01)
    seen = queue_status(f.redis, f.keys, heartbeat_interval=BEAT)  # what `nkicache queue` shows
    assert next(w for w in seen["workers"] if w["name"] == "w2")["job"] == busy and seen["in_flight"] == 1
    code, seconds = f.stop("w2")
    assert code == 0, f.log("w2")
    assert f.results()[busy]["status"] == "completed" and f.results()[busy]["worker"] == "w2"
    assert f.in_flight() == 0 and "Traceback" not in f.log("w2")
    assert seconds < 30
    assert_metrics_are_the_sum_of_the_passes(f, f.results())
    assert f.counts() == {"completed": 5}


# -- poison ------------------------------------------------------------------------------------------
def poison_graphs(folder: Path) -> dict[str, Path]:
    """Not JSON; valid JSON naming an unknown func_name; a Matmul whose contraction dims disagree."""
    folder.mkdir(parents=True, exist_ok=True)
    good = GraphBuilder("good")
    good.tensor("a", (64, 32), "float32")
    good.tensor("b", (64, 48), "float32")
    good.tensor("c", (32, 48), "float32")
    good.kernel("Matmul", ["a", "b"], ["c"])
    document = good.document()
    unknown = json.loads(json.dumps(document)) | {"name": "unknown-kernel"}
    unknown["ops"][0]["func_name"] = "FlashAttention"
    impossible = json.loads(json.dumps(document)) | {"name": "impossible"}
    impossible["tensors"]["b"]["shape"] = [60, 48]
    paths = {
        "good": folder / "good.json",
        "not-json": folder / "not-json.json",
        "unknown": folder / "unknown.json",
        "impossible": folder / "impossible.json",
    }
    # No "name": the graph is named after its file, by a worker as by a local compile.
    paths["good"].write_text(json.dumps({k: v for k, v in document.items() if k != "name"}))
    paths["not-json"].write_text('{"name": "broken", "ops": [}')
    paths["unknown"].write_text(json.dumps(unknown))
    paths["impossible"].write_text(json.dumps(impossible))
    return paths


def test_poison_jobs_go_to_the_dead_letter_stream_after_max_attempts(fleet, tmp_path: Path) -> None:
    f = fleet(job_max_attempts=2)
    poison = poison_graphs(tmp_path / "poison")
    good = generate_workload(tmp_path / "graphs", 2, seed=4)
    f.start_worker("w1")
    f.start_worker("w2")
    f.wait_live("w1", "w2")

    from workers.cli_common import EXIT_CHECK_FAILED, EXIT_PROJECT_ERROR

    # `submit` refuses a file that is not JSON, with nothing of its batch enqueued; a job holding one can still
    # reach the stream (written by hand, or by another build's submit), and must be dead-lettered all the same.
    refused = f.run("submit", *good, poison["not-json"], "--tier", f.url, check=False)
    assert refused.returncode == EXIT_PROJECT_ERROR and str(poison["not-json"]) in refused.stderr, refused.stderr
    assert f.queue()["pending"] == 0
    hand_job = {"id": "hand-00000", "batch": "hand", "file": str(poison["not-json"]),
                "graph": poison["not-json"].read_text(), "attempt": 1, "toolchain": toolchain_id()}  # fmt: skip
    f.redis.xadd(f.keys.job_shard(0).stream(toolchain_id()), {"job": json.dumps(hand_job)})
    submitted = [*good, *(path for name, path in poison.items() if name != "not-json")]
    report = f.submit(*submitted, expect_code=EXIT_CHECK_FAILED)
    wait_until(lambda: "hand-00000" in f.results())
    hand = f.results()["hand-00000"]
    report["jobs"]["hand-00000"] = {"file": hand_job["file"], "status": hand["status"], "error": hand["error"]}
    report["submitted"] += 1
    report["dead_letter"] += hand["status"] == "dead_letter"
    report["failed"] += hand.get("attempts", 0)
    assert (report["submitted"], report["completed"], report["dead_letter"], report["unfinished"]) == (6, 3, 3, 0)
    assert report["failed"] == 3 * 2  # every poison job failed job_max_attempts times
    by_file = {Path(job["file"]).stem: job for job in report["jobs"].values()}
    for name in ("good", *(p.stem for p in good)):
        assert by_file[name]["status"] == "completed" and by_file[name]["error"] is None
    assert {r["graph"] for r in f.results().values() if r["status"] == "completed"} == {"good", *(p.stem for p in good)}
    assert "not valid JSON" in by_file["not-json"]["error"]
    assert "FlashAttention" in by_file["unknown"]["error"]
    assert "impossible" in by_file["impossible"]["error"] and "op 0 (Matmul)" in by_file["impossible"]["error"]
    for name in ("not-json", "unknown", "impossible"):
        assert by_file[name]["status"] == "dead_letter"
        assert str(poison[name]) in by_file[name]["error"]  # the error names the graph file

    status = f.queue("--dead-letters")
    assert (status["completed"], status["dead_letter"], status["failed"], status["pending"], status["in_flight"]) == (
        3, 3, 6, 0, 0
    )  # fmt: skip
    dead = {entry["job"]: entry for entry in status["dead_letters"]}
    assert set(dead) == {job for job, info in report["jobs"].items() if info["status"] == "dead_letter"}
    for job, entry in dead.items():
        assert entry["error"] == report["jobs"][job]["error"] and entry["attempts"] == "2"
    # The dead letter keeps the job itself, so it can be inspected or resubmitted.
    for fields in f.dead_letters():
        payload = json.loads(fields[b"payload"])
        assert payload["graph"] == Path(payload["file"]).read_text()
    assert f.failures() == 0  # a dead letter carries its attempts; nothing is left behind

    for name in ("w1", "w2"):
        assert f.stop(name)[0] == 0
    # Failed passes record no metrics; the totals are the sum of the completed passes.
    assert_metrics_are_the_sum_of_the_passes(f, f.results())


# -- signals to a worker with --concurrency -------------------------------------------------------------
def test_sigterm_to_a_concurrency_worker_stops_every_process(fleet, tmp_path: Path) -> None:
    """A supervisor (Kubernetes, `kill PID`) signals the parent only: it must pass SIGTERM to its workers."""
    f = fleet()
    parent = f.start_worker("multi", "--concurrency", "2")
    f.wait_live("multi-0", "multi-1")
    pids = {name: beat["pid"] for name, beat in f.heartbeats().items()}
    assert parent.pid not in pids.values()
    code, seconds = f.stop("multi")
    assert code == 0 and seconds < 10, f.log("multi")
    assert f.heartbeats() == {}  # both left cleanly
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert f.log("multi").count("jobs, exiting") == 2


def test_a_worker_rides_out_a_redis_outage(private_redis_server, tmp_path: Path) -> None:
    """The queue's Redis goes away and comes back empty (no persistence): the worker waits and retries
    instead of dying, recreates its consumer group, and takes the jobs submitted afterwards."""
    server = private_redis_server()
    f = Fleet(server.url, tmp_path)
    try:
        f.start_worker("w1")
        f.wait_live("w1")
        server.stop()
        wait_until(lambda: "the queue failed" in f.log("w1"))
        assert f.workers["w1"].poll() is None, f.log("w1")
        server.start()
        f.redis = redis.Redis.from_url(server.url)
        graphs = generate_workload(tmp_path / "graphs", 2, seed=5)
        report = f.submit(*graphs)
        assert report["completed"] == 2, (report, f.log("w1"))
        assert f.stop("w1")[0] == 0
    finally:
        f.close()


def test_a_job_whose_result_cannot_be_recorded_is_compiled_again_not_held(private_redis_server, tmp_path: Path) -> None:
    """Redis fails as the worker records a finished job: the worker must stop keeping that job claimed, so it
    turns idle and is reclaimed (here by the same worker) and completed, instead of being refreshed forever."""
    import threading

    from cachestore.settings import load_settings
    from workers import fleet as fleet_module

    server = private_redis_server()
    namespace = f"fleettest{uuid.uuid4().hex[:12]}"
    settings = load_settings(
        {"tier": server.url, "namespace": namespace, "job_claim_idle": 1.0, "heartbeat_interval": 0.2}
    )
    client = redis.Redis.from_url(server.url)
    keys = KeySpace(namespace)
    [graph] = generate_workload(tmp_path / "graphs", 1, seed=6)
    [job] = fleet_module.submit(client, keys, [graph], settings.entry_ttl).job_ids

    worker = fleet_module.Worker(settings, "w1", max_jobs=1)
    record = worker._complete
    attempts = []

    def fails_once(*args, **kwargs):
        attempts.append(1)
        if len(attempts) == 1:
            raise redis.ConnectionError("connection lost while recording")
        return record(*args, **kwargs)

    worker._complete = fails_once
    runner = threading.Thread(target=worker.run, daemon=True)
    runner.start()
    runner.join(timeout=WAIT)
    if runner.is_alive():
        worker.stopping = True
        runner.join(timeout=10)
        pytest.fail(f"the job was never completed: {len(attempts)} attempt(s) to record it")
    assert len(attempts) == 2 and worker.queue_errors == 1
    result = fleet_module.results_of(client, keys, [job])[job]
    assert result["status"] == "completed" and result["worker"] == "w1"
    stream = keys.job_shard(job_shard(job, fleet_module.job_shards(client, keys))).stream(toolchain_id())
    assert client.xpending(stream, fleet_module.GROUP)["pending"] == 0
    client.close()


# -- toolchains: a job is compiled only by its submitter's compiler ------------------------------------------
OTHER_TOOLCHAIN = "b" * 16  # a worker whose compiler differs from this checkout's (a rolling upgrade)


@pytest.fixture
def other_worker(monkeypatch) -> Iterator[Callable[[Fleet, str], object]]:
    """Workers running in this process as if their compiler were another build: the fleet module's toolchain is
    patched, so the worker reads that toolchain's stream and says so in its heartbeat."""
    import threading

    from cachestore.settings import load_settings
    from workers import fleet as fleet_module

    monkeypatch.setattr(fleet_module, "toolchain_id", lambda: OTHER_TOOLCHAIN)
    running: list[tuple[object, threading.Thread]] = []

    def start(f: Fleet, name: str) -> object:
        settings = load_settings({"tier": f.url, "namespace": f.namespace, "heartbeat_interval": BEAT,
                                  "job_claim_idle": 1.0})  # fmt: skip
        worker = fleet_module.Worker(settings, name)
        thread = threading.Thread(target=worker.run, name=f"worker-{name}", daemon=True)
        thread.start()
        running.append((worker, thread))
        f.wait_live(name)
        return worker

    yield start
    for worker, thread in running:
        worker.stopping = True
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_job_waits_for_a_worker_of_its_toolchain_and_never_goes_to_another(
    fleet, other_worker, tmp_path: Path
) -> None:
    """Only a worker of another toolchain is live: the job is not compiled by it, `submit --wait` says once
    that no live worker has the job's toolchain, `queue` shows the job waiting for that toolchain; then a worker
    of the submitter's toolchain starts and compiles it."""
    from workers.cli_common import EXIT_CHECK_FAILED

    f = fleet(job_claim_idle=1.0)  # the other worker would also reclaim the job within the wait, if it could
    mine = toolchain_id()
    assert mine != OTHER_TOOLCHAIN
    [graph] = generate_workload(tmp_path / "graphs", 1, seed=7)
    other = other_worker(f, "w-other")
    assert f.heartbeats()["w-other"]["toolchain"] == OTHER_TOOLCHAIN

    done = f.run("submit", graph, "--tier", f.url, "--json", "--wait", "--timeout", 4, check=False)
    assert done.returncode == EXIT_CHECK_FAILED, (done.stdout, done.stderr)
    report = json.loads(done.stdout)
    assert report["toolchain"] == mine
    assert (report["submitted"], report["completed"], report["unfinished"]) == (1, 0, 1)
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and f"no live worker has toolchain {mine}" in warnings[0], done.stderr
    [job_id] = report["jobs"]
    # The job carries its toolchain, on that toolchain's stream; the other worker took nothing.
    [(_, fields)] = f.redis.xrange(f.keys.job_shard(job_shard(job_id, len(f.shards()))).stream(mine))
    assert json.loads(fields[b"job"])["toolchain"] == mine
    assert f.results() == {} and other.done == 0 and f.heartbeats()["w-other"]["job"] is None

    status = f.queue()
    assert status["toolchains"] == {
        mine: {"pending": 1, "in_flight": 0, "live_workers": 0},
        OTHER_TOOLCHAIN: {"pending": 0, "in_flight": 0, "live_workers": 1},
    }
    assert status["unserved"] == {mine: 1}
    assert (status["pending"], status["in_flight"]) == (1, 0)  # the sums over the toolchains
    assert [(w["name"], w["toolchain"]) for w in status["workers"]] == [("w-other", OTHER_TOOLCHAIN)]
    text = f.run("queue", "--tier", f.url).stdout
    assert f"warning: 1 job waits for toolchain {mine}, which no live worker has" in text, text
    assert "\n1 live worker\n" in text and "1 live workers" not in text, text  # issue 34: "1 jobs" no more

    # A worker of the submitter's toolchain arrives: it compiles the waiting job, and the queue is served.
    f.start_worker("w-mine")
    wait_until(lambda: job_id in f.results())
    result = f.results()[job_id]
    assert result["status"] == "completed" and result["worker"] == "w-mine", result
    assert other.done == 0
    status = f.queue()
    assert status["unserved"] == {} and (status["pending"], status["in_flight"], status["completed"]) == (0, 0, 1)
    assert status["toolchains"][mine] == {"pending": 0, "in_flight": 0, "live_workers": 1}
    assert "warning" not in f.run("queue", "--tier", f.url).stdout
    assert f.stop("w-mine")[0] == 0


def test_a_job_naming_another_toolchain_is_refused_not_compiled(fleet, tmp_path: Path) -> None:
    """Jobs written by hand onto this toolchain's stream, one naming another toolchain and one naming none:
    the worker compiles neither, fails each with an error naming both toolchains (dead-lettered after the
    attempts), and writes no artifact and no pass."""
    f = fleet(job_max_attempts=2)
    mine = toolchain_id()
    [graph] = generate_workload(tmp_path / "graphs", 1, seed=8)
    for job_id, toolchain in (("hand-00000", "c" * 16), ("hand-00001", None)):
        job = {"id": job_id, "batch": "hand", "file": str(graph), "graph": graph.read_text(), "attempt": 1}
        if toolchain is not None:
            job["toolchain"] = toolchain
        f.redis.xadd(f.keys.job_shard(0).stream(mine), {"job": json.dumps(job)})
    f.start_worker("w1")
    wait_until(lambda: len(f.results()) == 2)
    results = f.results()
    assert {r["status"] for r in results.values()} == {"dead_letter"}, results
    named = results["hand-00000"]["error"]
    assert "c" * 16 in named and mine in named and "not compiled" in named and str(graph) in named
    unnamed = results["hand-00001"]["error"]
    assert "without a toolchain" in unnamed and mine in unnamed and "not compiled" in unnamed
    assert f.counts() == {"failed": 4, "dead_letter": 2}
    assert f.redis.exists(f.keys.job_artifact("hand-00000"), f.keys.job_artifact("hand-00001")) == 0
    assert f.stop("w1")[0] == 0
    assert f.totals() == {}  # no pass ran: nothing was compiled, so no metrics batch was applied


def test_a_job_whose_graph_is_a_path_is_refused_never_opened_on_the_worker(fleet, tmp_path: Path) -> None:
    """A job carries its graph as data. One whose graph is a JSON string naming a file must not make the
    worker compile (or probe for) a file of its own machine."""
    f = fleet(job_max_attempts=1)
    [graph] = generate_workload(tmp_path / "graphs", 1, seed=8)  # a real graph file the worker could read
    job = {"id": "path-00000", "batch": "path", "file": "innocent.json", "graph": json.dumps(str(graph)),
           "attempt": 1, "toolchain": toolchain_id()}  # fmt: skip
    f.redis.xadd(f.keys.job_shard(0).stream(toolchain_id()), {"job": json.dumps(job)})
    f.start_worker("w1")
    wait_until(lambda: len(f.results()) == 1)
    result = f.results()["path-00000"]
    assert result["status"] == "dead_letter" and "holds a JSON object, got str" in result["error"], result
    assert str(graph) not in result["error"]
    assert f.stop("w1")[0] == 0
    assert f.totals() == {}  # nothing was compiled


def test_a_deeply_nested_graph_fails_its_job_and_the_worker_lives_on(fleet, tmp_path: Path) -> None:
    """1500 levels of JSON used to raise RecursionError in the worker itself: it died, and so did every
    worker that reclaimed the job after it."""
    f = fleet(job_max_attempts=2)
    [graph] = generate_workload(tmp_path / "graphs", 1, seed=8)
    deep = '{"name": "deep", "tensors": {}, "ops": ' + "[" * 1500 + "]" * 1500 + "}"
    for job_id, text in (("deep-00000", deep), ("deep-00001", graph.read_text())):
        job = {"id": job_id, "batch": "deep", "file": f"{job_id}.json", "graph": text, "attempt": 1,
               "toolchain": toolchain_id()}  # fmt: skip
        f.redis.xadd(f.keys.job_shard(0).stream(toolchain_id()), {"job": json.dumps(job)})
    f.start_worker("w1")
    wait_until(lambda: len(f.results()) == 2)
    results = f.results()
    assert results["deep-00000"]["status"] == "dead_letter" and "nested deeper" in results["deep-00000"]["error"]
    assert results["deep-00001"]["status"] == "completed"
    assert f.stop("w1")[0] == 0  # alive until told to stop


def test_worker_json_says_how_many_jobs_it_did(fleet, tmp_path: Path) -> None:
    f = fleet()
    graphs = tmp_path / "graphs"
    generate_workload(graphs, 1, seed=0)
    f.submit(graphs, wait=False)
    command = [NKICACHE, "worker", "--tier", f.url, "--name", "wj", "--max-jobs", "1", "--json"]
    done = subprocess.run(
        command, env=f.env, capture_output=True, text=True, timeout=WAIT * 2, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"jobs": 1, "workers": [{"name": "wj", "jobs": 1}]}
