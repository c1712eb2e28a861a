"""verify and du over N entries, this code against an earlier release, alternated in one session (issue 16).

A benchmark, not a test. Two private redis-servers (never the machine's 6379) are filled with the same N
synthetic entries by `bench/report_scale.py`'s own `populate`, one by each code (each writes its own entry
schema). Then, round after round, it times `report_scale.py --measure verify|du` of each code, each run a
fresh process as report_scale times it, alternating which code goes first; and before each round, the CPU
control of `bench/pool_scaling.py` (2 processes running a pure-Python loop at once over 1: 2.0 on two idle
cores), since this code splits the scan over one process a CPU (cachestore.scan_split) and what a second
process gains depends on what the machine gives at that moment. This code also runs with one process
(`--processes 1`), which tells the split's share from the rest.

    python bench/verify_du_ab.py --base /tmp/base16 --base-python /tmp/base16/.venv/bin/python \\
        [--entries 100000] [--rounds 3]

The base tree is an earlier release (`git archive fa6a41c | tar -x -C /tmp/base16`) with its own venv.
Prints one JSON line per round and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def fill(python: str, tree: Path, url: str, entries: int) -> dict:
    """`populate` of `tree`'s report_scale.py, run by `python` with `tree` first on the path."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + '/bench');"
            "import report_scale; print(json.dumps(report_scale.populate(sys.argv[2], int(sys.argv[3]))))")  # fmt: skip
    done = subprocess.run([python, "-c", code, str(tree), url, str(entries)], capture_output=True, text=True,
                          check=True, cwd=tree)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(python: str, tree: Path, url: str, what: str, processes: int | None = None) -> tuple[float, float]:
    """(the command's seconds, as report_scale times it; the CPU seconds of its process and the processes it
    forked, interpreter start and imports included)."""
    extra = [] if processes is None else ["--processes", str(processes)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([python, str(tree / "bench" / "report_scale.py"), "--measure", what, "--url", url, *extra],
                          capture_output=True, text=True, check=True, cwd=tree)  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"], cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="The earlier release's tree.")
    parser.add_argument("--base-python", required=True, help="Its interpreter (its own venv).")
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from pool_scaling import cpu_control

    from bench.dev_redis import start_private_server

    servers = {"base": start_private_server(), "new": start_private_server()}
    trees = {"base": (args.base_python, args.base), "new": (sys.executable, ROOT)}
    rows = []
    try:
        for code, server in servers.items():
            filled = fill(*trees[code], server.url, args.entries)
            print(f"{code}: {filled}", file=sys.stderr)
        for round_ in range(args.rounds):
            row: dict = {"round": round_ + 1, "at": time.strftime("%H:%M:%S", time.gmtime()),
                         "load": os.getloadavg()[0], "control": cpu_control()}  # fmt: skip
            order = ("base", "new") if round_ % 2 == 0 else ("new", "base")
            for what in ("verify", "du"):
                for code in order:
                    row[f"{code}_{what}"], row[f"{code}_{what}_cpu"] = measure(*trees[code], servers[code].url, what)
                row[f"new1_{what}"], row[f"new1_{what}_cpu"] = measure(*trees["new"], servers["new"].url, what,
                                                                       processes=1)  # fmt: skip
            row["load_after"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.cleanup()
    print("\n| round | at (UTC) | load | CPU control | verify base / new (1 process) s | verify | CPU s base / new "
          "(1 process) | du base / new (1 process) s | du | CPU s base / new (1 process) |\n"
          "|---|---|---|---:|---|---:|---|---|---:|---|")  # fmt: skip
    for r in rows:
        cells = []
        for what in ("verify", "du"):
            base, new, new1 = (r[f"{code}_{what}"] for code in ("base", "new", "new1"))
            cpu = [r[f"{code}_{what}_cpu"] for code in ("base", "new", "new1")]
            cells += [f"{base:.2f} / {new:.2f} ({new1:.2f})", f"{base / new:.2f}x",
                      f"{cpu[0]:.1f} / {cpu[1]:.1f} ({cpu[2]:.1f})"]  # fmt: skip
        print(f"| {r['round']} | {r['at']} | {r['load']:.1f}-{r['load_after']:.1f} | {r['control']:.2f}x | "
              + " | ".join(cells) + " |")  # fmt: skip
    for what in ("verify", "du"):
        ratios = [r[f"base_{what}"] / r[f"new_{what}"] for r in rows]
        print(f"{what}: median {statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
