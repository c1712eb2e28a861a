"""The embedded tier under the processes of one machine: several compiles at once against one SQLite file
never time out on its lock, never turn the tier off, and leave every variant for the next round."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from helpers_graphs import (
    MIXED_DISTINCT_KEYS,
    compile_process_result,
    mixed_graph,
    slow_graph,
    start_compile_process,
    stored_entries,
    write_graph,
)

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from cachestore.backends.sqlite import SqliteBackend
from cachestore.settings import Settings
from cachestore.stores import open_tier

PROCESSES = 4


def graphs(tmp_path: Path) -> list[Path]:
    """Four graphs sharing some variants (the softmax and rmsnorm shapes) and each with some of its own."""
    folder = tmp_path / "graphs"
    folder.mkdir()
    made = [write_graph(folder, mixed_graph(f"mixed-{rows}", rows=rows)) for rows in (64, 96, 128)]
    return [*made, write_graph(folder, slow_graph("slow", variants=6, base_rows=512))]


def run_round(tmp_path: Path, name: str, paths: list[Path], tier: str) -> list[dict]:
    barrier = tmp_path / f"barrier-{name}"
    barrier.mkdir()
    processes = [
        start_compile_process(
            tmp_path, path, {"tier": tier, "worker": f"p{i}", "single_flight": True}, (barrier, str(i), PROCESSES)
        )
        for i, path in enumerate(paths)
    ]
    return [compile_process_result(process, timeout=120) for process in processes]


def test_four_processes_share_one_sqlite_tier_without_timeouts(tmp_path: Path) -> None:
    tier = f"local:{tmp_path / 'fresh' / 'tier.sqlite'}"  # not created yet: the four race to create it too
    paths = graphs(tmp_path)
    first = run_round(tmp_path, "first", paths, tier)
    second = run_round(tmp_path, "second", paths, tier)
    for result in first + second:
        summary = result["summary"]
        assert (summary["tier_timeouts"], summary["tier_errors"], summary["tier_dropped"]) == (0, 0, 0), summary
        assert result["stats"]["tier_skipped"] == 0, result["stats"]  # the breaker never opened
    for result in second:
        summary = result["summary"]
        assert summary["traces"] == 0 and summary["remote_hits"] == summary["cache_misses"] > 0, summary
    assert max(r["started"] for r in first) < min(r["finished"] for r in first)  # they did run at once


@contextlib.contextmanager
def lock_held(path: Path, seconds: float) -> Iterator[dict[str, float]]:
    """Another process's writer: SQLite's write lock on `path`, taken now and released after `seconds`; the
    dict yielded gets the monotonic time of the release ("released")."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("BEGIN IMMEDIATE")
    times: dict[str, float] = {}

    def release() -> None:
        db.execute("COMMIT")
        times["released"] = time.monotonic()

    releaser = threading.Timer(seconds, release)
    releaser.start()
    try:
        yield times
    finally:
        releaser.join()
        db.close()


def test_a_held_lock_delays_background_writes_without_counting_or_turning_the_tier_off(tmp_path: Path) -> None:
    path = tmp_path / "tier.sqlite"
    settings = Settings(tier=f"local:{path}", op_timeout=0.2, final_flush_timeout=5.0, single_flight=False)
    client = open_tier(settings)
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph()))
    assert client.flush(timeout=5)  # the file made and the first pass stored before the lock is taken
    with lock_held(path, 1.0):
        second = BirCodeGenLoop(tier=client)
        second.run(load_graph(mixed_graph(rows=96)))  # new Matmul variants: written while the lock is held
    assert client.flush(timeout=5)
    stats = client.stats.snapshot()
    client.close(timeout=5)
    assert (stats["tier_timeouts"], stats["tier_errors"], stats["tier_skipped"], stats["tier_dropped"]) == (0, 0, 0, 0)
    assert second.traces == 2 and len(stored_entries(SqliteBackend(path, create=False))) == MIXED_DISTINCT_KEYS + 2


def test_a_lease_behind_a_held_lock_waits_no_longer_than_a_read_and_leaves_the_tier_on(tmp_path: Path) -> None:
    path = tmp_path / "tier.sqlite"
    client = open_tier(Settings(tier=f"local:{path}", op_timeout=0.2, final_flush_timeout=5.0))
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph()))
    assert client.flush(timeout=5)  # the first pass stored before the lock is taken
    with lock_held(path, 1.5) as lock:
        started = time.monotonic()
        loop = BirCodeGenLoop(tier=client)
        ops_done: list[float] = []
        teardown = loop.afterStmtTransform
        loop.afterStmtTransform = lambda: (ops_done.append(time.monotonic()), teardown())  # every op lowered
        loop.run(load_graph(mixed_graph(rows=96)))  # two leases to take, each given up after op_timeout
        returned = time.monotonic()
        stats = client.stats.snapshot()
    # The ops did not wait for the lock to be released, nor did the pass's end: its traced entries wait for the
    # lock on the flusher thread, not on the compiling one.
    assert ops_done[0] - started < 1.0, ops_done[0] - started
    assert returned < lock["released"], (returned - started, lock["released"] - started)
    assert stats["tier_timeouts"] == 2 and stats["tier_skipped"] == 0  # counted, and the tier was never off
    assert loop.traces == 2 and loop.remote_hits == MIXED_DISTINCT_KEYS - 2
    assert client.flush(timeout=5)  # once the lock is free the traced entries land
    client.close(timeout=5)
    assert len(stored_entries(SqliteBackend(path, create=False))) == MIXED_DISTINCT_KEYS + 2
