"""Issue 45: a kernel that cannot compile is not compiled again and again. Its failure is stored under its key as a
negative entry (format "failed"), for this toolchain, living failure_ttl; a later pass that meets it fails at once
with the same message (known_failures), `--retry-failed` or the entry's age traces it again, and `inspect ls
--failed` lists it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers_graphs import mixed_graph, write_graph

from bridge.codegen import stored_trace_problem
from bridge.errors import BinaryFormatError, NkiCacheError
from bridge.failures import FAILED
from bridge.identity import toolchain_id
from bridge.port import StoredTrace
from cachestore.entry import EntryRejected, SignaturePolicy, decode_entry
from cachestore.settings import Settings
from cachestore.stores import open_backend

NKICACHE = str(Path(sys.executable).with_name("nkicache"))
MESSAGE = "contraction mismatch: lhsT [5, 3] vs rhs [6, 4]"


def failing_graph(name: str, rows: int = 64) -> dict:
    """A softmax that compiles, then a matmul whose contraction dimensions differ (5 against 6)."""
    return {
        "name": name,
        "target": "Trn2",
        "tensors": {
            "a": {"shape": [5, 3], "dtype": "float32"},
            "b": {"shape": [6, 4], "dtype": "float32"},
            "c": {"shape": [3, 4], "dtype": "float32"},
            "x": {"shape": [rows, 32], "dtype": "float32"},
            "y": {"shape": [rows, 32], "dtype": "float32"},
        },
        "ops": [
            {"type": "InternalNkiKernel", "func_name": "Softmax", "kernel_name": "softmax", "operands": ["x"],
             "results": ["y"], "attrs": {}},
            {"type": "InternalNkiKernel", "func_name": "Matmul", "kernel_name": "matmul_tiled", "operands": ["a", "b"],
             "results": ["c"], "attrs": {}},
        ],
    }  # fmt: skip


def compile_json(graphs: Path, tier: str, *extra: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run([NKICACHE, "compile", str(graphs), "--tier", tier, "--out", str(graphs.parent / "out"),
                           "--json", *extra], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})  # fmt: skip
    assert done.returncode == 1, done.stderr  # the graph fails, every time
    return json.loads(done.stdout)


def failures(tier: str) -> list[dict]:
    done = subprocess.run([NKICACHE, "inspect", "ls", "--failed", "--json", "--tier", tier], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def graphs(tmp_path: Path) -> Path:
    folder = tmp_path / "graphs"
    folder.mkdir()
    write_graph(folder, failing_graph("bad"))
    return folder


def test_a_failing_kernel_is_compiled_once_then_fails_at_once_with_the_same_message(
    graphs: Path, tmp_path: Path
) -> None:
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    first = compile_json(graphs, tier)
    [recorded] = failures(tier)
    second = compile_json(graphs, tier)
    assert first["failed"] == second["failed"] and MESSAGE in first["failed"][0]["error"]
    assert (first["known_failures"], second["known_failures"]) == (0, 1)
    assert second["traces"] == 0  # the softmax from the tier, the matmul not compiled again
    assert recorded["kernel_name"] == "matmul_tiled" and MESSAGE in recorded["failure"]
    assert [(row["key"], row["created"]) for row in failures(tier)] == [(recorded["key"], recorded["created"])]


def test_retry_failed_and_the_failure_ttl_compile_it_again(graphs: Path, tmp_path: Path) -> None:
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    compile_json(graphs, tier)
    [first] = failures(tier)
    retried = compile_json(graphs, tier, "--retry-failed")
    [second] = failures(tier)
    assert retried["known_failures"] == 0 and second["created"] > first["created"]  # compiled, failed, recorded
    time.sleep(1.2)
    expired = compile_json(graphs, tier, env={"NKICACHE_FAILURE_TTL": "1"})
    assert expired["known_failures"] == 0 and failures(tier)[0]["created"] > second["created"]


def test_a_parallel_compile_of_two_graphs_holding_it_compiles_it_once(graphs: Path, tmp_path: Path) -> None:
    write_graph(graphs, failing_graph("also-bad", rows=96))
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    done = compile_json(graphs, tier, "--workers", "2")
    assert len(done["failed"]) == 2 and len({failure["error"].partition(": ")[2] for failure in done["failed"]}) == 1
    assert done["known_failures"] == 1  # the second pass read the first one's failure
    [recorded] = failures(tier)
    assert recorded["kernel_name"] == "matmul_tiled"


def test_two_processes_at_once_through_redis_compile_it_once(
    graphs: Path, tmp_path: Path, redis_url: str, redis_client: Any
) -> None:
    namespace = f"failures-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "NKICACHE_NAMESPACE": namespace}
    argv = [NKICACHE, "compile", str(graphs), "--tier", redis_url, "--json", "--workers", "1"]
    try:
        runs = [subprocess.Popen([*argv, "--out", str(tmp_path / f"out{n}")], stdout=subprocess.PIPE, text=True,
                                 stderr=subprocess.PIPE, env=env) for n in range(2)]  # fmt: skip
        results = [json.loads(run.communicate(timeout=120)[0]) for run in runs]
        assert sorted(result["known_failures"] for result in results) == [0, 1]  # one compiled it, one waited
        assert results[0]["failed"] == results[1]["failed"]
    finally:
        for key in redis_client.scan_iter(match=f"{namespace}:*"):
            redis_client.delete(key)


def test_a_negative_entry_is_an_entry_signed_and_checked_like_any(graphs: Path, tmp_path: Path) -> None:
    """Under an HMAC key its header carries the HMAC (a forged one is rejected as any entry is); its message
    must be one printable line, else it is rejected and the kernel compiled again."""
    key_file = tmp_path / "hmac"
    key_file.write_bytes(os.urandom(32))
    env = {"NKICACHE_HMAC_KEY_FILE": str(key_file)}
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    compile_json(graphs, tier, env=env)
    backend = open_backend(Settings(tier=tier), reading=True)
    try:
        stored = [raw.data for raw in backend.scan_entries()]
    finally:
        backend.close()
    policy = SignaturePolicy(key_file.read_bytes(), True, False)
    [data] = [data for data in stored if decode_entry(data, policy).format == FAILED]
    entry = decode_entry(data, policy)
    assert entry.format == FAILED and entry.signed and MESSAGE in entry.binary.decode()
    with pytest.raises(EntryRejected):
        decode_entry(data, SignaturePolicy(os.urandom(32), True, False))


@pytest.mark.parametrize("message", [b"", b"two\nlines", b"\xff\xfe not UTF-8", b"x" * 5000])
def test_a_negative_entry_whose_message_is_not_one_line_of_text_is_refused(message: bytes) -> None:
    stored = StoredTrace({"binary": message, "input_names": [], "output_names": [], "format": FAILED}, 0.0,
                         {"kernel_name": "matmul_tiled"}, toolchain_id())  # fmt: skip
    assert stored_trace_problem("k" * 64, stored) == "a failure entry without a readable message"


def test_an_unknown_func_name_is_the_ops_failure_never_its_variants(tmp_path: Path) -> None:
    """The key names the kernel, not the func_name: an op naming no registered func_name but a kernel and shapes
    another graph compiles must not leave a negative entry under that variant's key (a pool's or a fleet's
    trace task resolves the op first, and only a trace's own failure is remembered)."""
    folder = tmp_path / "graphs"
    folder.mkdir()
    good = mixed_graph("good")
    broken = mixed_graph("broken")
    broken["ops"][0]["func_name"] = "FlashAttention"
    write_graph(folder, broken)
    write_graph(folder, good)
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    done = compile_json(folder, tier, "--workers", "2")
    assert [failure["file"] for failure in done["failed"]] == [str(folder / "broken.json")]
    assert "FlashAttention" in done["failed"][0]["error"] and failures(tier) == []


def out_of_memory_in_the_trace(self: object, inst: object, cache_key: str) -> dict:
    try:
        raise MemoryError
    except MemoryError as exc:  # what bridge.program makes of msgpack running out of memory under a job's limit
        raise BinaryFormatError(f"BIR binary is truncated or malformed: {type(exc).__name__}") from None


def test_a_failure_that_running_out_of_memory_caused_is_not_remembered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """F10's case: under a job's memory limit a trace fails with a project error whose cause is a MemoryError. That
    is the process's limit, not the variant's: no negative entry, and the next pass (with room) compiles it."""
    from bridge.codegen import BirCodeGenLoop
    from bridge.graph import load_graph
    from cachestore.stores import open_tier

    tier = open_tier(Settings(tier=f"local:{tmp_path / 'tier.sqlite'}"))
    graph = load_graph(failing_graph("bad") | {"ops": failing_graph("bad")["ops"][:1]})  # the softmax alone
    try:
        with monkeypatch.context() as patch:
            patch.setattr(BirCodeGenLoop, "_trace_kernel_beta3", out_of_memory_in_the_trace)
            with pytest.raises(NkiCacheError, match="MemoryError"):
                BirCodeGenLoop(tier=tier).run(graph)
        tier.flush()
        loop = BirCodeGenLoop(tier=tier)
        loop.run(graph)
        assert (loop.known_failures, loop.traces) == (0, 1)
    finally:
        tier.close()
