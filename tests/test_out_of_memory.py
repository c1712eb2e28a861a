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


def test_a_project_error_that_running_out_of_memory_caused_is_out_of_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F10: a MemoryError that surfaced as one of the project's errors (a binary read under the job's limit) is
    still the job's memory limit: the pass says so, and the fleet's compiling process exits on that line."""
    from bridge.codegen import BirCodeGenLoop
    from bridge.errors import BinaryFormatError

    def fail(self: object, graph: object) -> None:
        try:
            raise MemoryError
        except MemoryError as exc:
            raise BinaryFormatError("BIR binary is truncated or malformed") from exc

    monkeypatch.setattr(BirCodeGenLoop, "run", fail)
    result, artifact = compile_graph(write_graph(tmp_path, mixed_graph()))
    assert artifact is None and result.error is not None
    assert "out of memory compiling the graph (a job's limit is the job_memory setting)" in result.error


def test_a_binary_read_that_runs_out_of_memory_is_not_a_malformed_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    import bridge.program

    def no_room(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(bridge.program.msgpack, "unpackb", no_room)
    with pytest.raises(MemoryError):
        bridge.program.unpack_limited(b"\x80", "BIR")
