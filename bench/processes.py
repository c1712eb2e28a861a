"""Whole-process figures: what a user feels when a build system runs `nkicache` once per model.

Every command is run as a new process, the way sccache or ccache is run once per compile, and timed from
start to exit. Each figure is the median of ROUNDS runs after one untimed warm-up run, and each round runs
every command once in turn, the floors included, so that a moment of load on this shared machine moves a
figure and its floor together. A floor is a bare interpreter importing the third-party modules the command
needs and nothing of nkicache: the ratio to it is what nkicache itself adds.

The children run without PYTHONDONTWRITEBYTECODE: an installed package has its bytecode (pip compiles it),
and the warm-up run writes it for a source checkout.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bridge.errors import NkiCacheError

ROUNDS = 5
FLOOR_LOCAL = "import sqlite3, msgpack, zstandard, click"  # what a warm compile on the local tier needs
FLOOR_REDIS = "import redis, msgpack, zstandard, click"  # on Redis: redis-py (with hiredis) for sqlite3
TOOLCHAIN_ID_PROBE = (
    "import time\nfrom bridge.identity import toolchain_id\n"
    "started = time.perf_counter()\ntoolchain_id()\nprint((time.perf_counter() - started) * 1000)"
)


def nkicache_command() -> list[str]:
    """The `nkicache` console script beside this interpreter (what a user runs), else `python -m workers.cli`."""
    script = Path(sys.executable).with_name("nkicache")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "workers.cli"]


def child_environment(work: Path) -> dict[str, str]:
    """This environment without PYTHONDONTWRITEBYTECODE and without the user's nkicache settings (an empty
    config file, no NKICACHE_* variable): the figures are of the defaults and the flags given."""
    environment = {
        name: value
        for name, value in os.environ.items()
        if name != "PYTHONDONTWRITEBYTECODE" and not name.startswith("NKICACHE_")
    }
    config = work / "empty-config.toml"
    config.write_text("")
    environment["NKICACHE_CONFIG"] = str(config)
    return environment


def run_seconds(command: Sequence[str], environment: dict[str, str], cwd: Path) -> tuple[float, str]:
    """(wall seconds from start to exit, stdout) of one process; a failure is an error naming the command."""
    started = time.perf_counter()
    done = subprocess.run(list(command), env=environment, cwd=cwd, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise NkiCacheError(f"{' '.join(command[-6:])} exited {done.returncode}: {last}")
    return seconds, done.stdout


Line = Callable[[int], list[str]]  # the command line of a run, from the round's number (0: the warm-up)


class Commands:
    """Named commands, run in turn once a round; `environment(n)` adds variables to a command's run n."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.environment = child_environment(work)
        self.lines: dict[str, tuple[Line, Callable[[int], dict[str, str]]]] = {}
        self.samples: dict[str, list[float]] = {}
        self.outputs: dict[str, str] = {}

    def add(self, name: str, line: Line, environment: Callable[[int], dict[str, str]] = lambda _: {}) -> None:
        self.lines[name] = (line, environment)
        self.samples[name] = []

    def measure(self, rounds: int) -> dict[str, float]:
        """Medians in milliseconds; round 0 is the warm-up and is not kept. Each round starts one command later
        than the one before, so that no command always runs right after the same other one (what a command
        leaves running or cached, the next one measured pays or gains: up to 10% here)."""
        names = list(self.lines)
        for number in range(rounds + 1):
            for name in names[number % len(names) :] + names[: number % len(names)]:
                line, environment = self.lines[name]
                variables = {**self.environment, **environment(number)}
                seconds, self.outputs[name] = run_seconds(line(number), variables, self.work)
                if number > 0:
                    self.samples[name].append(seconds * 1000)
        return {name: round(statistics.median(samples), 1) for name, samples in self.samples.items()}


def redis_namespaces(namespace: str, rounds: int = ROUNDS) -> list[str]:
    """Every namespace `process_figures(..., namespace, rounds)` writes to (each cold compile has its own)."""
    return [namespace, *(f"{namespace}-cold-{n}" for n in range(rounds + 1))]


def process_figures(graph: Path, redis_url: str, namespace: str, work: Path, rounds: int = ROUNDS) -> dict[str, Any]:
    """Every whole-process figure of one graph's compile, on the local tier and on Redis (under the namespaces
    `redis_namespaces(namespace, rounds)`), with their floors."""
    work.mkdir(parents=True, exist_ok=True)
    nkicache, python = nkicache_command(), [sys.executable]
    warm_local = f"local:{work / 'warm.sqlite'}"

    def compile_line(tier: str, out: str, *extra: str) -> Line:
        return lambda _: [*nkicache, "compile", str(graph), "--tier", tier, "--out", str(work / out), "--json", *extra]

    commands = Commands(work)
    commands.add("python_ms", lambda _: [*python, "-c", "pass"])
    commands.add("floor_local_ms", lambda _: [*python, "-c", FLOOR_LOCAL])
    commands.add("floor_redis_ms", lambda _: [*python, "-c", FLOOR_REDIS])
    commands.add("version_ms", lambda _: [*nkicache, "--version"])
    commands.add("help_ms", lambda _: [*nkicache, "--help"])
    commands.add("exec_python_ms", lambda _: [*nkicache, "exec", "--tier", warm_local, "--", *python, "-c", "pass"])
    commands.add("toolchain_id_process_ms", lambda _: [*python, "-c", TOOLCHAIN_ID_PROBE])
    commands.add("cold_compile_local_ms", lambda n: compile_line(f"local:{work / f'cold-{n}.sqlite'}", "cold")(n))
    commands.add("warm_compile_local_ms", compile_line(warm_local, "warm"))
    commands.add("warm_compile_local_workers2_ms", compile_line(warm_local, "warm2", "--workers", "2"))
    commands.add("report_local_ms", lambda _: [*nkicache, "report", "--tier", warm_local])
    commands.add(
        "cold_compile_redis_ms",
        compile_line(redis_url, "cold-redis"),
        lambda n: {"NKICACHE_NAMESPACE": f"{namespace}-cold-{n}"},
    )
    commands.add(
        "warm_compile_redis_ms", compile_line(redis_url, "warm-redis"), lambda _: {"NKICACHE_NAMESPACE": namespace}
    )
    figures: dict[str, Any] = commands.measure(rounds)
    # The probe prints the call's own milliseconds (the process around it is toolchain_id_process).
    figures["toolchain_id_ms"] = round(float(commands.outputs["toolchain_id_process_ms"].strip()), 2)
    warm_local_run = json.loads(commands.outputs["warm_compile_local_ms"])
    warm_redis_run = json.loads(commands.outputs["warm_compile_redis_ms"])
    if warm_local_run["traces"] or warm_redis_run["traces"]:
        raise NkiCacheError(
            f"a warm compile traced (local {warm_local_run['traces']}, Redis {warm_redis_run['traces']})"
        )
    figures["warm_compile_local_vs_floor"] = round(figures["warm_compile_local_ms"] / figures["floor_local_ms"], 3)
    figures["warm_compile_redis_vs_floor"] = round(figures["warm_compile_redis_ms"] / figures["floor_redis_ms"], 3)
    figures["version_goal_ms"] = round(3 * figures["python_ms"] + 60, 1)  # 3 x a bare interpreter + 60 ms
    figures["version_vs_goal"] = round(figures["version_ms"] / figures["version_goal_ms"], 3)
    # What `nkicache exec` adds to a Python command that creates no loop, beside that command in the same rounds.
    figures["exec_startup_overhead_ms"] = round(figures["exec_python_ms"] - figures["python_ms"], 1)
    figures.update(graph=graph.name, kernels=warm_local_run["kernels"], rounds=rounds)
    return figures
