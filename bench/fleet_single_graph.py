"""One cold graph submitted to a fleet of 2 `nkicache worker` processes vs 1 (issue 17): its variants are traced
by both workers through trace tasks on the job streams (workers/trace_tasks.py).

Each run: a fresh namespace on a private redis-server (so the tier is cold) with one job shard (the job and its
trace tasks on one stream), N workers started and waited for (live, their compiling process up), the
graph of bench/pool_scaling.py's single-graph measurement submitted, and the time from the submit to the job's
result as `submit --wait` gets it (workers.fleet.wait_for, woken by the job's push: a poll would take CPU from
the workers being measured), beside the job's own seconds as its worker measured them. Runs alternate
(1 worker, 2 workers, ...), each pair after the CPU control of the moment (bench/pool_scaling.py: 2 processes
of pure-Python work vs 1). Medians.

    python bench/fleet_single_graph.py [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout: the bench package

from fleet_survival import Fleet  # a sibling script
from pool_scaling import big_graph, cpu_control

from bench.dev_redis import start_private_server
from workers.fleet import submit, wait_for


def one_run(url: str, folder: Path, graph: Path, workers: int) -> dict:
    fleet = Fleet(url, folder, job_shards=1)
    try:
        names = [f"w{i}" for i in range(workers)]
        for name in names:
            fleet.start(name)
        fleet.wait(lambda: all(fleet.beats().get(name, {}).get("compiler_pid") for name in names), timeout=120)
        started = time.perf_counter()
        job_ids = submit(fleet.client, fleet.keys, [str(graph)], ttl=3600).job_ids
        waited = wait_for(fleet.client, fleet.keys, job_ids, timeout=300, on_progress=lambda done: None, job_ttl=3600)
        elapsed = time.perf_counter() - started
        result = waited.results.get(job_ids[0], {"status": f"lost or not finished in 300 s: {waited.lost}"})
    finally:
        fleet.close()
    if result["status"] != "completed":
        raise SystemExit(f"the job did not complete: {result}")
    return {"seconds": elapsed, "job_seconds": result["seconds"], "traces": result["traces"],
            "parallel_traces": result["parallel_traces"], "kernels": result["kernels"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="Print one JSON object (for nkicache bench).")
    args = parser.parse_args()
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    server = start_private_server()
    try:
        with tempfile.TemporaryDirectory(prefix="nkicache-fleet-graph-") as name:
            folder = Path(name)
            os.environ["XDG_CACHE_HOME"] = str(folder / "xdg")
            graph = big_graph(folder / "graph")
            say(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
            runs: dict[int, list[dict]] = {1: [], 2: []}
            controls = []
            for _ in range(args.repeats):
                controls.append(cpu_control())
                for workers in (1, 2):
                    runs[workers].append(one_run(server.url, folder, graph, workers))
            say(f"load average {os.getloadavg()[0]:.2f} at the end")
    finally:
        server.cleanup()
    one, two = runs[1], runs[2]
    figures = {
        "fleet_single_graph_scaling": statistics.median(r["seconds"] for r in one)
        / statistics.median(r["seconds"] for r in two),
        "cpu_control": statistics.median(controls),
        "seconds_1": statistics.median(r["seconds"] for r in one),
        "seconds_2": statistics.median(r["seconds"] for r in two),
        "job_seconds_1": statistics.median(r["job_seconds"] for r in one),
        "job_seconds_2": statistics.median(r["job_seconds"] for r in two),
        "pair_ratios": [round(a["seconds"] / b["seconds"], 2) for a, b in zip(one, two, strict=True)],
        "all_controls": [round(c, 2) for c in controls],
        "kernels": one[0]["kernels"],
        "variants": one[0]["traces"] + one[0]["parallel_traces"],
    }
    if args.json:
        print(json.dumps(figures))
        return
    for key, value in figures.items():
        print(f"{key:28} {value:.3f}" if isinstance(value, float) else f"{key:28} {value}")


if __name__ == "__main__":
    main()
