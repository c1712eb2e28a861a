"""How `nkicache report` and `nkicache inspect verify` scale with the number of entries (issue 7).

A benchmark, not a test. It starts a private redis-server (no persistence, a free loopback port, its own
temp dir; never the machine's 6379), fills it with N synthetic but valid entries (random binaries of 1-6
KiB, their SHA-256 digests, key components of the seven library kernels whose sorted-items SHA-256 is the
cache key) and the fleet metrics of passes that used them (applied
with the tier's own Lua script, 200 keys per pass), then times, each in a fresh process:

    report   build_report (totals, per worker, per kernel, top 10 variants, timeline) + JSON rendering
    verify   verify_entries: every entry decoded, digest checked, key recomputed
    du       disk_usage (storage by kernel)

(verify and du read the entries in one process a CPU, cachestore.scan_split.)

and prints a Markdown table for bench/RESULTS.md: wall seconds, ratio to the smallest N, and peak memory
(tracemalloc's peak of Python allocations during the command, in a second, traced run; and the process's
peak RSS, interpreter and imports included).

    python bench/report_scale.py                  # 10k and 100k entries
    python bench/report_scale.py --sizes 1000 10000
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAMESPACE = "bench"
KERNELS = (
    ("matmul_tiled", 2), ("softmax", 1), ("rmsnorm", 2), ("blockwise_mm", 6), ("conv2d_pbp_kxk", 2),
    ("resize_nearest_fixed_dma_kernel", 1), ("tiled_dve_transpose_10", 1),
)  # fmt: skip
KEYS_PER_PASS = 200


# -- synthetic entries and metrics --------------------------------------------------------------------
def populate(url: str, count: int, seed: int = 7) -> dict:
    import numpy as np
    import redis

    from bridge.codegen import cache_key_of_stored as cache_key_of
    from cachestore.api import KeyUsage, MetricsBatch
    from cachestore.backends.redis import RedisBackend
    from cachestore.entry import Entry, encode_entry
    from cachestore.keys import KeySpace

    rng = np.random.default_rng(seed)
    client = redis.Redis.from_url(url)
    client.flushall()  # our own server
    keys = KeySpace(NAMESPACE)
    tier = RedisBackend(client, keys)
    toolchain = tier.partition  # this compiler's trusted partition, named by its id: what report and verify read
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    batch_keys: dict[str, KeyUsage] = {}
    kernel_calls: dict[str, int] = {}
    stored_bytes = 0
    now = time.time()
    passes = 0
    for i in range(count):
        kernel, operands = KERNELS[i % len(KERNELS)]
        shapes = [[int(128 * (1 + (i >> 3) % 64)), int(64 * (1 + (i + j) % 16))] for j in range(operands)]
        components = {"kernel_name": kernel, "operands": {"shapes": shapes, "dtypes": ["float32"] * operands},
                      "results": {"shapes": [shapes[0]], "dtypes": ["float32"]}, "attrs": {"variant": i},
                      "target": "Trn2", "num_neuroncores": 2}  # fmt: skip
        key = cache_key_of(components)
        binary = rng.bytes(int(rng.integers(1024, 6 * 1024)))
        entry = Entry(binary, ["x"], ["out"], "bir", "bir-1", components, "bench-host", "w0", now,
                      float(rng.uniform(0.005, 0.07)), toolchain=toolchain)  # fmt: skip
        data = encode_entry(entry)
        pipe.set(keys.entry(tier.partition, key), data, ex=30 * 86400)
        stored_bytes += len(data)
        usage = int(rng.integers(1, 20))
        batch_keys[key] = KeyUsage(kernel, usage, now - 3600, now)
        kernel_calls[kernel] = kernel_calls.get(kernel, 0) + usage
        if len(pipe) >= 2000:
            pipe.execute()
        if len(batch_keys) == KEYS_PER_PASS or i == count - 1:
            pipe.execute()
            kernels = sum(u.usage for u in batch_keys.values())
            totals = {"passes": 1, "kernels": kernels, "cache_hits": kernels - len(batch_keys),
                      "cache_misses": len(batch_keys), "remote_hits": len(batch_keys) // 2,
                      "traces": len(batch_keys) - len(batch_keys) // 2}  # fmt: skip
            record = {**totals, "finished": now - 86400 + passes * 60, "host": f"host{passes % 8}"}
            tier.apply_metrics(MetricsBatch(f"pass-{passes}", f"host{passes % 8}", f"w{passes % 3}", totals,
                                            kernel_calls, batch_keys, record))  # fmt: skip
            passes += 1
            batch_keys, kernel_calls = {}, {}
    pipe.execute()
    info = client.info("memory")
    client.close()
    seconds = time.perf_counter() - started
    return {"entries": count, "passes": passes, "stored_bytes": stored_bytes,
            "redis_used_bytes": int(info["used_memory"]), "populate_seconds": seconds}  # fmt: skip


# -- one measurement, in a process of its own ---------------------------------------------------------
def measure(url: str, what: str, traced: bool, processes: int | None = None) -> dict:
    import tracemalloc

    from cachestore.entry import SignaturePolicy
    from cachestore.inspect import disk_usage
    from cachestore.report import build_report
    from cachestore.report_render import render_json
    from cachestore.settings import Settings
    from cachestore.stores import open_backend
    from workers.verify import verify_entries

    settings = Settings(tier=url, namespace=NAMESPACE)
    reader = open_backend(settings, reading=True)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if traced:
        tracemalloc.start()
    started = time.perf_counter()
    if what == "report":
        result = {"kernels": json.loads(render_json(build_report(reader)))["totals"]["kernels"]}
    elif what == "verify":
        report = verify_entries(reader, SignaturePolicy(), processes=processes)
        result = {"checked": report.checked, "bad": len(report.bad)}
    else:
        result = {"entries": disk_usage(reader, processes=processes)["total"]["entries"]}
    seconds = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1] if traced else None
    reader.close()
    # The whole process's peak, interpreter and imports included (they are most of it: see rss_before).
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "traced_peak_bytes": peak, "rss_peak_bytes": rss_peak,
            "rss_before_bytes": rss_before * 1024, **result}  # fmt: skip


def run_measure(url: str, what: str, traced: bool) -> dict:
    output = subprocess.run(
        [sys.executable, __file__, "--measure", what, "--url", url] + (["--traced"] if traced else []),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return json.loads(output.strip().splitlines()[-1])


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / 1024**2:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--measure", choices=["report", "verify", "du"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    # verify and du: how many processes read the entries (default: one a CPU, cachestore.scan_split)
    parser.add_argument("--processes", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="Print one JSON object (for nkicache bench).")
    parser.add_argument("--quick", action="store_true", help="Skip the tracemalloc runs (RSS peak only).")
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.url, args.measure, args.traced, args.processes)))
        return

    from bench.dev_redis import start_private_server

    server = start_private_server()  # never the machine's shared Redis
    url = server.url
    rows = []
    try:
        for size in args.sizes:
            filled = populate(url, size)
            print(f"populated {size} entries ({filled['passes']} passes, {mib(filled['stored_bytes'])} MiB stored, "
                  f"redis {mib(filled['redis_used_bytes'])} MiB) in {filled['populate_seconds']:.1f} s",
                  file=sys.stderr)  # fmt: skip
            for what in ("report", "verify", "du"):
                timed = run_measure(url, what, traced=False)
                # The traced run (tracemalloc) gives Python's allocation peak; --quick keeps the process's RSS peak.
                traced = timed if args.quick else run_measure(url, what, traced=True)
                rows.append((size, what, timed, traced, filled))
                counts = {k: v for k, v in timed.items() if k in ("kernels", "checked", "bad", "entries")}
                print(f"  {what}: {timed['seconds']:.2f} s, traced peak {mib(traced['traced_peak_bytes'])} MiB, "
                      f"peak RSS {mib(timed['rss_peak_bytes'])} MiB (after imports "
                      f"{mib(timed['rss_before_bytes'])}) {counts}", file=sys.stderr)  # fmt: skip
    finally:
        server.cleanup()

    if args.json:
        largest = max(args.sizes)
        by_command = {what: (timed, traced) for size, what, timed, traced, _ in rows if size == largest}
        suffix = f"{largest // 1000}k" if largest >= 1000 else str(largest)
        print(json.dumps({
            f"report_seconds_{suffix}": by_command["report"][0]["seconds"],
            f"verify_seconds_{suffix}": by_command["verify"][0]["seconds"],
            f"du_seconds_{suffix}": by_command["du"][0]["seconds"],
            "peak_traced_mib": (
                None if args.quick else max(t["traced_peak_bytes"] for _, t in by_command.values()) / 2**20
            ),
            "peak_rss_mib": max(timed["rss_peak_bytes"] for timed, _ in by_command.values()) / 1024**2,
        }))  # fmt: skip
        return
    smallest = {what: timed["seconds"] for size, what, timed, _, _ in rows if size == args.sizes[0]}
    print(f"Machine: {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python "
          f"{platform.python_version()}; private redis-server on loopback.\n")  # fmt: skip
    print("| entries | command | seconds | x smallest | entries/s | peak traced MiB | peak RSS MiB | stored MiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for size, what, timed, traced, filled in rows:
        print(f"| {size:,} | {what} | {timed['seconds']:.2f} | {timed['seconds'] / smallest[what]:.1f} | "
              f"{size / timed['seconds']:,.0f} | {mib(traced['traced_peak_bytes'])} | "
              f"{mib(timed['rss_peak_bytes'])} | {mib(filled['stored_bytes'])} |")  # fmt: skip


if __name__ == "__main__":
    main()
