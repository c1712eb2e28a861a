"""The fleet's flood throughput (issue 48): N tiny warm jobs through 2 `nkicache worker` processes, beside the
most Redis Streams allow here.

On a private redis-server: 2 workers, live and idle; one tiny graph (a small softmax) compiled once to warm
the tier; then N jobs of it submitted in one batch and waited for, from the first XADD to the last result.
Every job must complete exactly once: N results, all completed, and the queue's counts say N completions
and no failure. The floor, on the same server in the same run: a bare redis-py loop of the same shape, one
process XADDing N messages while 2 processes XREADGROUP one message at a time and XACK it.

    python bench/fleet_flood.py [--jobs 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout: the bench package

import redis
from fleet_survival import Fleet  # a sibling script

from bench.dev_redis import start_private_server
from workers.fleet import submit_texts, wait_for
from workers.workload import GraphBuilder

FLOOR_STREAM, FLOOR_GROUP = "floor:stream", "floor"


def tiny_graph() -> str:
    g = GraphBuilder("tiny")
    g.tensor("x", (4, 8), "float32")
    g.tensor("y", (4, 8), "float32")
    g.kernel("Softmax", ["x"], ["y"])
    return json.dumps(g.document())


def flood(url: str, folder: Path, jobs: int) -> dict:
    fleet = Fleet(url, folder)
    try:
        for name in ("w1", "w2"):
            fleet.start(name)
        fleet.wait(lambda: all(fleet.beats().get(name, {}).get("compiler_pid") for name in ("w1", "w2")))
        graph = tiny_graph()
        warm = submit_texts(fleet.client, fleet.keys, [("tiny.json", graph)], ttl=3600)
        wait_for(fleet.client, fleet.keys, warm.job_ids, 120, lambda done: None, 3600)
        started = time.perf_counter()
        batch = submit_texts(fleet.client, fleet.keys, [(f"tiny-{i}.json", graph) for i in range(jobs)], ttl=3600)
        waited = wait_for(fleet.client, fleet.keys, batch.job_ids, 600, lambda done: None, 3600)
        seconds = time.perf_counter() - started
        counts = {}
        for shard in range(16):
            for key, value in fleet.client.hgetall(fleet.keys.job_shard(shard).counts).items():
                counts[key.decode()] = counts.get(key.decode(), 0) + int(value)
    finally:
        fleet.close()
    completed = sum(1 for result in waited.results.values() if result.get("status") == "completed")
    if completed != jobs or counts.get("completed") != jobs + 1 or counts.get("failed", 0):
        raise SystemExit(f"not every job completed exactly once: {completed} of {jobs}, counts {counts}")
    return {"jobs": jobs, "flood_seconds": round(seconds, 2), "flood_jobs_per_second": round(jobs / seconds, 1)}


def _consume(url: str, name: str, count: int, done: multiprocessing.Value) -> None:
    client = redis.Redis.from_url(url)
    while True:
        with done.get_lock():
            if done.value >= count:
                return
        reply = client.xreadgroup(FLOOR_GROUP, name, {FLOOR_STREAM: ">"}, count=1, block=100)
        for _stream, messages in reply or []:
            for message_id, _fields in messages:
                client.xack(FLOOR_STREAM, FLOOR_GROUP, message_id)
                with done.get_lock():
                    done.value += 1


def floor(url: str, jobs: int, payload: str) -> dict:
    """N messages the size of a job's through a bare XADD / XREADGROUP / XACK loop with 2 consumers."""
    client = redis.Redis.from_url(url)
    client.delete(FLOOR_STREAM)
    client.xgroup_create(FLOOR_STREAM, FLOOR_GROUP, id="0", mkstream=True)
    done = multiprocessing.Value("q", 0)
    consumers = [multiprocessing.Process(target=_consume, args=(url, f"c{i}", jobs, done)) for i in range(2)]
    for process in consumers:
        process.start()
    started = time.perf_counter()
    for _ in range(jobs):
        client.xadd(FLOOR_STREAM, {"job": payload})
    for process in consumers:
        process.join()
    seconds = time.perf_counter() - started
    client.delete(FLOOR_STREAM)
    client.close()
    return {"floor_seconds": round(seconds, 2), "floor_jobs_per_second": round(jobs / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--json", action="store_true", help="Print one JSON object (for nkicache bench).")
    args = parser.parse_args()
    server = start_private_server()
    try:
        with tempfile.TemporaryDirectory(prefix="nkibench-flood-") as tmp:
            figures = flood(server.url, Path(tmp), args.jobs)
        figures |= floor(server.url, args.jobs, tiny_graph())
    finally:
        server.cleanup()
    figures["flood_vs_floor"] = round(figures["flood_jobs_per_second"] / figures["floor_jobs_per_second"], 3)
    print(json.dumps(figures) if args.json else json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
