"""Local pool scaling: graphs/s with 2 workers vs 1 on the workload and on one large graph, and the warm/cold
ratio with the embedded tier.

Every figure comes from `nkicache compile --json` run as its own process, as a user runs it, on workloads from
`nkicache workload`; "s" is the command's own `seconds` (from the start of compiling to the summary: pool
start-up included, interpreter start and imports not), "wall" the whole process. Runs are interleaved
(1 worker, 2 workers, 1, 2, ...) so load from other jobs on the machine falls on both alike; medians.

- throughput: `--tier off`, so every run traces every variant it meets (nothing carries over between runs).
  `--workers 1` compiles in the command's own process; `--workers 2` traces the variants in the command's
  process and one forked helper process (workers/variant_pool.py), the passes run in the command's process.
- single graph: the same on one cold graph holding a layer of every workload configuration in two dtypes
  (`big_graph`: 120 kernel ops, over 90 distinct variants).
- what bounds the 2-worker figure: the helpers' start-up, measured alone in fresh processes; and what two
  processes get from this machine at all, measured right before each 1-vs-2 pair with a pure-Python CPU
  loop (2 processes at once vs 1: 2.0x on two idle cores).
- warm/cold: a fresh local tier file per repetition; a cold compile with 2 workers, then the same compile
  again (warm: every variant comes from the tier, nothing is traced), and once more with 1 worker.

    python bench/pool_scaling.py [--models 12 40] [--repeats 3] [--seed 0] [--single-graph-repeats 5]
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
    passes = [median(list(seconds)) for seconds in zip(*(r["pass_seconds"] for r in one), strict=True)]
    return {
        "graphs": one[0]["passes"],
        "kernels": one[0]["kernels"],
        "traces": one[0]["traces"],
        "parallel_traces_2": two[0]["parallel_traces"],
        "seconds_1": median([r["seconds"] for r in one]),
        "seconds_2": median([r["seconds"] for r in two]),
        "wall_1": median([r["wall"] for r in one]),
        "wall_2": median([r["wall"] for r in two]),
        "rate_1": rate[1],
        "rate_2": rate[2],
        "ratio": rate[2] / rate[1],
        "wall_ratio": median([r["wall"] for r in one]) / median([r["wall"] for r in two]),
        "pair_ratios": [round(a["seconds"] / b["seconds"], 2) for a, b in zip(one, two, strict=True)],
        "trace_cpu_1": median([r["compile_seconds"] for r in one]),
        "trace_cpu_2": median([r["compile_seconds"] for r in two]),
        "longest_pass": max(passes),
        "pass_sum": sum(passes),
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
    """Run in a fresh process: 2 helper processes started as `compile --workers 3` starts them
    (workers/variant_pool.py), told there is nothing to trace, and gone."""
    from cachestore.settings import load_settings
    from workers.variant_pool import Claims, Helpers, pool_start_context

    settings = load_settings({"tier": "off"})
    context = pool_start_context()
    started = time.perf_counter()
    helpers = Helpers(context, [], Claims(context, 0), 2, settings, context.Value("q", 0))
    up = time.perf_counter() - started
    helpers.go()
    helpers.close()
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


def big_graph(folder: Path) -> Path:
    """One large cold model: a UNet block of every UNet configuration and an MoE layer of every MoE configuration
    of the workload generator (docs/workload.md), in float32 and again in bfloat16."""
    from workers.workload import MOE_CONFIGS, UNET_CONFIGS, GraphBuilder, moe_layer, unet_block

    graph = GraphBuilder("one-big-model")
    layers = [(unet_block, c) for c in UNET_CONFIGS] + [(moe_layer, c) for c in MOE_CONFIGS]
    for dtype in ("float32", "bfloat16"):
        for layer, config in layers:
            layer(graph, len(graph.ops), config, dtype)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "one-big-model.json"
    path.write_text(json.dumps(graph.document(), indent=1, sort_keys=True) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, nargs="+", default=[12, 40])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-graph-repeats", type=int, default=5)
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
        single = throughput(big_graph(tmp / "single").parent, tmp, args.single_graph_repeats, env)
        first_traces = warm_up(tmp / f"workload-{args.models[0]}", env)
        say(f"load average {os.getloadavg()[0]:.2f} at the end")
        if args.json:
            models, default = rows[0]  # the first workload given: 12 models, `nkicache workload`'s default
            print(
                json.dumps(
                    {
                        "pool_scaling": default["ratio"],
                        "models": models,
                        "cpu_control": default["control"],
                        "single_graph_scaling": single["ratio"],
                        "single_graph_cpu_control": single["control"],
                        "single_graph": single,
                        "startup_seconds": start["up"],
                        "rows": dict(rows),
                        "warm_cold": dict(warm_rows),
                    }
                )
            )
            return
        print_tables(start, first_traces, [*rows, ("1 graph", single)], warm_rows, args.models[0])


def print_tables(start: dict, first_traces: dict, rows: list, warm_rows: list, warm_up_models: int) -> None:
    print()
    print("Throughput, --tier off (every run traces):")
    print()
    print("| models | kernels | traces (2 workers: parallel) | 1 worker s | 2 workers s | 1 worker graphs/s "
          "| 2 workers graphs/s | 2 vs 1 | CPU control | trace CPU s 1 / 2 | wall s 1 / 2 | wall 2 vs 1 |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for models, r in rows:
        cells = [
            models, r["kernels"], f"{r['traces']} ({r['parallel_traces_2']})", f"{r['seconds_1']:.2f}",
            f"{r['seconds_2']:.2f}", f"{r['rate_1']:.2f}", f"{r['rate_2']:.2f}", f"**{r['ratio']:.2f}x**",
            f"{r['control']:.2f}x",
            f"{r['trace_cpu_1']:.2f} / {r['trace_cpu_2']:.2f}", f"{r['wall_1']:.2f} / {r['wall_2']:.2f}",
            f"{r['wall_ratio']:.2f}x",
        ]  # fmt: skip
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print()
    for models, r in rows:
        print(f"  {models}: seconds per run, 1 worker {r['all_seconds_1']}, 2 workers {r['all_seconds_2']}; "
              f"2 vs 1 per pair {r['pair_ratios']}, CPU control before each pair {r['all_controls']}; "
              f"1-worker passes sum {r['pass_sum']:.2f} s, longest {r['longest_pass']:.2f} s")  # fmt: skip
    print()
    print(f"Helpers' start-up alone (fresh process; 2 helpers forked as compile --workers 3 forks them): started "
          f"after {start['up']:.3f} s, started, told nothing is left and gone {start['total']:.3f} s")  # fmt: skip
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
