"""What one pass costs Redis, how the load spreads over a cluster, and how many passes one node serves
(issue 18). A load test, not a test: `nkicache bench` does not run it; bench/RESULTS.md and docs/capacity.md
record its output.

M simulated workers (processes) each run passes against a private Redis through the real tier client
(`cachestore.stores.open_tier`, the same calls the codegen loop makes through the KernelStore port): one
`find_traces` of the pass's distinct keys, a lease and a `publish_trace` (the real entry format, a synthetic
binary sized like the workload's, 4-170 KiB, which zstd shrinks to 0.17 against the workload's 0.09) for each
miss, then `record_pass` and `flush` (the fleet metrics batch). Each pass uses `--ops` kernel calls drawn from
`--variants` variants with a Zipf popularity, as a fleet's models share their common kernels.

It runs once against one private redis-server and once against a private 3-master Redis Cluster (the one
the tests use, tests/redis_cluster.py), each with no persistence on free loopback ports, and prints per
pass: commands, round trips (requests the clients sent, a pipeline counting once per node), bytes in and
out of the servers; per node: its share of commands and of memory; and for the single server the Redis CPU
seconds per pass, hence the passes per second one node serves at 100% of its one core (its saturation
throughput), beside the throughput reached here and this machine's CPU control of the moment.

    python bench/fleet_scale.py                          # 4 workers x 150 passes, both topologies
    python bench/fleet_scale.py --workers 2 --passes 50 --json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

NAMESPACE = "fleetscale"
KERNELS = ("matmul_tiled", "softmax", "rmsnorm", "blockwise_mm", "conv2d_pbp_kxk", "tiled_dve_transpose_10")
MEASUREMENT_COMMANDS = {"info", "config|resetstat", "flushall", "cluster|info", "cluster|slots", "cluster|shards",
                        "cluster|nodes", "ping", "command", "command|docs", "client|setinfo", "hello"}  # fmt: skip


# -- one simulated worker, in a process of its own ------------------------------------------------------
def variant(index: int) -> tuple[str, dict]:
    """(cache key, key components) of synthetic variant `index`: the specification's key of its components."""
    from bridge.codegen import cache_key_of_stored

    kernel = KERNELS[index % len(KERNELS)]
    shape = [128 * (1 + index % 16), 64 * (1 + (index // 16) % 32)]
    components = {"kernel_name": kernel, "operands": {"shapes": [shape], "dtypes": ["bfloat16"]},
                  "results": {"shapes": [shape], "dtypes": ["bfloat16"]}, "attrs": {"variant": index},
                  "target": "Trn2", "num_neuroncores": 2}  # fmt: skip
    return cache_key_of_stored(components), components


def binary(rng, index: int) -> bytes:
    """4-170 KiB of instruction-like words: few distinct values, so it compresses as the real binaries do."""
    size = int(4096 * (170 / 4) ** ((index * 0.61803) % 1.0))
    return rng.integers(0, 16, size // 4, dtype="uint32").tobytes()


def run_worker(
    url: str, worker: int, passes: int, ops: int, variants: int, fill: bool, out: multiprocessing.Queue
) -> None:
    """Run `passes` passes and put what they did on `out`. `fill`: pass n uses variants n*ops.. once each
    (a cold fleet tracing everything), otherwise `ops` calls drawn by popularity."""
    import numpy as np
    import redis.connection

    from bridge.port import PASS_COUNTERS, PassRecord, VariantUse
    from cachestore.settings import Settings
    from cachestore.stores import open_tier

    sent = [0]
    send = redis.connection.AbstractConnection.send_packed_command

    def counting_send(self, command, check_health=True):
        sent[0] += 1
        return send(self, command, check_health)

    redis.connection.AbstractConnection.send_packed_command = counting_send
    rng = np.random.default_rng(worker)
    popularity = 1.0 / np.arange(1, variants + 1) ** 1.1
    popularity /= popularity.sum()
    tier = open_tier(Settings(tier=url, namespace=NAMESPACE, host=f"host{worker % 8}", worker=f"w{worker}",
                              op_timeout=5.0, final_flush_timeout=30.0))  # fmt: skip
    traced = 0
    started = time.perf_counter()
    sent_at_start = sent[0]
    for n in range(passes):
        began = time.time()
        used = np.arange(n * ops, min((n + 1) * ops, variants)) if fill else rng.choice(variants, ops, p=popularity)
        calls = {int(i): int((used == i).sum()) for i in np.unique(used)}
        keyed = {i: variant(i) for i in calls}
        found, _ = tier.find_traces([key for key, _ in keyed.values()])
        for i, (key, components) in keyed.items():
            if key not in found and tier.acquire_lease(key):
                result = {"binary": binary(rng, i), "input_names": ["x"], "output_names": ["out"], "format": "bir"}
                tier.publish_trace(key, result, components, 0.05, release_lease=True)
                traced += 1
        counts = dict.fromkeys(PASS_COUNTERS, 0) | {"passes": 1, "kernels": len(used), "cache_misses": len(calls),
                                                    "cache_hits": len(used) - len(calls)}  # fmt: skip
        uses = {key: VariantUse(c["kernel_name"], calls[i], began, time.time()) for i, (key, c) in keyed.items()}
        tier.record_pass(PassRecord(f"w{worker}-g{n}", f"w{worker}-p{n}", began, time.time(), counts, uses))
        tier.flush()
    seconds = time.perf_counter() - started
    round_trips = sent[0] - sent_at_start
    tier.close()
    out.put({"worker": worker, "passes": passes, "traced": traced, "seconds": seconds, "round_trips": round_trips})


# -- servers and their statistics ------------------------------------------------------------------------
def node_stats(port: int) -> dict:
    import redis

    client = redis.Redis(port=port, socket_timeout=10)
    try:
        commandstats = client.info("commandstats")
        stats, cpu, memory = client.info("stats"), client.info("cpu"), client.info("memory")
    finally:
        client.close()
    commands = sum(v["calls"] for name, v in commandstats.items()
                   if name.removeprefix("cmdstat_") not in MEASUREMENT_COMMANDS)  # fmt: skip
    return {"commands": commands, "bytes_in": stats["total_net_input_bytes"],
            "bytes_out": stats["total_net_output_bytes"], "cpu": cpu["used_cpu_sys"] + cpu["used_cpu_user"],
            "memory": memory["used_memory"]}  # fmt: skip


def reset(ports: list[int], *, flush: bool) -> None:
    import redis

    for port in ports:
        client = redis.Redis(port=port, socket_timeout=10)
        try:
            if flush:
                client.execute_command("FLUSHALL")  # our own servers
            client.config_resetstat()
        finally:
            client.close()


def load(url: str, ports: list[int], args: argparse.Namespace) -> dict:
    """Fill the emptied servers on `ports` with every variant (one worker tracing them all, a cold fleet), then
    run the simulated workers at full speed on the warm cache; what each phase cost and what each node did."""
    reset(ports, flush=True)
    cold = phase(url, ports, 1, -(-args.variants // args.ops), args, fill=True)
    reset(ports, flush=False)
    warm = phase(url, ports, args.workers, args.passes, args, fill=False)
    return {"cold": cold, "warm": warm}


def phase(url: str, ports: list[int], workers: int, passes: int, args: argparse.Namespace, *, fill: bool) -> dict:
    before = {port: node_stats(port) for port in ports}
    context = multiprocessing.get_context("spawn")
    queue: multiprocessing.Queue = context.Queue()
    started = time.perf_counter()
    processes = [context.Process(target=run_worker, args=(url, w, passes, args.ops, args.variants, fill, queue))
                 for w in range(workers)]  # fmt: skip
    for process in processes:
        process.start()
    results = [queue.get(timeout=1800) for _ in processes]
    for process in processes:
        process.join()
    wall = time.perf_counter() - started
    after = {port: node_stats(port) for port in ports}
    nodes = {port: {name: after[port][name] - before[port][name] for name in before[port]} for port in ports}
    for port in ports:
        nodes[port]["memory"] = after[port]["memory"]  # what the node holds now
    total_passes = sum(r["passes"] for r in results)
    total = {name: sum(n[name] for n in nodes.values()) for name in ("commands", "bytes_in", "bytes_out", "cpu")}
    memory = sum(n["memory"] for n in nodes.values())
    return {
        "workers": workers,
        "passes": total_passes,
        "traced": sum(r["traced"] for r in results),
        "passes_per_second": round(total_passes / max(r["seconds"] for r in results), 1),
        "wall_seconds": round(wall, 2),
        "per_pass": {
            "commands": round(total["commands"] / total_passes, 1),
            "round_trips": round(sum(r["round_trips"] for r in results) / total_passes, 2),
            "bytes_in": round(total["bytes_in"] / total_passes),
            "bytes_out": round(total["bytes_out"] / total_passes),
            "redis_cpu_ms": round(1000 * total["cpu"] / total_passes, 3),
        },
        "per_node": {
            str(port): {
                "command_share": round(n["commands"] / max(total["commands"], 1), 3),
                "memory_share": round(n["memory"] / max(memory, 1), 3),
                "memory_mib": round(n["memory"] / 2**20, 1),
                "cpu_seconds": round(n["cpu"], 2),
            }
            for port, n in nodes.items()
        },
    }


def cpu_control(n: int = 3_000_000) -> float:
    from pool_scaling import cpu_control as control

    return round(control(n), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4, help="simulated worker processes (default 4)")
    parser.add_argument("--passes", type=int, default=150, help="passes per worker (default 150)")
    parser.add_argument("--ops", type=int, default=60, help="kernel calls per pass (default 60)")
    parser.add_argument("--variants", type=int, default=3000, help="distinct variants drawn from (default 3000)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from redis_cluster import start_cluster

    from bench.dev_redis import start_private_server

    figures: dict = {"settings": vars(args) | {"json": None}, "cpu_control_before": cpu_control()}
    with start_private_server() as server:
        figures["single"] = load(server.url, [server.port], args)
    cluster = start_cluster()
    try:
        figures["cluster"] = load(cluster.url, cluster.ports, args)
    finally:
        cluster.cleanup()
    figures["cpu_control_after"] = cpu_control()
    cpu_ms = figures["single"]["warm"]["per_pass"]["redis_cpu_ms"]
    figures["node_saturation_passes_per_second"] = round(1000 / cpu_ms) if cpu_ms else None
    print(json.dumps(figures, indent=2) if args.json else table(figures))


def table(figures: dict) -> str:
    lines = [f"CPU control (2 processes / 1, 2.0 = two idle cores): {figures['cpu_control_before']} before, "
             f"{figures['cpu_control_after']} after", ""]  # fmt: skip
    lines += ["| topology | phase | workers | passes | passes/s | commands/pass | round trips/pass | bytes in/pass "
              "| bytes out/pass | Redis CPU ms/pass |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name in ("single", "cluster"):
        for phase_name in ("cold", "warm"):
            run = figures[name][phase_name]
            p = run["per_pass"]
            lines.append(f"| {name} | {phase_name} | {run['workers']} | {run['passes']} | {run['passes_per_second']} "
                         f"| {p['commands']} | {p['round_trips']} | {p['bytes_in']:,} | {p['bytes_out']:,} "
                         f"| {p['redis_cpu_ms']} |")  # fmt: skip
    lines += ["", "| cluster node | phase | share of commands | share of memory | memory MiB | CPU s |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for phase_name in ("cold", "warm"):
        for port, node in figures["cluster"][phase_name]["per_node"].items():
            lines.append(f"| {port} | {phase_name} | {node['command_share']:.1%} | {node['memory_share']:.1%} "
                         f"| {node['memory_mib']} | {node['cpu_seconds']} |")  # fmt: skip
    lines += ["", f"One node's saturation throughput (1 / Redis CPU per warm pass, single server): "
              f"{figures['node_saturation_passes_per_second']} passes/s"]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
