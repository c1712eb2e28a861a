"""Issue 46: `nkicache exec -- COMMAND` attaches the tier to a codegen loop it does not own, through the
specification's seams, as ccache wraps the compiler users already run.

neuronx-cc cannot be installed here. The tests build, from the specification's roster alone, a stand-in of its
module at its real import path (tests/standin), compiled with Cython as neuronx-cc's module is, so that the
attachment wraps `cython_function_or_method` methods; its trace does real work (nkicache's own beta3 compile).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers_graphs import mixed_graph, write_graph

ROOT = Path(__file__).resolve().parent.parent
NKICACHE = str(Path(sys.executable).with_name("nkicache"))
DRIVER = Path(__file__).parent / "data" / "exec" / "drive.py"
STANDIN = Path(__file__).parent / "standin"
LOOP_MODULE = Path("neuronxcc/starfish/penguin/targets/codegen/BirCodeGenLoop.py")
TIMEOUT = 120


@pytest.fixture(scope="module")
def compiled_standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in package with its loop module compiled by Cython (the .py removed: the .so is imported)."""
    folder = tmp_path_factory.mktemp("standin")
    shutil.copytree(STANDIN, folder, dirs_exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "Cython.Build.Cythonize", "-i", "-3", "-q", str(folder / LOOP_MODULE)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=folder,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (folder / LOOP_MODULE).unlink()
    assert list((folder / LOOP_MODULE.parent).glob("BirCodeGenLoop*.so"))
    return folder


@pytest.fixture
def graph(tmp_path: Path) -> Path:
    return write_graph(tmp_path, mixed_graph())  # 8 kernel ops, 6 distinct variants


DISTINCT = 6


def environment(standin: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(standin), **extra}


def drive(standin: Path, graph: Path, *exec_args: str, env: dict[str, str] | None = None) -> Any:
    """The driver's run (under `nkicache exec` when given its options), as a completed process."""
    prefix = [NKICACHE, "exec", *exec_args, "--"] if exec_args else []
    return subprocess.run(
        [*prefix, sys.executable, str(DRIVER), str(graph)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env or environment(standin),
    )


def state(done: Any) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def report(tier: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [NKICACHE, "report", "--tier", tier, "--json"], capture_output=True, text=True, timeout=TIMEOUT, env=env
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["totals"]


def test_the_compiled_standin_has_cython_methods(compiled_standin: Path) -> None:
    code = (
        "from neuronxcc.starfish.penguin.targets.codegen.BirCodeGenLoop import BirCodeGenLoop as L; "
        "print(type(L.__dict__['_trace_internal_kernel_to_new_nki_frontend']).__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment(compiled_standin), timeout=TIMEOUT
    )
    assert done.stdout.strip() == "cython_function_or_method", done.stderr


def test_a_second_run_traces_nothing_and_the_loops_own_state_is_untouched(
    compiled_standin: Path, graph: Path, tmp_path: Path
) -> None:
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    alone = state(drive(compiled_standin, graph))
    first = state(drive(compiled_standin, graph, "--tier", tier))
    second_run = drive(compiled_standin, graph, "--tier", tier, "--summary")
    second = state(second_run)
    assert alone == first == second  # hits, misses, maps, components, usage counts and the emitted block
    assert (alone["cache_hits"], alone["cache_misses"]) == (2, DISTINCT)
    assert f"1 passes, 0 traces, {DISTINCT} remote hits of {DISTINCT} tier lookups" in second_run.stderr
    totals = report(tier)
    assert totals["passes"] == 2 and totals["traces"] == DISTINCT and totals["remote_hits"] == DISTINCT
    assert totals["cache_hits"] == 4 and totals["cache_misses"] == 2 * DISTINCT


def test_a_loop_that_never_reaches_its_teardown_is_recorded_at_exit(
    compiled_standin: Path, graph: Path, tmp_path: Path
) -> None:
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    done = subprocess.run(
        [NKICACHE, "exec", "--tier", tier, "--", sys.executable, str(DRIVER), str(graph), "--no-teardown"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=environment(compiled_standin),
    )
    assert done.returncode == 0, done.stderr
    totals = report(tier)
    assert totals["passes"] == 1 and totals["traces"] == DISTINCT


def test_two_processes_at_once_through_redis_trace_each_variant_once(
    compiled_standin: Path, graph: Path, redis_url: str, redis_client: Any
) -> None:
    namespace = f"exec-{uuid.uuid4().hex[:12]}"
    env = environment(compiled_standin, NKICACHE_NAMESPACE=namespace)
    argv = [NKICACHE, "exec", "--tier", redis_url, "--", sys.executable, str(DRIVER), str(graph)]
    try:
        runs = [
            subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)
        ]
        outputs = [run.communicate(timeout=TIMEOUT) for run in runs]
        assert all(run.returncode == 0 for run in runs), outputs
        assert json.loads(outputs[0][0]) == json.loads(outputs[1][0])
        totals = report(redis_url, env)
        assert totals["passes"] == 2 and totals["traces"] == DISTINCT
        assert totals["remote_hits"] == DISTINCT
    finally:
        for key in redis_client.scan_iter(match=f"{namespace}:*"):
            redis_client.delete(key)


REFUSING = """
class Refusing(type):
    def __setattr__(cls, name, value):
        raise TypeError("cannot set attributes of a compiled type")


class Loop(metaclass=Refusing):
    def _trace_internal_kernel_to_new_nki_frontend(self, inst, cache_key): ...
    def _compute_cache_key_from_components(self, key_components): ...
    def _cache_new_nki_frontend_binary(self, cache_key, binary, key_components): ...
    def afterStmtTransform(self): ...


class NoBridge:
    def _compute_cache_key_from_components(self, key_components): ...
    def _cache_new_nki_frontend_binary(self, cache_key, binary, key_components): ...
    def afterStmtTransform(self): ...
"""
COMMAND = 'import strange_loops; print("the command\'s own output"); raise SystemExit(3)'


@pytest.mark.parametrize(
    ("loop", "problem"),
    [("Loop", "refuses attribute assignment"), ("NoBridge", "no _trace_internal_kernel_to_new_nki_frontend")],
)
def test_a_class_that_cannot_be_attached_runs_unchanged_with_one_warning(
    loop: str, problem: str, tmp_path: Path
) -> None:
    (tmp_path / "strange_loops.py").write_text(REFUSING)
    command = [sys.executable, "-c", COMMAND]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    alone = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT)
    attached = subprocess.run(
        [
            NKICACHE,
            "exec",
            "--tier",
            f"local:{tmp_path / 't.sqlite'}",
            "--loop",
            f"strange_loops:{loop}",
            "--",
            *command,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )
    assert (
        (attached.returncode, attached.stdout) == (alone.returncode, alone.stdout) == (3, "the command's own output\n")
    )
    lines = attached.stderr.splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("nkicache exec: not attached to strange_loops.") and problem in lines[0]
    )


def test_check_names_the_seams_and_runs_nothing(compiled_standin: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [NKICACHE, "exec", "--tier", "off", "--check", "--", "false"],
        capture_output=True,
        text=True,
        env=environment(compiled_standin),
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, done.stderr
    lines = {line.partition(":BirCodeGenLoop:")[0]: line for line in done.stdout.splitlines()}
    assert "attaches" in lines["neuronxcc.starfish.penguin.targets.codegen.BirCodeGenLoop"]
    assert "attaches" in lines["bridge.codegen"]


def test_the_users_sitecustomize_still_runs_and_settings_stay_out_of_argv(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    code = "import os, sys; print(os.environ.get('USER_SITECUSTOMIZE'), sys.argv[1:])"
    done = subprocess.run(
        [NKICACHE, "exec", "--tier", "redis://:secret@127.0.0.1:1/0", "--", sys.executable, "-c", code, "a"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran ['a']"


def test_a_command_that_does_not_exist_is_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [NKICACHE, "exec", "--tier", "off", "--", "no-such-command-here"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 127 and done.stderr.startswith("nkicache: error: cannot run 'no-such-command-here'")


def test_a_bad_tier_is_a_usage_error_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = subprocess.run([NKICACHE, "exec", "--tier", "redis://:secret@host/abc", "--", "touch", str(marker)],
                          capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert done.returncode == 2 and "--tier" in done.stderr and "names database 'abc'" in done.stderr
    assert "secret" not in done.stderr and not marker.exists()


OUR_DRIVER = """
import json
import sys

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from bridge.targets import make_target

loop = BirCodeGenLoop(make_target("Trn2"))
loop.run(load_graph(sys.argv[1]))
print(json.dumps([loop.cache_hits, loop.cache_misses, sorted(loop._new_nki_frontend_kernel_cache)]))
"""


def test_our_own_loop_made_without_a_tier_gets_the_exec_tier(graph: Path, tmp_path: Path) -> None:
    """A program that makes nkicache's own loop with no tier, under `nkicache exec`: the same seam attaches it."""
    (tmp_path / "ours.py").write_text(OUR_DRIVER)
    tier = f"local:{tmp_path / 'tier.sqlite'}"
    runs = [subprocess.run([NKICACHE, "exec", "--tier", tier, "--summary", "--", sys.executable,
                            str(tmp_path / "ours.py"), str(graph)], capture_output=True, text=True, timeout=TIMEOUT)
            for _ in range(2)]  # fmt: skip
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    assert json.loads(runs[0].stdout) == json.loads(runs[1].stdout)
    assert f"1 passes, {DISTINCT} traces" in runs[0].stderr and f"0 traces, {DISTINCT} remote hits" in runs[1].stderr


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        ({"binary": "text, not bytes", "input_names": ["x"], "output_names": ["y"], "format": "bir"}, "not bytes"),
        ({"binary": b"bir", "input_names": [object()], "output_names": ["y"], "format": "bir"}, "list of strings"),
    ],
)
def test_a_trace_the_tier_cannot_store_without_pickling_is_counted_and_the_compile_goes_on(
    result: dict, problem: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 46: a loop's bridge may return what the entry format cannot hold (a foreign compiler's objects): it
    is not stored (never pickled), it is counted in tier_dropped, and the pass goes on with it."""
    from bridge.codegen import BirCodeGenLoop
    from bridge.graph import load_graph
    from cachestore.settings import Settings
    from cachestore.stores import open_tier

    monkeypatch.setattr(BirCodeGenLoop, "_trace_kernel_beta3", lambda self, inst, cache_key: dict(result))
    tier = open_tier(Settings(tier=f"local:{tmp_path / 'tier.sqlite'}"))
    try:
        loop = BirCodeGenLoop(tier=tier)
        softmax = {**mixed_graph(), "ops": [op for op in mixed_graph()["ops"] if op.get("func_name") == "Softmax"][:1]}
        loop.run(load_graph(softmax))
        tier.flush()
        assert loop.pass_summary()["tier_dropped"] == 1 and loop.cache_misses == 1
        assert tier.find_traces(list(loop._cache_key_components))[0] == {}
        assert any(problem in record.getMessage() for record in caplog.records)
    finally:
        tier.close()


@pytest.mark.parametrize("message", [b"\xff\xfe not UTF-8", b"two\nlines", b""])
def test_a_foreign_loop_refuses_a_negative_entry_it_could_not_fail_with(message: bytes) -> None:
    """The foreign verifier is the loop's own (tier_seam.trace_problem): a planted negative entry whose message is
    not one readable line is refused, never decoded in the middle of the user's compile."""
    from bridge.codegen import BirCodeGenLoop
    from bridge.failures import FAILED
    from bridge.port import StoredTrace
    from workers.attach import foreign_trace_problem

    loop = BirCodeGenLoop()
    stored = StoredTrace({"binary": message, "input_names": [], "output_names": [], "format": FAILED}, 0.0,
                         {"kernel_name": "softmax"}, "f" * 16)  # fmt: skip
    assert foreign_trace_problem("f" * 16)(loop, "k" * 64, stored) == "a failure entry without a readable message"
