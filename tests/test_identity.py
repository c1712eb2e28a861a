"""The toolchain id: computed from the code that decides a binary, so a change there changes it and a
change anywhere else does not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from bridge.identity import compile_sources, fingerprint, package_root, toolchain_id
from workers.cli import main


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "bridge"
    shutil.copytree(package_root(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_a_copy_of_the_package_has_the_same_id() -> None:
    assert fingerprint(package_root()) == toolchain_id()
    assert len(toolchain_id()) == 16 and int(toolchain_id(), 16) >= 0


@pytest.mark.parametrize(
    "path",
    ["kernels/softmax.py", "nki/language.py", "frontends/beta3.py", "program.py", "registry.py", "codegen.py"],
)
def test_a_change_on_the_compile_path_changes_the_id(package_copy: Path, path: str) -> None:
    source = package_copy / path
    source.write_text(source.read_text() + "\n# a change\n")
    assert fingerprint(package_copy) != toolchain_id()


def test_a_kernel_maths_change_changes_the_id(package_copy: Path) -> None:
    softmax = package_copy / "kernels" / "softmax.py"
    text = softmax.read_text()
    assert "nl.exp(" in text
    softmax.write_text(text.replace("nl.exp(", "nl.exp(2.0 * ", 1))
    assert fingerprint(package_copy) != toolchain_id()


@pytest.mark.parametrize("path", ["references.py", "graph_runner.py", "sampling.py", "artifact.py"])
def test_code_off_the_compile_path_does_not_change_the_id(package_copy: Path, path: str) -> None:
    """The numpy references, the artifact runner and the input sampler never shape a binary."""
    source = package_copy / path
    source.write_text(source.read_text() + "\n# a change\n")
    assert fingerprint(package_copy) == toolchain_id()


def test_a_module_added_to_the_compile_path_is_covered_without_being_listed(package_copy: Path) -> None:
    helper = package_copy / "kernels" / "helper_math.py"
    helper.write_text("SCALE = 1.0\n")
    (package_copy / "kernels" / "softmax.py").write_text(
        "from bridge.kernels import helper_math  # noqa: F401\n" + (package_copy / "kernels" / "softmax.py").read_text()
    )
    assert helper in compile_sources(package_copy)
    before = fingerprint(package_copy)
    helper.write_text("SCALE = 2.0\n")
    assert fingerprint(package_copy) != before


def test_the_compile_path_is_what_a_compile_loads() -> None:
    names = {path.relative_to(package_root()).as_posix() for path in compile_sources(package_root())}
    assert {"codegen.py", "kernels/softmax.py", "nki/language.py", "frontends/beta3.py", "program.py"} <= names
    assert not {"references.py", "graph_runner.py", "sampling.py", "artifact.py"} & names


def test_version_prints_the_toolchain_id() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and f"toolchain {toolchain_id()}" in result.output
