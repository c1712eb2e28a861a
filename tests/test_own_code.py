"""Issue 44: every process that traces runs the command's own code, whatever the current directory holds.

Each case runs the installed `nkicache` from a folder that holds another copy of the project whose softmax is
changed (an older checkout), or packages named bridge, workers and cachestore that raise on import (a user's
own), and checks that the artifacts equal this compiler's own `--tier off` output and that the tier holds no
binary under this compiler's toolchain that it would not make.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers_graphs import write_graph

from bridge.codegen import kernel_cache_key
from bridge.graph import load_graph
from bridge.port import TracedVariant
from bridge.targets import make_target
from cachestore.settings import Settings
from cachestore.stores import open_tier
from workers.cli import main as nkicache
from workers.passes import compile_graph

ROOT = Path(__file__).resolve().parent.parent
NKICACHE = str(Path(sys.executable).with_name("nkicache"))
PACKAGES = ("bridge", "workers", "cachestore")
SOFTMAX_MATHS = "e = nl.exp(shifted)"


def softmaxes(name: str, rows: tuple[int, ...]) -> dict:
    """A graph of distinct softmax variants: each one a trace of tens of milliseconds, and a pool task with
    --workers 2."""
    tensors, ops = {}, []
    for n in rows:
        tensors[f"x{n}"] = {"shape": [n, 256], "dtype": "float32"}
        tensors[f"y{n}"] = {"shape": [n, 256], "dtype": "float32"}
        ops.append({"type": "InternalNkiKernel", "func_name": "Softmax", "kernel_name": "softmax",
                    "operands": [f"x{n}"], "results": [f"y{n}"], "attrs": {}})  # fmt: skip
    return {"name": name, "target": "Trn2", "tensors": tensors, "ops": ops}


@pytest.fixture(scope="module")
def older_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project's packages whose softmax computes exp(2 (x - max)): another compiler."""
    folder = tmp_path_factory.mktemp("older-checkout")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, folder / package, ignore=shutil.ignore_patterns("__pycache__"))
    kernel = folder / "bridge" / "kernels" / "softmax.py"
    source = kernel.read_text()
    assert SOFTMAX_MATHS in source
    kernel.write_text(source.replace(SOFTMAX_MATHS, "e = nl.exp(shifted * 2.0)"))
    return folder


@pytest.fixture(scope="module")
def hostile_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's project with top-level bridge, workers and cachestore packages that raise on import."""
    folder = tmp_path_factory.mktemp("users-project")
    for package in PACKAGES:
        (folder / package).mkdir()
        (folder / package / "__init__.py").write_text(f"raise RuntimeError('the user\\'s own {package}')\n")
    return folder


@pytest.fixture
def graphs(tmp_path: Path) -> Path:
    folder = tmp_path / "graphs"
    folder.mkdir()
    write_graph(folder, softmaxes("g1", rows=(1024, 1152, 1280, 1408, 1536)))
    write_graph(folder, softmaxes("g2", rows=(1024, 1664, 1792, 1920, 2048)))
    return folder


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def run(cwd: Path, *args: object, env: dict[str, str] | None = None, command: list[str] | None = None) -> Any:
    done = subprocess.run([*(command or [NKICACHE]), *map(str, args)], cwd=cwd, env=env or environment(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout) if "--json" in args else done


def artifacts(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("*.nkibb"))}


def own_output(graphs: Path, out: Path) -> dict[str, bytes]:
    """This compiler's artifacts, with no tier, from the project's own folder."""
    run(ROOT, "compile", graphs, "--tier", "off", "--workers", 1, "--out", out)
    return artifacts(out)


@pytest.mark.parametrize("cwd", ["older_checkout", "hostile_folder"])
def test_warm_with_a_pool_from_another_checkout_stores_this_compilers_binaries(
    cwd: str, graphs: Path, tmp_path: Path, older_checkout: Path, request: pytest.FixtureRequest
) -> None:
    """The issue's sequence: the older compiler stores its softmaxes, this one warms from them with --workers 2
    (a forkserver pool) while the current directory holds the older code, then compiles with no trace."""
    folder = request.getfixturevalue(cwd)
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    old = run(older_checkout, "compile", graphs, "--tier", tier, "--out", tmp_path / "old", "--json",
              command=[sys.executable, "-m", "workers.cli"])  # fmt: skip
    assert old["traces"] > 0
    warmed = run(folder, "warm", "--tier", tier, "--workers", 2, "--json")
    assert warmed["traced"] == old["traces"] and warmed["refused"] == 0 and warmed["failed"] == []
    new = run(folder, "compile", graphs, "--tier", tier, "--out", tmp_path / "new", "--json")
    assert new["traces"] == 0 and new["remote_hits"] > 0
    assert artifacts(tmp_path / "new") == own_output(graphs, tmp_path / "off") != artifacts(tmp_path / "old")


# A program that runs `nkicache` in a process where another thread already runs (a tier client's flusher, a
# caller's own threads): `compile --workers N` then starts its helpers from the forkserver, not by fork.
# The forkserver is started (and has imported the compiler) before the compile, so that its helpers take tasks.
THREADED_DRIVER = """
import os
import sys
import threading

from workers.cli import main
from workers.pool_process import pool_context

if __name__ == "__main__":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    warm_up = pool_context().Process(target=os.getpid)
    warm_up.start()
    warm_up.join()
    main(sys.argv[1:])
"""


@pytest.mark.parametrize("cwd", ["older_checkout", "hostile_folder"])
@pytest.mark.parametrize("threaded", [False, True], ids=["forked", "forkserver"])
def test_a_parallel_compile_on_redis_from_another_checkout_makes_this_compilers_binaries(
    cwd: str, threaded: bool, graphs: Path, tmp_path: Path, redis_url: str, request: pytest.FixtureRequest
) -> None:
    """`compile --workers 2` against Redis, its helpers forked or (another thread running) started from the
    forkserver, twice: the cold compile's traces and the warm one's hits are this compiler's. A serial compile
    then reads every variant the cold one stored (a parallel one traces ahead, and on a loaded machine its
    helpers may trace a pass's variants before the tier answered the plan's read: those are counted
    misses_tier_unavailable, never a miss on a key)."""
    folder = request.getfixturevalue(cwd)
    env = environment(NKICACHE_NAMESPACE=f"own-code-{uuid.uuid4().hex}")
    command = None
    if threaded:
        (tmp_path / "driver.py").write_text(THREADED_DRIVER)
        command = [sys.executable, str(tmp_path / "driver.py")]
    cold = run(folder, "compile", graphs, "--tier", redis_url, "--workers", 2, "--out", tmp_path / "cold", "--json",
               env=env, command=command)  # fmt: skip
    warm = run(folder, "compile", graphs, "--tier", redis_url, "--workers", 2, "--out", tmp_path / "warm", "--json",
               env=env, command=command)  # fmt: skip
    serial = run(folder, "compile", graphs, "--tier", redis_url, "--workers", 1, "--out", tmp_path / "serial", "--json",
                 env=env)  # fmt: skip
    assert cold["parallel_traces"] > 0 and cold["traces_refused"] == 0
    assert warm["traces"] == warm["misses_tier_unavailable"]
    assert serial["traces"] == 0 and serial["remote_hits"] == serial["cache_misses"] > 0
    expected = own_output(graphs, tmp_path / "off")
    assert artifacts(tmp_path / "cold") == expected and artifacts(tmp_path / "warm") == expected
    assert artifacts(tmp_path / "serial") == expected


@pytest.mark.parametrize("cwd", ["older_checkout", "hostile_folder"])
def test_a_fleet_worker_started_from_another_checkout_compiles_with_this_compiler(
    cwd: str, graphs: Path, tmp_path: Path, private_redis_server: Any, request: pytest.FixtureRequest
) -> None:
    """`nkicache worker` run from the other folder: its compiling process (python -m workers.job_process)
    imports this compiler, so `submit --wait` brings back this compiler's artifacts."""
    folder = request.getfixturevalue(cwd)
    url = private_redis_server().url
    worker = subprocess.Popen([NKICACHE, "worker", "--tier", url, "--name", "w1"], cwd=folder, env=environment(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        done = run(folder, "submit", graphs, "--tier", url, "--wait", "--timeout", 120, "--out", tmp_path / "fleet",
                   "--json")  # fmt: skip
    finally:
        worker.send_signal(signal.SIGTERM)
        _, errors = worker.communicate(timeout=60)
    assert done["completed"] == 2 and done["failed"] == 0, (done, errors)
    assert artifacts(tmp_path / "fleet") == own_output(graphs, tmp_path / "off")


# -- the toolchain check on handed-over traces (defense in depth) -------------------------------------------
FOREIGN = "0123456789abcdef"  # a toolchain id no compiler of this code computes


def forged_trace(seconds: float = 0.5) -> TracedVariant:
    """A trace another compiler made: its binary is not what this one would emit."""
    result = {"binary": b"another compiler's softmax", "input_names": ["x"], "output_names": ["y"], "format": "bir"}
    return TracedVariant(result, seconds, FOREIGN)


@pytest.mark.parametrize("handed", ["traced_ahead", "traced_elsewhere"])
def test_a_pass_refuses_a_trace_another_compiler_handed_over_and_traces_it_itself(
    handed: str, tmp_path: Path, redis_url: str
) -> None:
    """`traced_ahead` is how the local pool hands its traces to a pass, `traced_elsewhere` how a fleet job's
    trace tasks do: a trace labelled with another toolchain id is refused (counted in traces_refused), the pass
    traces the variant itself, and the tier gets this compiler's binary."""
    graph = softmaxes("g", rows=(128, 256))
    path = write_graph(tmp_path, graph)
    own, _ = compile_graph(str(path), out_dir=tmp_path / "own")
    key, _ = kernel_cache_key(load_graph(graph).ops[0], make_target("Trn2"))
    settings = Settings(tier=redis_url, namespace=f"own-code-{uuid.uuid4().hex}", flush_interval=0.05)
    tier = open_tier(settings)
    try:
        result, _ = compile_graph(str(path), tier=tier, out_dir=tmp_path / "handed", **{handed: {key: forged_trace()}})
        tier.flush()
        stored = tier.find_traces([key])[0][key]
    finally:
        tier.close()
    assert result.error is None and result.counts["traces_refused"] == 1
    assert result.counts["traces"] == own.counts["traces"] and result.counts["parallel_traces"] == 0
    assert artifacts(tmp_path / "handed") == artifacts(tmp_path / "own")
    assert stored.result["binary"] != forged_trace().result["binary"]


def test_warm_refuses_a_pool_trace_labelled_with_another_toolchain(
    tmp_path: Path, older_checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`warm`'s pool hands each trace back with the id of the compiler that made it: one made by another compiler
    is counted in `refused`, traced again here, and never stored under this compiler's toolchain."""
    import workers.warm

    graphs = tmp_path / "graphs"
    graphs.mkdir()
    write_graph(graphs, softmaxes("g", rows=(128, 256)))
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    older = run(
        older_checkout, "compile", graphs, "--tier", tier, "--json", command=[sys.executable, "-m", "workers.cli"]
    )
    handed: list[str] = []

    def foreign_pool(calls: list, workers: int, max_instructions: int) -> Any:
        for variant, call in calls:  # the pool's answers, as processes running another compiler would give them
            handed.append(variant.cache_key)
            yield variant, call, forged_trace()

    monkeypatch.setattr(workers.warm, "_traced", foreign_pool)
    done = CliRunner().invoke(nkicache, ["warm", "--tier", tier, "--workers", "2", "--json"])
    assert done.exit_code == 0, done.output
    report = json.loads(done.output)
    assert report["refused"] == report["traced"] == older["traces"] == len(handed), (report, older)
    new = run(ROOT, "compile", graphs, "--tier", tier, "--out", tmp_path / "new", "--json")
    assert new["traces"] == 0 and artifacts(tmp_path / "new") == own_output(graphs, tmp_path / "off")
