"""warm_compile_s3_vs_floor (issue 47): a warm `nkicache compile` of one graph on an s3:// tier, as a user feels
it, against a floor: a process that imports the same S3 client (obstore) and GETs the same objects the compile
reads (the tier's marker and the graph's entries), one after the other.

A moto S3 server (bench/dev_s3.py) runs in this process on loopback, a cold compile fills a new bucket, and
each round then runs the warm compile and the floor in turn (bench.processes), both whole processes from start
to exit. Round 0 warms up and is not kept.

    python bench/s3_warm.py [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: the bench package

from bench.dev_s3 import S3Server
from bench.processes import Commands, nkicache_command, run_seconds
from workers.workload import generate_workload

PREFIX = "nkicache"
FLOOR = """\
import sys, obstore
from obstore.store import S3Store
store = S3Store(sys.argv[1], prefix=sys.argv[2], client_options={"allow_http": True})
for name in sys.argv[3:]:
    obstore.get(store, name).bytes()
"""


def measure(folder: Path, rounds: int) -> dict:
    [graph] = generate_workload(folder / "graphs", 1, 0)
    server = S3Server()
    try:
        bucket = server.new_bucket()
        commands = Commands(folder)
        commands.environment.update(server.environment)
        compile_line = [*nkicache_command(), "compile", str(graph), "--tier", f"s3://{bucket}/{PREFIX}", "--json"]
        run_seconds([*compile_line, "--out", str(folder / "cold")], commands.environment, folder)
        read = [name.removeprefix(f"{PREFIX}/") for name in server.object_names(bucket, f"{PREFIX}/entries/")]
        commands.add("warm_compile_s3_ms", lambda _: [*compile_line, "--out", str(folder / "warm")])
        floor = [sys.executable, "-c", FLOOR, bucket, PREFIX, "nkicache-dir-store", *read]
        commands.add("floor_s3_ms", lambda _: floor)
        figures = commands.measure(rounds)
    finally:
        server.stop()
    warm = json.loads(commands.outputs["warm_compile_s3_ms"])
    if warm["traces"] or warm["remote_hits"] != len(read):
        raise SystemExit(f"the warm compile traced {warm['traces']} and hit {warm['remote_hits']} of {len(read)}")
    figures["warm_compile_s3_vs_floor"] = round(figures["warm_compile_s3_ms"] / figures["floor_s3_ms"], 3)
    return figures | {"rounds": rounds, "graph": graph.name, "objects_read": len(read) + 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="Print one JSON object (for nkicache bench).")
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nkibench-s3-") as folder:
        figures = measure(Path(folder), arguments.rounds)
    print(json.dumps(figures) if arguments.json else "\n".join(f"{k}: {v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
