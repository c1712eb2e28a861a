"""The toolchain id: computed from what the code that decides a binary means, so a change there changes it,
and a change anywhere else, or one that only touches comments, formatting or docstrings, does not."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from bridge.identity import CACHE_NAME, compile_sources, fingerprint, package_root, source_stamp, toolchain_id
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
    source.write_text(source.read_text() + "\n_A_CHANGE = 1\n")
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
    source.write_text(source.read_text() + "\n_A_CHANGE = 1\n")
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


# -- what the code means, not how it is written --------------------------------------------------------------
BLOCKWISE = "kernels/blockwise_mm.py"


def _edit(package_copy: Path, path: str, old: str, new: str) -> None:
    source = package_copy / path
    text = source.read_text()
    assert old in text, (path, old)
    source.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("path", [BLOCKWISE, "codegen.py"])
def test_a_comment_line_keeps_the_id(package_copy: Path, path: str) -> None:
    source = package_copy / path
    source.write_text("# a comment that cannot change a binary\n" + source.read_text() + "\n# and another\n")
    assert fingerprint(package_copy) == toolchain_id()


def test_a_reformat_keeps_the_id(package_copy: Path) -> None:
    """Blank lines, indentation inside brackets, line breaks and redundant parentheses are formatting."""
    reformatted = "\n\n        e = (\n            nl.exp(\n                shifted\n            )\n        )\n"
    _edit(package_copy, "kernels/softmax.py", "        e = nl.exp(shifted)\n", reformatted)
    _edit(package_copy, "codegen.py", "        self.cache_hits = 0\n", "        self.cache_hits = (0)\n\n")
    assert fingerprint(package_copy) == toolchain_id()


@pytest.mark.parametrize(
    "path, old, new",
    [
        (BLOCKWISE, '"""', '"""A docstring rewritten. '),  # the module's docstring
        ("codegen.py", '"""Compute a cache key from key components."""', '"""Hash the key components."""'),
        ("codegen.py", '    """One compilation pass.', '    """A pass, one of many.'),  # a class's
    ],
)
def test_a_docstring_change_keeps_the_id(package_copy: Path, path: str, old: str, new: str) -> None:
    _edit(package_copy, path, old, new)
    assert fingerprint(package_copy) == toolchain_id()


@pytest.mark.parametrize(
    "path, old, new",
    [
        ("kernels/softmax.py", "nl.exp(shifted)", "nl.exp(shifted * 1.0)"),  # an operation
        ("kernels/rmsnorm.py", "t * scale", "t / scale"),  # an operator
        ("codegen.py", "CACHE_KEY_LOG_PREFIX = 16", "CACHE_KEY_LOG_PREFIX = 17"),  # a constant
        ("nki/language.py", "def ", "def _unused(x=1):\n    return x\n\n\ndef "),  # a new function
    ],
)
def test_a_change_of_meaning_changes_the_id(package_copy: Path, path: str, old: str, new: str) -> None:
    _edit(package_copy, path, old, new)
    assert fingerprint(package_copy) != toolchain_id()


def test_a_default_argument_changes_the_id(package_copy: Path) -> None:
    _edit(package_copy, "kernels/rmsnorm.py", "def rmsnorm(a, g, out, eps=1e-6):", "def rmsnorm(a, g, out, eps=1e-5):")
    assert fingerprint(package_copy) != toolchain_id()


def test_a_string_that_is_not_a_docstring_changes_the_id(package_copy: Path) -> None:
    """Only the first statement of a module, class or function is documentation; an error message is code."""
    _edit(package_copy, "kernels/softmax.py", "softmax takes a 2-D input", "softmax takes a 2-dimensional input")
    assert fingerprint(package_copy) != toolchain_id()


# -- remembered between processes --------------------------------------------------------------------------
def _fresh_id(package_parent: Path) -> tuple[str, bool]:
    """(toolchain_id(), whether computing it parsed any source) in a new interpreter importing the `bridge`
    package found under `package_parent`."""
    code = "import sys; from bridge.identity import toolchain_id; print(toolchain_id(), 'ast' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=package_parent, capture_output=True, text=True,
                          check=True, env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin:/bin"})  # fmt: skip
    identity, parsed = done.stdout.split()
    return identity, parsed == "True"


def test_a_fresh_process_reads_the_id_without_parsing(package_copy: Path) -> None:
    first, parsed_first = _fresh_id(package_copy.parent)
    assert first == fingerprint(package_copy) and parsed_first
    second, parsed_second = _fresh_id(package_copy.parent)
    assert second == first and not parsed_second


def test_an_edit_after_the_id_was_remembered_is_seen_by_the_next_process(package_copy: Path) -> None:
    before, _ = _fresh_id(package_copy.parent)
    stamp = source_stamp(package_copy)
    _edit(package_copy, "kernels/softmax.py", "nl.exp(shifted)", "nl.exp(shifted * 1.0)")
    assert source_stamp(package_copy) != stamp
    after, parsed = _fresh_id(package_copy.parent)
    assert parsed and after != before and after == fingerprint(package_copy)


@pytest.mark.parametrize("content", ["", "not json", '{"stamp": "x", "toolchain": "0123456789abcdef"}', "[1]"])
def test_a_damaged_or_stale_remembered_id_is_computed_again(package_copy: Path, content: str) -> None:
    cache = package_copy / "__pycache__" / CACHE_NAME
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(content)
    identity, parsed = _fresh_id(package_copy.parent)
    assert parsed and identity == fingerprint(package_copy)
    assert json.loads(cache.read_text())["toolchain"] == identity


def test_a_forged_id_under_the_right_stamp_is_refused_when_it_is_no_id(package_copy: Path) -> None:
    cache = package_copy / "__pycache__" / CACHE_NAME
    cache.parent.mkdir(exist_ok=True)
    cache.write_text(json.dumps({"stamp": source_stamp(package_copy), "toolchain": "../../etc/passwd"}))
    identity, parsed = _fresh_id(package_copy.parent)
    assert parsed and identity == fingerprint(package_copy)


def test_a_package_folder_that_cannot_be_written_still_gets_its_id(package_copy: Path) -> None:
    """A file where the cache folder would be stops every write (for root too, whom modes do not stop)."""
    (package_copy / "__pycache__").write_text("not a folder")
    for _ in range(2):
        identity, parsed = _fresh_id(package_copy.parent)
        assert parsed and identity == fingerprint(package_copy)
