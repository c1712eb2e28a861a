"""Bounds on one graph's work (issue 14): each limit, exceeded, is one line naming the graph file, the op and
the limit, through `nkicache compile` in a process of its own, while the other graphs of the call compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_graphs import softmax_graph

NKICACHE = str(Path(sys.executable).with_name("nkicache"))


def compile_json(tmp_path: Path, *paths: Path, **settings: object) -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, **{f"NKICACHE_{k.upper()}": str(v) for k, v in settings.items()}}
    done = subprocess.run([NKICACHE, "compile", *map(str, paths), "--tier", "off", "--out", str(tmp_path / "out"),
                           "--workers", "1", "--json"], capture_output=True, text=True, env=env, timeout=120,
                          stdin=subprocess.DEVNULL)  # fmt: skip
    return done, json.loads(done.stdout)


@pytest.mark.parametrize(
    ("settings", "rows", "expected"),
    [
        # 10^9 elements: traced, this took 78 s and 2.5 GB; refused before any kernel is traced.
        ({}, 1_000_000, "op 0 (Softmax): tensor 'x' has 1000000000 elements, more than the limit "
                        "max_tensor_elements = 134217728"),
        ({"max_graph_elements": 300_000}, 200, "op 0 (Softmax): the graph's tensors reach 400000 elements here, "
                                               "more than the limit max_graph_elements = 300000"),
        ({"max_kernel_instructions": 50}, 2000, "op 0 (Softmax): kernel 'softmax' emits more than 50 instructions, "
                                               "the limit max_kernel_instructions"),
        ({"max_graph_bytes": 100}, 200, "graph file of"),
    ],
)  # fmt: skip
def test_a_graph_over_a_limit_fails_alone_with_one_line_naming_it(tmp_path: Path, settings, rows, expected) -> None:
    over = softmax_graph(tmp_path, "over", rows)
    good = softmax_graph(tmp_path, "good", 20, 10)  # small enough for every limit above (but max_graph_bytes)
    done, summary = compile_json(tmp_path, over, good, **settings)
    assert "Traceback" not in done.stderr and done.returncode == 1, done.stderr
    [failed] = [f for f in summary["failed"] if f["file"] == str(over)]
    assert failed["error"].startswith(f"{over}: ") and expected in failed["error"], failed
    assert f"nkicache: error: {failed['error']}" in done.stderr.splitlines()
    if "max_graph_bytes" not in settings:
        assert summary["compiled"] == 1 and summary["artifacts"] == [str(tmp_path / "out" / "good.nkibb")]


def test_the_default_limits_let_the_workload_compile(tmp_path: Path) -> None:
    from workers.workload import generate_workload

    paths = generate_workload(tmp_path / "graphs", 3, seed=1)
    done, summary = compile_json(tmp_path, *paths)
    assert done.returncode == 0 and summary["compiled"] == 3, done.stderr


def test_run_refuses_an_artifact_that_would_not_fit_in_memory(tmp_path: Path) -> None:
    """Under a 1 GiB address-space limit: a graph of 2 x 10^8 float32 elements (1.2 GB to run) is refused with
    one line, and no MemoryError traceback; a small artifact of the same call runs."""
    import resource

    big = softmax_graph(tmp_path, "big", 100_000)
    small = softmax_graph(tmp_path, "small", 20, 10)
    done, summary = compile_json(tmp_path, big, small)
    assert done.returncode == 0 and summary["compiled"] == 2, done.stderr

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1024**3, 1024**3))

    ran = subprocess.run([NKICACHE, "run", str(tmp_path / "out"), "--json"], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL, preexec_fn=limit_memory)  # fmt: skip
    assert ran.returncode == 1 and "Traceback" not in ran.stderr, ran.stderr
    report = json.loads(ran.stdout)
    [failed] = report["failed"]
    assert failed["file"] == str(tmp_path / "out" / "big.nkibb")
    assert "running graph 'big' needs about 1.3 GiB, more than the" in failed["error"], failed
    assert failed["error"].endswith("GiB of memory available; not run")
    assert [a["graph"] for a in report["artifacts"]] == ["small"]
    assert ran.stderr.splitlines() == [f"nkicache: error: {failed['error']}"]
