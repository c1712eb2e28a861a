"""A tier driven through the command line, as the end-to-end tests of the shared tiers (dir:, s3://) drive it:
compiles in this process or in their own, the keys `inspect ls` lists, and the artifacts a compile wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from workers.cli import main

GRAPHS = Path(__file__).parent / "data" / "graphs"
NKICACHE = str(Path(sys.executable).with_name("nkicache"))


def cli(*args: str, expect: int = 0) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    return result.stdout


def compile_json(graphs: Path, tier: str, out: Path, *options: str) -> dict:
    return json.loads(cli("compile", str(graphs), "--json", "--tier", tier, "--out", str(out), *options))


def compile_process(graphs: Path, tier: str, out: Path, workers: int = 2) -> subprocess.Popen:
    """`compile --workers N` in a process of its own (two of them run at once)."""
    return subprocess.Popen(
        [NKICACHE, "compile", str(graphs), "--workers", str(workers), "--tier", tier, "--out", str(out), "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def artifacts(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def listed_keys(tier: str) -> set[str]:
    return {item["key"] for item in json.loads(cli("inspect", "ls", "--tier", tier, "--json"))}
