"""`tier_dropped` in `nkicache compile --json` counts every write that did not reach the tier: with the tier
down, the entries, lease releases and metrics batches still queued when the processes' tier clients close
after the last pass, in the command's own process (--workers 1) as in a pool's (--workers 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers_graphs import mixed_graph, write_graph

from bench.dev_redis import RedisServer

NKICACHE = str(Path(sys.executable).with_name("nkicache"))


@pytest.mark.parametrize("workers", ["1", "2"])
def test_compile_counts_the_writes_a_down_tier_never_got(
    private_redis_server: Callable[[], RedisServer], tmp_path: Path, workers: str
) -> None:
    server = private_redis_server()
    server.stop()  # down before the compile: every write is queued, none is delivered
    graphs = [write_graph(tmp_path, mixed_graph(f"mixed-{rows}", rows=rows)) for rows in (64, 96, 128)]
    done = subprocess.run([NKICACHE, "compile", *graphs, "--tier", server.url, "--workers", workers, "--json",
                           "--out", tmp_path / "out"], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["compiled"] == 3 and summary["tier_errors"] >= 1
    # No tier: every distinct kernel of every pass is traced, by the pass or by a trace task for it (2 workers).
    traced = summary["traces"]
    assert traced == 3 * 6
    # Each trace queued its entry (and no lease release: the tier granted none, and could not say who held one);
    # each pass queued its metrics batch. None of them reached the tier.
    queued = traced + summary["passes"]
    assert summary["tier_dropped"] == queued, summary
