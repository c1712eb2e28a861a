"""Local pool scaling: graphs/s with 2 pool workers vs 1, and the warm/cold ratio with the embedded tier.

Every figure comes from `nkicache compile --json` run as its own process, as a user runs it, on workloads from
`nkicache workload`; "s" is the command's own `seconds` (from the start of compiling to the summary: pool
start-up included, interpreter start and imports not), "wall" the whole process. Runs are interleaved
(1 worker, 2 workers, 1, 2, ...) so load from other jobs on the machine falls on both alike; medians.

- throughput: `--tier off`, so every run traces every variant it meets (nothing carries over between runs).
  `--workers 1` compiles in the command's own process; `--workers 2` starts a pool (forkserver + 2 processes).
- what bounds the 2-worker figure: the pool's start-up, measured alone in fresh processes (forkserver, its
  import of the compiler, two processes answering a first task); the longest single pass (a pass is not
  split between processes); what each new process pays for its first traces of each kernel; and what two
  processes get from this machine at all, measured right before each 1-vs-2 pair with a pure-Python CPU
  loop (2 processes at once vs 1: 2.0x on two idle cores).
- warm/cold: a fresh local tier file per repetition; a cold compile with 2 workers, then the same compile
  again (warm: every variant comes from the tier, nothing is traced), and once more with 1 worker.

    python bench/pool_scaling.py [--models 12 40] [--repeats 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NKICACHE = str(Path(sys.executable).with_name("nkicache"))


def compile_run(graphs: Path, out: Path, workers: int, tier: str, env: dict) -> dict:
    started = time.perf_counter()
    done = subprocess.run(
        [NKICACHE, "compile", str(graphs), "--workers", str(workers), "--tier", tier, "--out", str(out), "--json"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"nkicache compile failed ({done.returncode}): {done.stderr}")
    report = json.loads(done.stdout)
    report["wall"] = wall
    report["pass_seconds"] = [g["seconds"] for g in report["graphs"]]
    return report


def median(values: list[float]) -> float:
    return statistics.median(values)


def throughput(graphs: Path, tmp: Path, repeats: int, env: dict) -> dict:
    runs: dict[int, list[dict]] = {1: [], 2: []}
    controls = []
    for repeat in range(repeats):
        controls.append(cpu_control())
        for workers in (1, 2):
            runs[workers].append(compile_run(graphs, tmp / f"out-{workers}-{repeat}", workers, "off", env))
    one, two = runs[1], runs[2]
    rate = {w: median([r["passes"] / r["seconds"] for r in runs[w]]) for w in runs}
    # The best two processes can do on these passes: the sum split in two, or the longest pass if it is longer.
    passes = [median(list(seconds)) for seconds in zip(*(r["pass_seconds"] for r in one), strict=True)]
    bound = sum(passes) / max(sum(passes) / 2, max(passes))
    return {
        "graphs": one[0]["passes"],
        "kernels": one[0]["kernels"],
        "traces": one[0]["traces"],
        "seconds_1": median([r["seconds"] for r in one]),
        "seconds_2": median([r["seconds"] for r in two]),
        "wall_1": median([r["wall"] for r in one]),
        "wall_2": median([r["wall"] for r in two]),
        "rate_1": rate[1],
        "rate_2": rate[2],
        "ratio": rate[2] / rate[1],
        "trace_cpu_1": median([r["compile_seconds"] for r in one]),
        "trace_cpu_2": median([r["compile_seconds"] for r in two]),
        "longest_pass": max(passes),
        "pass_sum": sum(passes),
        "bound": bound,
        "all_seconds_1": [round(r["seconds"], 2) for r in one],
        "all_seconds_2": [round(r["seconds"], 2) for r in two],
        "control": median(controls),
        "all_controls": [round(c, 2) for c in controls],
    }


def warm_cold(graphs: Path, tmp: Path, repeats: int, env: dict) -> dict:
    cold, warm, warm_serial = [], [], []
    for repeat in range(repeats):
        tier = f"local:{tmp / f'tier-{graphs.name}-{repeat}.sqlite'}"
        cold.append(compile_run(graphs, tmp / f"cold-{repeat}", 2, tier, env))
        warm.append(compile_run(graphs, tmp / f"warm-{repeat}", 2, tier, env))
        warm_serial.append(compile_run(graphs, tmp / f"warm1-{repeat}", 1, tier, env))
    counted = (
        "traces",
        "parallel_traces",
        "remote_hits",
        "tier_errors",
        "tier_timeouts",
        "tier_rejected",
        "tier_dropped",
        "lease_waits",
    )
    for before, *after in zip(cold, warm, warm_serial, strict=True):
        for name, run in zip(("warm (2 workers)", "warm (1 worker)"), after, strict=True):
            if run["traces"] or run["parallel_traces"]:
                raise SystemExit(
                    f"a {name} run traced: the tier did not serve every variant; that run: "
                    f"{ {key: run[key] for key in counted} }, the cold run before it: "
                    f"{ {key: before[key] for key in counted} }"
                )
    return {
        "cold": median([r["seconds"] for r in cold]),
        "warm": median([r["seconds"] for r in warm]),
        "warm_1": median([r["seconds"] for r in warm_serial]),
        "ratio": median([c["seconds"] / w["seconds"] for c, w in zip(cold, warm, strict=True)]),
        "cold_traces": cold[0]["traces"] + cold[0]["parallel_traces"],
        "cold_remote_hits": cold[0]["remote_hits"],
        "warm_remote_hits": warm[0]["remote_hits"],
    }


# -- the pool's start-up alone ----------------------------------------------------------------------
def probe_startup() -> None:
    """Run in a fresh process: a 2-process pool up and answering, as `workers.pool.compile_run` starts it."""
    from concurrent.futures import ProcessPoolExecutor

    from cachestore.settings import load_settings
    from workers.pool import _init_process, pool_context

    settings = load_settings({"tier": "off"})
    started = time.perf_counter()
    executor = ProcessPoolExecutor(2, mp_context=pool_context(), initializer=_init_process, initargs=(settings,))
    first = executor.submit(os.getpid)
    second = executor.submit(os.getpid)
    first.result()
    up = time.perf_counter() - started
    second.result()
    executor.shutdown(wait=True)
    print(json.dumps({"up": up, "total": time.perf_counter() - started}))


def startup(repeats: int, env: dict) -> dict:
    probes = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, __file__, "--probe-startup"], capture_output=True, text=True, env=env,
                              check=True)  # fmt: skip
        probes.append(json.loads(done.stdout))
    return {"up": median([p["up"] for p in probes]), "total": median([p["total"] for p in probes])}


# -- what the machine gives two processes ---------------------------------------------------------------
def spin(n: int) -> float:
    started = time.perf_counter()
    total = 0
    for i in range(n):
        total += i * i % 7
    return time.perf_counter() - started


def cpu_control(n: int = 4_000_000) -> float:
    """Throughput of 2 processes running a pure-Python loop at once over 1 running it: 2.0 on two idle cores."""
    import multiprocessing

    one = spin(n)
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(spin, [1000, 1000])  # both processes up before timing
        started = time.perf_counter()
        pool.map(spin, [n, n], chunksize=1)
        two = time.perf_counter() - started
    return 2 * one / two


def warm_up(graphs: Path, env: dict) -> dict:
    """Trace seconds of a workload's passes in a fresh process, then again in the same process: what the
    first traces of each kernel cost a new process (each pool process pays it anew)."""
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from workers.passes import compile_graph\n"
        "files = sorted(Path(sys.argv[1]).glob('*.json'))\n"
        "rounds = [sum(compile_graph(f)[0].counts['compile_seconds'] for f in files) for _ in range(2)]\n"
        "print(json.dumps(rounds))\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(graphs)], capture_output=True, text=True, env=env,
                          check=True)  # fmt: skip
    first, second = json.loads(done.stdout)
    return {"first": first, "second": second}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, nargs="+", default=[12, 40])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-startup", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="Print one JSON object (for nkicache bench).")
    args = parser.parse_args()
    if args.probe_startup:
        probe_startup()
        return

    from workers.workload import generate_workload

    with tempfile.TemporaryDirectory(prefix="nkicache-pool-bench-") as name:
        tmp = Path(name)
        env = {**os.environ, "XDG_CACHE_HOME": str(tmp / "xdg")}  # never the user's own tier
        env.pop("NKICACHE_TIER", None)
        env.pop("NKICACHE_TIER_MODE", None)
        say = (lambda *a, **k: print(*a, **k, file=sys.stderr)) if args.json else print
        say(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
            f"{args.repeats} repetitions, medians; workload seed {args.seed}")  # fmt: skip
        start = startup(max(args.repeats, 5), env)
        rows, warm_rows = [], []
        for models in args.models:
            graphs = tmp / f"workload-{models}"
            generate_workload(graphs, models, args.seed)
            rows.append((models, throughput(graphs, tmp, args.repeats, env)))
            warm_rows.append((models, warm_cold(graphs, tmp, args.repeats, env)))
        first_traces = warm_up(tmp / f"workload-{args.models[0]}", env)
        say(f"load average {os.getloadavg()[0]:.2f} at the end")
        if args.json:
            models, largest = rows[-1]
            print(
                json.dumps(
                    {
                        "pool_scaling": largest["ratio"],
                        "models": models,
                        "cpu_control": largest["control"],
                        "startup_seconds": start["up"],
                        "rows": dict(rows),
                        "warm_cold": dict(warm_rows),
                    }
                )
            )
            return
        print_tables(start, first_traces, rows, warm_rows, args.models[0])


def print_tables(start: dict, first_traces: dict, rows: list, warm_rows: list, warm_up_models: int) -> None:
    print()
    print("Throughput, --tier off (every run traces):")
    print()
    print("| models | kernels | traces | 1 worker s | 2 workers s | 1 worker graphs/s | 2 workers graphs/s "
          "| 2 vs 1 | bound by longest pass | CPU control | trace CPU s 1 / 2 | wall s 1 / 2 |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for models, r in rows:
        cells = [
            models, r["kernels"], r["traces"], f"{r['seconds_1']:.2f}", f"{r['seconds_2']:.2f}",
            f"{r['rate_1']:.2f}", f"{r['rate_2']:.2f}", f"**{r['ratio']:.2f}x**", f"{r['bound']:.2f}x",
            f"{r['control']:.2f}x",
            f"{r['trace_cpu_1']:.2f} / {r['trace_cpu_2']:.2f}", f"{r['wall_1']:.2f} / {r['wall_2']:.2f}",
        ]  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print()
    for models, r in rows:
        print(f"  {models} models: seconds per run, 1 worker {r['all_seconds_1']}, 2 workers {r['all_seconds_2']}; "
              f"CPU control before each pair {r['all_controls']}; 1-worker passes sum {r['pass_sum']:.2f} s, "
              f"longest {r['longest_pass']:.2f} s")  # fmt: skip
    print()
    print(f"Pool start-up alone (fresh process; forkserver, its import of the compiler, 2 processes): first task "
          f"answered after {start['up']:.2f} s, start + shutdown {start['total']:.2f} s")  # fmt: skip
    print(f"First traces in a fresh process ({warm_up_models} models, tier off): {first_traces['first']:.2f} s of "
          f"tracing, the same passes again in that process {first_traces['second']:.2f} s")  # fmt: skip
    print()
    print("Warm vs cold, 2 workers (and warm with 1), local tier (fresh tier file per repetition):")
    print()
    print("| models | cold s | warm s | cold / warm | cold traces | cold remote hits | warm remote hits (traces 0) "
          "| warm s, 1 worker |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for models, r in warm_rows:
        print(f"| {models} | {r['cold']:.2f} | {r['warm']:.2f} | **{r['ratio']:.2f}x** | {r['cold_traces']} "
              f"| {r['cold_remote_hits']} | {r['warm_remote_hits']} | {r['warm_1']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
