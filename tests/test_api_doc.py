"""Every example of docs/api.md runs, in order, in one namespace (as a reader would paste them)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", API_PAGE.read_text(), flags=re.DOTALL)


def test_the_page_has_examples_for_each_promise() -> None:
    code = "\n".join(examples())
    for call in ("load_settings(", "open_tier(", "compile_graph(", "kernel_cache_key(", "find_traces(",
                 "publish_trace(", "run_bir(", "build_report("):  # fmt: skip
        assert call in code, call


def test_every_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "api_doc"}
    for number, block in enumerate(examples(), 1):
        exec(compile(block, f"{API_PAGE}:example {number}", "exec"), namespace)  # our own docs, run as written
    printed = capsys.readouterr().out
    assert "from the tier, 0 traced" in printed and "2 passes" in printed
