"""A pass that runs out of memory under a job's limit says so in one line, whichever allocation failed: a
MemoryError, or the thread the tier client starts to write behind, which CPython reports as a RuntimeError."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers_graphs import mixed_graph, write_graph

from cachestore.settings import load_settings
from cachestore.stores import open_tier
from workers.passes import compile_graph, out_of_memory

THREAD_UNDER_A_LIMIT = """
import resource, threading
vm = int([line for line in open('/proc/self/status') if line.startswith('VmSize')][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + 2 * 1024 * 1024, resource.RLIM_INFINITY))
try:
    threading.Thread(target=lambda: None).start()
except RuntimeError as exc:
    print(exc)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's size from /proc")
def test_a_thread_that_cannot_start_under_a_memory_limit_is_out_of_memory() -> None:
    """What CPython raises when RLIMIT_AS leaves no room for a thread's stack is what `out_of_memory` knows."""
    done = subprocess.run([sys.executable, "-c", THREAD_UNDER_A_LIMIT], capture_output=True, text=True, timeout=60)
    message = done.stdout.strip()
    assert message and out_of_memory(RuntimeError(message)), (done.stdout, done.stderr)
    assert not out_of_memory(RuntimeError("another runtime error"))


def test_a_pass_whose_tier_cannot_start_its_writer_thread_reports_out_of_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = open_tier(load_settings({"tier": f"local:{tmp_path / 'tier.sqlite'}"}))

    def no_room(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_room)
    result, artifact = compile_graph(write_graph(tmp_path, mixed_graph()), tier=tier)
    monkeypatch.undo()
    tier.close(timeout=5)
    assert artifact is None and result.error is not None
    assert "out of memory compiling the graph" in result.error and "internal error" not in result.error
