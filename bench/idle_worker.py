"""What an idle fleet worker costs Redis, by the number of job shards (issue 18): one `nkicache worker` with no
job to do on a private redis-server, its commands counted by INFO commandstats over a window.

A benchmark, not a test. Prints one JSON object: for each job_shards value, the commands per second and their
split by command.

    python bench/idle_worker.py                 # job_shards 1 and 16, 10 s each
    python bench/idle_worker.py --shards 1 4 16 64 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: the bench package

import redis

from bench.dev_redis import start_private_server

NKICACHE = str(Path(sys.executable).with_name("nkicache"))
WARMUP = 4.0  # seconds for the worker to start and settle before the count starts


def commands_per_second(url: str, shards: int, seconds: float) -> dict[str, object]:
    client = redis.Redis.from_url(url)
    env = {**os.environ, "NKICACHE_NAMESPACE": f"idle{uuid.uuid4().hex[:8]}", "NKICACHE_TIER": url,
           "NKICACHE_JOB_SHARDS": str(shards)}  # fmt: skip
    worker = subprocess.Popen([NKICACHE, "worker", "--name", "idle"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        time.sleep(WARMUP)
        client.config_resetstat()
        time.sleep(seconds)
        stats = client.info("commandstats")
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        client.close()
    # This script's own CONFIG RESETSTAT and INFO are not the worker's.
    calls = {name.removeprefix("cmdstat_"): row["calls"] for name, row in stats.items()}
    calls = {name: n for name, n in calls.items() if name not in ("config|resetstat", "info")}
    return {"per_second": round(sum(calls.values()) / seconds, 1),
            "by_command": {name: round(n / seconds, 2) for name, n in sorted(calls.items())}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    server = start_private_server()
    try:
        report = {str(shards): commands_per_second(server.url, shards, args.seconds) for shards in args.shards}
    finally:
        server.stop()
    print(json.dumps({"seconds": args.seconds, "job_shards": report}))


if __name__ == "__main__":
    main()
