"""Same kernel, specs and attrs -> byte-identical binary, in any process; nothing machine-specific inside.

The cache keys binaries by what went into them, so a binary that varied with hash seeds, working
directories, temp paths or object addresses would make every machine's entries differ for no reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import bridge
import bridge.frontends.beta3 as beta3
from bridge import Tensor
from bridge.errors import KernelCompileError
from bridge.targets import Trn1, Trn2

# (func_name, operands, results, attrs): each spec is (shape, dtype).
CASES = {
    "Matmul": ("Matmul", [((300, 200), "float32"), ((300, 700), "float32")], [((200, 700), "float32")], {}),
    "Softmax": ("Softmax", [((129, 1000), "bfloat16")], [((129, 1000), "bfloat16")], {}),
    "RMSNorm": ("RMSNorm", [((300, 513), "float16"), ((513,), "float16")], [((300, 513), "float16")], {"eps": 1e-5}),
}

# Runs in a fresh interpreter: compile every case and print {name: sha256}.
CHILD = """
import hashlib, json, sys
import bridge
from bridge import Tensor

cases = json.loads(sys.argv[1])
digests = {}
for name, (func_name, operands, results, attrs) in cases.items():
    result = bridge.compile_kernel(
        func_name,
        [Tensor(f"in{i}", shape, dtype) for i, (shape, dtype) in enumerate(operands)],
        [Tensor(f"out{i}", shape, dtype) for i, (shape, dtype) in enumerate(results)],
        attrs,
    )
    digests[name] = hashlib.sha256(result["binary"]).hexdigest()
print(json.dumps(digests))
"""


def compile_case(name: str, target=None) -> bytes:
    func_name, operands, results, attrs = CASES[name]
    return bridge.compile_kernel(
        func_name,
        [Tensor(f"in{i}", shape, dtype) for i, (shape, dtype) in enumerate(operands)],
        [Tensor(f"out{i}", shape, dtype) for i, (shape, dtype) in enumerate(results)],
        attrs,
        target=target,
    )["binary"]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digests_in_child(hash_seed: str, cwd: Path, tmpdir: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "TMPDIR": str(tmpdir)}
    env.pop("NKICACHE_TARGET", None)
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(CASES)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


@pytest.fixture(autouse=True)
def default_target(monkeypatch) -> None:
    monkeypatch.delenv("NKICACHE_TARGET", raising=False)


def test_two_processes_and_this_one_produce_identical_bytes(tmp_path: Path) -> None:
    """Different hash seeds, working directories and temp dirs: the same sha256 for every kernel."""
    runs = []
    for seed in ("1", "4242"):
        cwd, tmpdir = tmp_path / f"cwd-{seed}", tmp_path / f"tmp-{seed}"
        cwd.mkdir()
        tmpdir.mkdir()
        runs.append(digests_in_child(seed, cwd, tmpdir))
    here = {name: sha256(compile_case(name)) for name in CASES}
    assert runs[0] == runs[1] == here
    assert sorted(here) == sorted(CASES)
    assert len(set(here.values())) == len(CASES)


def test_repeated_compiles_in_one_process_are_identical() -> None:
    for name in CASES:
        assert compile_case(name) == compile_case(name)


def test_the_target_is_part_of_the_binary() -> None:
    assert compile_case("Softmax", Trn1()) != compile_case("Softmax", Trn2())
    assert compile_case("Softmax", Trn2()) == compile_case("Softmax")


def test_graph_tensor_names_do_not_reach_the_binary() -> None:
    func_name, operands, results, attrs = CASES["Matmul"]
    renamed = bridge.compile_kernel(
        func_name,
        [Tensor(f"graph_tensor_{i}", shape, dtype) for i, (shape, dtype) in enumerate(operands)],
        [Tensor("graph_result", shape, dtype) for shape, dtype in results],
        attrs,
    )["binary"]
    assert renamed == compile_case("Matmul")
    assert b"graph_tensor_" not in renamed


@pytest.mark.parametrize("name", list(CASES))
def test_binary_holds_no_paths_addresses_or_temp_names(name: str) -> None:
    binary = compile_case(name)
    repo_root = Path(bridge.__file__).resolve().parents[1]
    forbidden = {
        str(repo_root),
        os.getcwd(),
        tempfile.gettempdir(),
        str(Path.home()),
        "/tmp",
        "nkicache-kernel-",
        "kernel.json",
        ".py",
    }
    for text in forbidden:
        assert text.encode() not in binary, f"{text!r} found in the {name} binary"
    assert re.search(rb"0x[0-9a-fA-F]{6,}", binary) is None, "an object address in the binary"
    assert re.search(rb"<[A-Za-z_.]+ object at", binary) is None


def _recording_mkdtemp(monkeypatch) -> list[str]:
    created: list[str] = []
    original = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):
        path = original(*args, **kwargs)
        created.append(path)
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return created


def test_kernel_json_is_written_under_mkdtemp_and_removed(monkeypatch) -> None:
    created = _recording_mkdtemp(monkeypatch)
    seen: list[dict] = []
    original_compile = beta3.ParserFrontend.compile_to_bir

    def compile_to_bir(self, kernel_json_path):
        path = Path(kernel_json_path)
        assert path.parent == Path(created[-1]), "the kernel json must live in the mkdtemp directory"
        seen.append(json.loads(path.read_text()))
        return original_compile(self, kernel_json_path)

    monkeypatch.setattr(beta3.ParserFrontend, "compile_to_bir", compile_to_bir)
    compile_case("RMSNorm")
    assert len(created) == 1
    assert not os.path.exists(created[0]), "the kernel json directory is left behind"
    (spec,) = seen
    assert spec["kernel_name"] == "rmsnorm"
    assert spec["target"] == "Trn2"
    assert [t["name"] for t in spec["inputs"]] == ["a", "g"]
    assert spec["inputs"][0] == {"name": "a", "shape": [300, 513], "dtype": "float16"}
    assert [t["name"] for t in spec["outputs"]] == ["out"]
    assert spec["attrs"] == {"eps": 1e-5}


def test_kernel_json_directory_is_removed_when_the_compile_fails(monkeypatch) -> None:
    created = _recording_mkdtemp(monkeypatch)
    with pytest.raises(KernelCompileError, match="contraction mismatch"):
        bridge.compile_kernel(
            "Matmul",
            [Tensor("a", (5, 3), "float32"), Tensor("b", (6, 4), "float32")],
            [Tensor("c", (3, 4), "float32")],
        )
    assert len(created) == 1
    assert not os.path.exists(created[0])


def test_attrs_are_part_of_the_binary() -> None:
    tensors = ([Tensor("a", (4, 5), "float32"), Tensor("g", (5,), "float32")], [Tensor("o", (4, 5), "float32")])
    first = bridge.compile_kernel("RMSNorm", *tensors, {"eps": 0.5})["binary"]
    again = bridge.compile_kernel("RMSNorm", *tensors, {"eps": 0.5})["binary"]
    other = bridge.compile_kernel("RMSNorm", *tensors, {"eps": 0.25})["binary"]
    assert first == again
    assert first != other
