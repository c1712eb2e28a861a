"""broken_tier_overhead: a compile whose Redis is down, frozen or trickling, against the same compile with no tier.

A tier that fails must cost no more than no tier: the variants it cannot serve are traced as a `--tier off`
compile traces them, in parallel with `--workers 2`. Each compile is a whole `nkicache compile` process of the
workload, run in rounds that alternate the four tiers (bench.processes), so the machine's load moves
them together: off; a loopback port nobody listens on (down); a redis-server stopped with SIGSTOP (frozen: it
accepts connections and never answers); a redis-server behind a proxy that passes its answers on a few bytes
at a time (trickling: bench/trickle_proxy.py, 160 bytes a second, so an entry takes longer than op_timeout).
Two more start each run on an empty redis-server that fails once the compile stored FAULT_AFTER_ENTRIES
entries, after its parallel plan was made: stopped with SIGSTOP (frozen mid-compile) or killed (mid-compile).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bench.dev_redis import RedisServer, start_private_server
from bench.processes import Commands, nkicache_command
from bench.trickle_proxy import TrickleProxy
from bridge.errors import NkiCacheError
from bridge.limits import Limits
from bridge.parallel import key_variants

# Rounds of the four compiles alternated. The figure is the worst of three medians, which noise biases upwards:
# on this 2-core VM a --tier off compile's wall time spreads by 30% between rounds, so fewer than 9 rounds are
# not enough to tell 1.06 from 1.2 (measured).
ROUNDS = 9
FAULT_AFTER_ENTRIES = 20


class MidCompileFault:
    """Each run's own empty redis-server, stopped with `signal_number` (SIGSTOP: frozen; SIGKILL: gone) as soon
    as the compile stored `after` entries. The server tells the watcher of each SET (keyspace notifications), so
    the fault comes at the entry itself and watching costs the machine nothing while the compile runs: a watcher
    that polled every 2 ms took 6% of a core from the compile it measured, which no `--tier off` run pays."""

    def __init__(self, signal_number: int, after: int = FAULT_AFTER_ENTRIES):
        self.signal_number, self.after = signal_number, after
        self.server: RedisServer | None = None
        self.watcher: threading.Thread | None = None
        self.faults = 0  # runs whose server the watcher failed

    def url(self) -> str:
        """A fresh server's URL for the next run (the last run's server is gone), its watcher subscribed before
        the URL is handed out."""
        self.close()
        self.server = start_private_server()
        # No retry: once the server is killed at a run's end, the watcher's read fails at once and it returns.
        client = redis.Redis(port=self.server.port, socket_timeout=None, retry=Retry(NoBackoff(), 0))
        client.config_set("notify-keyspace-events", "E$")  # keyevent messages for string commands: SET
        events = client.pubsub(ignore_subscribe_messages=True)
        events.subscribe("__keyevent@0__:set")
        self.watcher = threading.Thread(target=self._watch, args=(self.server, client, events), daemon=True)
        self.watcher.start()
        return self.server.url

    def _watch(self, server: RedisServer, client: redis.Redis, events: Any) -> None:
        stored: set[bytes] = set()
        try:
            for message in events.listen():
                if b":entry:" in message["data"]:
                    stored.add(message["data"])
                if len(stored) >= self.after:
                    break
        except (redis.RedisError, OSError, ValueError):
            return  # closed under the watcher: the run ended first
        finally:
            events.close()
            client.close()
        if server.running:
            server.process.send_signal(self.signal_number)
            self.faults += 1

    def close(self) -> None:
        if self.server is None:
            return
        if self.server.running:
            self.server.process.send_signal(signal.SIGCONT)  # a stopped server cannot take SIGTERM
        self.server.kill()
        self.watcher.join()
        self.server.cleanup()
        self.server = None


def closed_port() -> int:
    """A loopback port with no listener (bound and released: nothing else listens on it at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fault_point(graphs: Path) -> int:
    """FAULT_AFTER_ENTRIES, or half the workload's variants for a workload too small to store that many."""
    paths = sorted(str(path) for path in graphs.glob("*.json"))
    plan = key_variants(paths, shared=True, target_name=None, limits=Limits())
    return max(1, min(FAULT_AFTER_ENTRIES, len(plan.tasks) // 2))


def broken_tier_overhead(graphs: Path, work: Path, rounds: int = ROUNDS) -> dict[str, Any]:
    """Median seconds of `compile --workers 2` of `graphs` on each tier; the worst tier failing from the start
    over off (broken_tier_overhead), and the worse of the two failing mid-compile over off."""
    work.mkdir(parents=True, exist_ok=True)
    fault_after = fault_point(graphs)
    frozen = start_private_server()
    slow = start_private_server()
    trickle = TrickleProxy(("127.0.0.1", slow.port), chunk=8, interval=0.05, slow=True)  # 160 bytes a second
    mid = {
        "frozen_mid": MidCompileFault(signal.SIGSTOP, fault_after),
        "killed_mid": MidCompileFault(signal.SIGKILL, fault_after),
    }
    try:
        frozen.process.send_signal(signal.SIGSTOP)
        down = f"redis://127.0.0.1:{closed_port()}/0"
        tiers = {
            "off": lambda: "off",
            "down": lambda: down,
            "frozen": lambda: frozen.url,
            "trickling": lambda: trickle.url,
        }
        tiers |= {name: fault.url for name, fault in mid.items()}
        commands = Commands(work)
        for name, tier in tiers.items():
            out = str(work / name)
            line = [*nkicache_command(), "compile", str(graphs), "--workers", "2", "--out", out, "--json"]
            commands.add(f"{name}_ms", lambda _, line=line, tier=tier: [*line, "--tier", tier()])
        figures: dict[str, Any] = commands.measure(rounds)
    finally:
        frozen.process.send_signal(signal.SIGCONT)
        frozen.cleanup()
        trickle.close()
        slow.cleanup()
        for fault in mid.values():
            fault.close()
    missed = [name for name, fault in mid.items() if fault.faults < rounds + 1]
    if missed:
        raise NkiCacheError(
            f"broken_tier_overhead: a compile on {', '.join(missed)} ended before it stored "
            f"{fault_after} entries (the fault never came)"
        )
    runs = {name: json.loads(commands.outputs[f"{name}_ms"]) for name in tiers}
    artifacts = {name: {Path(p).name: Path(p).read_bytes() for p in run["artifacts"]} for name, run in runs.items()}
    differ = [name for name in tiers if runs[name]["failed"] or artifacts[name] != artifacts["off"]]
    if differ:
        raise NkiCacheError(
            f"broken_tier_overhead: the compiles on {', '.join(differ)} did not give tier off's artifacts"
        )
    at_start = max(figures[f"{name}_ms"] for name in ("down", "frozen", "trickling"))
    figures["broken_tier_overhead"] = round(at_start / figures["off_ms"], 3)
    figures["mid_compile_fault_overhead"] = round(max(figures[f"{name}_ms"] for name in mid) / figures["off_ms"], 3)
    figures["traces"] = {name: run["traces"] for name, run in runs.items()}
    figures["rounds"], figures["fault_after_entries"] = rounds, fault_after
    return figures
