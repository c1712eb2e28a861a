"""The fleet over time (issue 14): how long a SIGKILLed worker's job waits before another worker takes it over,
and whether a worker's memory stays flat over thousands of jobs.

A benchmark, not a test: `nkicache worker` processes on a private redis-server, default settings
(heartbeat_interval 2 s, job_claim_idle 60 s) unless given. Prints one JSON object.

    python bench/fleet_survival.py                       # 5 takeovers, 2,000 jobs
    python bench/fleet_survival.py --takeovers 2 --jobs 200 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: the bench package

import redis

from bench.dev_redis import start_private_server
from cachestore.keys import KeySpace
from workers.fleet import results_of, submit
from workers.workload import GraphBuilder, unet_block

NKICACHE = str(Path(sys.executable).with_name("nkicache"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


class Fleet:
    def __init__(self, url: str, folder: Path, **settings: object):
        self.url, self.folder = url, folder
        self.namespace = f"bench{uuid.uuid4().hex[:10]}"
        self.keys = KeySpace(self.namespace)
        self.client = redis.Redis.from_url(url)
        self.env = {**os.environ, "NKICACHE_NAMESPACE": self.namespace, "NKICACHE_TIER": url,
                    **{f"NKICACHE_{k.upper()}": str(v) for k, v in settings.items()}}  # fmt: skip
        self.workers: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")  # noqa: SIM115 - the process owns it
        self.workers[name] = subprocess.Popen([NKICACHE, "worker", "--name", name], env=self.env, stdout=log,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)  # fmt: skip
        log.close()
        return self.workers[name]

    def beats(self) -> dict[str, dict]:
        return {k.decode(): json.loads(v) for k, v in self.client.hgetall(self.keys.worker_heartbeats).items()}

    def wait(self, predicate, timeout: float = 300, interval: float = 0.01):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(interval)
        raise TimeoutError("condition not met")

    def close(self) -> None:
        for process in self.workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.workers.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        self.client.close()


def graph_file(folder: Path, name: str, size: int) -> Path:
    g = GraphBuilder(name)
    unet_block(g, 0, (32, 32, size), "float32")
    path = folder / f"{name}.json"
    path.write_text(json.dumps(g.document()))
    return path


def takeover(url: str, folder: Path, runs: int) -> dict:
    """Two workers; one job (about 3 s of tracing); the worker compiling it is SIGKILLed 0.5 s into the job:
    seconds from the kill until the survivor takes the job, and until it is completed."""
    taken, finished = [], []
    for run in range(runs):
        fleet = Fleet(url, folder)
        try:
            for name in ("a", "b"):
                fleet.start(name)
            fleet.wait(lambda fleet=fleet: {"a", "b"} <= set(fleet.beats()))
            path = graph_file(folder, f"takeover-{run}", 144 + 8 * run)  # a graph no earlier run traced
            [job] = submit(fleet.client, fleet.keys, [str(path)], 3600).job_ids
            victim = fleet.wait(lambda fleet=fleet, job=job: next(
                (name for name, beat in fleet.beats().items() if beat.get("job") == job), None))  # fmt: skip
            time.sleep(0.5)
            fleet.workers[victim].kill()
            killed = time.monotonic()
            survivor = "b" if victim == "a" else "a"
            fleet.wait(lambda fleet=fleet, job=job, survivor=survivor: fleet.beats()[survivor].get("job") == job)
            taken.append(time.monotonic() - killed)
            fleet.wait(lambda fleet=fleet, job=job: results_of(fleet.client, fleet.keys, [job]))
            finished.append(time.monotonic() - killed)
        finally:
            fleet.close()
    return {
        "takeover_seconds": [round(s, 2) for s in taken],
        "takeover_median_seconds": round(statistics.median(taken), 2),
        "kill_to_completed_seconds": [round(s, 2) for s in finished],
    }


def memory_over_jobs(url: str, folder: Path, jobs: int, every: int) -> dict:
    """One worker compiles `jobs` jobs (8 graphs, submitted over and over; from the second round on every
    kernel is a remote hit, as in a warm fleet): the RSS of the worker and of its compiling process, which
    ran every pass, sampled every `every` jobs."""
    fleet = Fleet(url, folder)
    paths = [str(graph_file(folder, f"rss-{i}", 16 + 4 * i)) for i in range(8)]
    samples = []
    try:
        fleet.start("w")
        fleet.wait(lambda: "w" in fleet.beats())
        started = time.monotonic()
        done, completed, kernels, remote_hits = 0, 0, 0, 0
        while done < jobs:
            batch = submit(fleet.client, fleet.keys, (paths * (every // len(paths) + 1))[:every], 3600).job_ids
            results = fleet.wait(lambda batch=batch: len(r := results_of(fleet.client, fleet.keys, batch)) == len(batch)
                                 and r)  # fmt: skip
            completed += sum(r["status"] == "completed" for r in results.values())
            kernels += sum(r.get("kernels", 0) for r in results.values())
            remote_hits += sum(r.get("remote_hits", 0) for r in results.values())
            done += len(batch)
            beat = fleet.beats()["w"]
            samples.append({"jobs": done, "worker_rss_mib": round(rss_kib(fleet.workers["w"].pid) / 1024, 1),
                            "compiler_rss_mib": round(rss_kib(beat["compiler_pid"]) / 1024, 1),
                            "compiler_pid": beat["compiler_pid"]})  # fmt: skip
        seconds = time.monotonic() - started
    finally:
        fleet.close()
    first, last = samples[0], samples[-1]
    return {
        "jobs": done,
        "completed": completed,
        "kernels": kernels,
        "remote_hits": remote_hits,
        "seconds": round(seconds, 1),
        "rss_samples": samples,
        "one_compiling_process": len({s["compiler_pid"] for s in samples}) == 1,
        "worker_rss_growth_mib": round(last["worker_rss_mib"] - first["worker_rss_mib"], 1),
        "compiler_rss_growth_mib": round(last["compiler_rss_mib"] - first["compiler_rss_mib"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--takeovers", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--every", type=int, default=200, help="Sample RSS every this many jobs.")
    parser.add_argument("--quick", action="store_true", help="--takeovers 2 --jobs 200 --every 50")
    args = parser.parse_args()
    if args.quick:
        args.takeovers, args.jobs, args.every = 2, 200, 50
    server = start_private_server()
    try:
        with tempfile.TemporaryDirectory(prefix="nkicache-fleet-bench-") as folder:
            report = {"heartbeat_interval": 2.0, "job_claim_idle": 60.0}
            report |= takeover(server.url, Path(folder), args.takeovers)
            report |= memory_over_jobs(server.url, Path(folder), args.jobs, args.every)
    finally:
        server.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
