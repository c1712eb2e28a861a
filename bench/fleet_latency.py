"""fleet_job_latency_vs_local (issue 48): how long a user waits for one warm graph through the fleet, against
compiling it at home.

Two `nkicache worker` processes, idle and live, on a private redis-server with the default 16 job shards. In
each round, in turn (bench.processes): `nkicache submit GRAPH --wait --out DIR` of the workload's first
graph, and `nkicache compile GRAPH --out DIR` on the same Redis tier (what compiling at home costs a user of
that tier: the same client to import, the same entries to read). Round 0 warms the tier and is not kept. The
figure is the ratio of the two medians, both whole processes from start to exit.

    python bench/fleet_latency.py [--rounds 9] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the checkout: the bench package

from fleet_survival import Fleet  # a sibling script

from bench.dev_redis import start_private_server
from bench.processes import Commands, nkicache_command
from workers.workload import generate_workload


def latency(folder: Path, rounds: int) -> dict:
    [graph] = generate_workload(folder / "graphs", 1, 0)
    server = start_private_server()
    fleet = Fleet(server.url, folder)
    try:
        for name in ("w1", "w2"):
            fleet.start(name)
        fleet.wait(lambda: all(fleet.beats().get(name, {}).get("compiler_pid") for name in ("w1", "w2")))
        nkicache = nkicache_command()
        commands = Commands(folder)
        namespace = {"NKICACHE_NAMESPACE": fleet.namespace}
        local = [*nkicache, "compile", str(graph), "--tier", server.url, "--out", str(folder)]
        commands.add("local_ms", lambda _: local, lambda _: namespace)
        submit = [*nkicache, "submit", str(graph), "--tier", server.url, "--wait", "--out", str(folder / "fleet")]
        commands.add("submit_wait_ms", lambda _: submit, lambda _: namespace)
        figures = commands.measure(rounds)
    finally:
        fleet.close()
        server.cleanup()
    local_artifact = (folder / f"{graph.stem}.nkibb").read_bytes()
    if (folder / "fleet" / f"{graph.stem}.nkibb").read_bytes() != local_artifact:
        raise SystemExit("the fleet's artifact is not the local compile's")
    figures["fleet_job_latency_vs_local"] = round(figures["submit_wait_ms"] / figures["local_ms"], 3)
    return figures | {"rounds": rounds, "graph": graph.name}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="Print one JSON object (for nkicache bench).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nkibench-latency-") as tmp:
        figures = latency(Path(tmp), args.rounds)
    print(json.dumps(figures) if args.json else json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
