"""The `nkicache` command line: version, help, the demo and its error handling."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from workers.cli import _Group, main
from workers.demo_cli import DEMO_CASES


def test_version_prints_the_package_version() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    assert version("nkicache") in result.output
    assert "nkicache" in result.output


@pytest.mark.parametrize("args", [["--help"], ["demo", "--help"]])
def test_help(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_group_help_lists_demo() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert "demo" in result.output


@pytest.mark.parametrize("func_name", ["Matmul", "Softmax", "RMSNorm"])
def test_demo_json_matches_reference(func_name: str) -> None:
    result = CliRunner().invoke(main, ["demo", "--func-name", func_name, "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    assert report["ok"] is True
    assert report["func_name"] == func_name
    assert report["kernel_name"] == DEMO_CASES[func_name].kernel_name
    assert report["bytes"] > 0
    assert report["instructions"] > 0
    assert report["compile_seconds"] >= 0
    assert report["max_abs_err"] < 1e-3


def test_demo_line_reports_ok() -> None:
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stdout.startswith("Matmul matmul_tiled lhsT[256,200] rhs[256,300] -> out[200,300]: binary ")
    assert result.stdout.rstrip().endswith("-> OK")


def test_project_errors_become_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch) -> None:
    import bridge
    from bridge.errors import UnknownKernelError

    def broken_compile(*args, **kwargs):
        raise UnknownKernelError("no internal kernel named Matmul")

    monkeypatch.setattr(bridge, "compile_kernel", broken_compile)
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 2
    assert result.stderr == "nkicache: error: no internal kernel named Matmul\n"
    assert "Traceback" not in result.output


def _group_raising(exc: Exception) -> click.Group:
    @click.group(cls=_Group)
    def group() -> None:
        """A throwaway group."""

    @group.command()
    def boom() -> None:
        """Raise."""
        raise exc

    return group


def test_wrapper_turns_any_nkicache_error_into_exit_2() -> None:
    from bridge.errors import KernelCompileError

    group = _group_raising(KernelCompileError("partition dim 200 > 128", kernel="matmul_tiled"))
    result = CliRunner().invoke(group, ["boom"])
    assert result.exit_code == 2
    assert result.stderr == "nkicache: error: kernel matmul_tiled: partition dim 200 > 128\n"
    assert result.stdout == ""


def test_wrapper_lets_other_errors_through() -> None:
    result = CliRunner().invoke(_group_raising(ValueError("a bug")), ["boom"])
    assert isinstance(result.exception, ValueError)


def test_unknown_func_name_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["demo", "--func-name", "Nope"])
    assert result.exit_code == 2
    assert "Nope" in result.output


@pytest.mark.parametrize("args", [["-h"], ["compile", "-h"], ["inspect", "gc", "-h"], ["warm", "-h"]])
def test_dash_h_is_help(args: list[str]) -> None:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and result.output.startswith("Usage: ")


def test_bench_without_the_dev_tooling_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel's install has no bench/ beside its packages: `nkicache bench`, whatever follows it, is one line on
    stderr naming where the benchmarks come from, exit 2; `nkicache --help` still lists it."""
    import workers.cli

    monkeypatch.setattr(workers.cli, "CHECKOUT", tmp_path)  # site-packages: no pyproject.toml, no bench/
    monkeypatch.delitem(main.commands, "bench", raising=False)
    why = "nkicache: error: `nkicache bench` comes with a source checkout: install one with `pip install -e '.[dev]'`\n"
    for args in (["bench"], ["bench", "--quick", "--json"], ["bench", "--help"]):
        result = CliRunner().invoke(main, args)
        assert (result.exit_code, result.stderr, result.stdout) == (2, why, ""), args
        assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "comes with a source checkout" in CliRunner().invoke(main, ["--help"]).stdout


def test_a_dev_command_is_loaded_from_the_checkout_by_its_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In an editable install the dev package is not on sys.path (only bridge, cachestore and workers are mapped):
    its command is loaded from the checkout's folder, from any working directory."""
    import workers.cli

    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "devpackage").mkdir()
    (tmp_path / "devpackage" / "__init__.py").write_text("")
    (tmp_path / "devpackage" / "cli.py").write_text(
        "import click\n\n@click.command()\ndef command():\n    click.echo('from the checkout')\n"
    )
    monkeypatch.setattr(workers.cli, "CHECKOUT", tmp_path)
    monkeypatch.delitem(sys.modules, "devpackage", raising=False)
    monkeypatch.delitem(sys.modules, "devpackage.cli", raising=False)
    monkeypatch.chdir("/")
    command = workers.cli.dev_command("dev", "devpackage.cli:command")
    assert sys.modules["devpackage.cli"].__file__ == str(tmp_path / "devpackage" / "cli.py")
    assert CliRunner().invoke(command).stdout == "from the checkout\n"
