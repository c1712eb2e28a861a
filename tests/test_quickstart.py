"""`nkicache quickstart`: one JSON document with --json, only this run's artifacts checked, and a last line
saying where everything is."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner

from workers.cli import main


def quickstart(folder: Path, models: int, *flags: str):
    result = CliRunner().invoke(main, ["quickstart", "--dir", str(folder), "--models", str(models), "--workers", "1",
                                       *flags])  # fmt: skip
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_json_is_one_document_and_a_smaller_rerun_checks_only_its_own_artifacts(tmp_path: Path) -> None:
    folder = tmp_path / "qs"
    first = json.loads(quickstart(folder, 3, "--json").stdout)  # one document, or this raises "Extra data"
    assert set(first) == {"cold", "warm", "check", "warm_speedup", "paths"}
    assert first["check"]["artifacts"] == 3 and first["check"]["failed"] == []
    assert first["warm"]["traces"] == 0 and first["warm"]["shared_hit_rate"] == 1.0
    assert first["paths"]["artifacts"] == str(folder / "out")

    second = json.loads(quickstart(folder, 1, "--json").stdout)
    assert second["check"]["artifacts"] == 1  # not the two graphs the first run left behind
    assert len(list((folder / "out").glob("*.nkibb"))) == 1


def test_the_last_line_says_where_everything_is(tmp_path: Path) -> None:
    folder = tmp_path / "qs"
    last = quickstart(folder, 1).stdout.splitlines()[-1]
    assert last.startswith(f"== everything is in {folder}/")
    for part in (folder / "graphs", folder / "out", folder / "tier.sqlite"):
        assert str(part) in last


def test_the_summary_counts_what_the_cold_run_traced_in_parallel(tmp_path: Path) -> None:
    folder = tmp_path / "qs"
    result = CliRunner().invoke(main, ["quickstart", "--dir", str(folder), "--models", "2", "--workers", "2"])
    assert result.exit_code == 0, (result.output, result.exception)
    line = next(line for line in result.stdout.splitlines() if line.startswith("== cold compile took"))
    cold_traces = int(line.split("; traces ")[1].split(" ->")[0])
    assert cold_traces > 0 and " -> 0;" in line  # a cold run with 2 workers traced, in parallel traces


def test_the_summary_prints_the_wall_times_of_both_compiles_and_says_what_they_are(tmp_path: Path) -> None:
    text = CliRunner().invoke(main, ["quickstart", "--dir", str(tmp_path / "qs"), "--models", "1"]).stdout
    line = next(line for line in text.splitlines() if line.startswith("== cold compile took"))
    times = re.match(r"== cold compile took (\d+\.\d\d) s, warm (\d+\.\d\d) s \(wall times", line)
    assert times and float(times[1]) > float(times[2]) > 0, line
    assert "x faster" not in line and "inside this process" in line and "nkicache bench" in line
