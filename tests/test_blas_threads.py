"""The commands that trace run numpy's BLAS on one thread a process (workers.blas); others, and `exec`'s
command above all, keep the environment they were given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers.blas import ONE_BLAS_THREAD

GRAPH = Path(__file__).parent / "data" / "graphs" / "attention_tiles.json"  # its kernels multiply tiles
# Compiles GRAPH through the CLI in this very process, then prints the process's threads and BLAS variables.
COMPILE_THEN_LOOK = """
import json, os, sys
from workers.cli import main
try:
    main(["compile", sys.argv[1], "--workers", "1", "--tier", "off", "--out", sys.argv[2]])
except SystemExit as exc:
    assert not exc.code, exc.code
import numpy
print(json.dumps({"threads": len(os.listdir("/proc/self/task")),
                  "env": {name: os.environ.get(name) for name in sys.argv[3:]}}))
"""


def environment_without_blas_settings(**extra: str) -> dict[str, str]:
    environment = {name: value for name, value in os.environ.items() if name not in ONE_BLAS_THREAD}
    return environment | extra


def compile_and_look(tmp_path: Path, environment: dict[str, str]) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_THEN_LOOK, str(GRAPH), str(tmp_path / "out"), *ONE_BLAS_THREAD],
        env=environment, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2, reason="counts Linux threads")
def test_a_compile_traces_with_one_blas_thread(tmp_path):
    looked = compile_and_look(tmp_path, environment_without_blas_settings())
    assert looked["env"] == ONE_BLAS_THREAD
    # OpenBLAS starts a thread per further core as it loads; with one thread it starts none, and a compile with
    # --tier off --workers 1 starts no thread of its own.
    assert looked["threads"] == 1


@pytest.mark.parametrize("name", list(ONE_BLAS_THREAD))
def test_a_thread_count_the_user_set_leaves_every_variable_as_it_is(tmp_path, name):
    looked = compile_and_look(tmp_path, environment_without_blas_settings(**{name: "2"}))
    assert looked["env"] == dict.fromkeys(ONE_BLAS_THREAD) | {name: "2"}


def test_exec_hands_its_command_the_environment_unchanged():
    show = "import json, os, sys; print(json.dumps({name: os.environ.get(name) for name in sys.argv[1:]}))"
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "exec", "--tier", "off", "--", sys.executable, "-c", show,
         *ONE_BLAS_THREAD],
        env=environment_without_blas_settings(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == dict.fromkeys(ONE_BLAS_THREAD)
