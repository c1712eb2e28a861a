"""Issue 35 item 8: inputs are read with a bound and never block. A device (/dev/zero, which never ends) or a
FIFO (which blocks until someone writes) given as a graph or an artifact is refused in one line naming it,
at once; `warm` applies the limits a compile applies (max_tensor_elements and the others)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers_graphs import mixed_graph, write_graph

from bridge.identity import toolchain_id
from cachestore.api import WriteItem
from cachestore.keys import partition
from cachestore.settings import Settings
from cachestore.stores import open_backend
from workers.cli import main

NKICACHE = str(Path(sys.executable).with_name("nkicache"))


def nkicache(*args: object) -> tuple[subprocess.CompletedProcess, float]:
    """The command in a process of its own (a blocking read would hang it, not the test: timeout), and the
    seconds it took."""
    started = time.monotonic()
    done = subprocess.run([NKICACHE, *map(str, args)], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    return done, time.monotonic() - started


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo.json"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_compile_refuses_a_device_or_a_fifo_in_one_line_at_once(special: str, fifo: Path, tmp_path: Path) -> None:
    path = fifo if special == "fifo" else Path(special)
    done, seconds = nkicache("compile", path, "--tier", "off", "--out", tmp_path / "out")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr  # a bad graph: its pass failed
    kind = "a FIFO" if special == "fifo" else "a character device"
    assert done.stderr.splitlines() == [f"nkicache: error: {path}: graph file is {kind}, not a regular file; refused"]
    # The process's own start-up is most of it; reading /dev/zero to its end, or a FIFO, never returns.
    assert seconds < 5, seconds


def test_submit_and_run_refuse_a_fifo(fifo: Path, tmp_path: Path) -> None:
    submitted, _ = nkicache("submit", fifo, "--tier", "redis://127.0.0.1:1/0")  # refused before Redis is asked
    assert submitted.returncode == 2 and submitted.stderr.splitlines() == [
        f"nkicache: error: {fifo}: graph file is a FIFO, not a regular file; refused"
    ], submitted.stderr
    artifact = tmp_path / "a.nkibb"
    os.mkfifo(artifact)
    ran, _ = nkicache("run", artifact)
    assert ran.returncode != 0 and "Traceback" not in ran.stderr
    assert f"{artifact}: artifact is a FIFO, not a regular file; refused" in ran.stderr + ran.stdout


def test_warm_applies_the_limits_a_compile_applies(tmp_path: Path) -> None:
    """An old toolchain's variants whose tensors are over max_tensor_elements: a compile of their graph fails
    on the limit, and so does each of them in `warm` (nothing traced, exit 1)."""
    filled = f"local:{tmp_path / 'filled.sqlite'}"
    graph = write_graph(tmp_path, mixed_graph("warm-limits"))
    compiled = CliRunner().invoke(main, ["compile", str(graph), "--tier", filled, "--out", str(tmp_path / "o"),
                                         "--workers", "1"])  # fmt: skip
    assert compiled.exit_code == 0, compiled.output
    # The same variants as another toolchain's entries, in a tier this compiler holds none of.
    old, tier = "0123456789abcdef", f"local:{tmp_path / 'tier.sqlite'}"
    reader = open_backend(Settings(tier=filled), reading=True, partition=partition(toolchain_id()))
    writer = open_backend(Settings(tier=tier), partition=partition(old))
    try:
        entries = list(reader.scan_entries(with_ttl=False))
        writer.put_entries([WriteItem(raw.cache_key, raw.data, None, 3600) for raw in entries])
    finally:
        reader.close()
        writer.close()
    env = {"NKICACHE_MAX_TENSOR_ELEMENTS": "100"}  # the mixed graph's tensors have 2048 elements and more
    refused = CliRunner().invoke(main, ["compile", str(graph), "--tier", "off", "--out", str(tmp_path / "r")], env=env)
    assert refused.exit_code == 1 and "max_tensor_elements = 100" in refused.stderr
    warmed = CliRunner().invoke(main, ["warm", "--tier", tier, "--from", old, "--workers", "1", "--json"], env=env)
    assert warmed.exit_code == 1, warmed.output
    report = json.loads(warmed.stdout)
    assert report["traced"] == 0 and len(report["failed"]) == report["considered"] == len(entries) > 0
    assert all("more than the limit max_tensor_elements = 100" in item["reason"] for item in report["failed"])
