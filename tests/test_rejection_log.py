"""Refused entries cost a few lines of stderr, not two a read: the first of each cause as a warning, the
rest at debug level, and one line with the counts as the client closes."""

from __future__ import annotations

import json
import logging
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachestore.rejections import MAX_CAUSES, OTHER, RejectionLog, cause_of
from tests.helpers_graphs import mixed_graph, write_graph
from workers.cli import main


def test_a_cause_is_a_reason_without_its_numbers_quoted_values_and_details() -> None:
    assert cause_of("payload declares 62914560 bytes decompressed, over the 8388608-byte limit") == (
        "payload declares … bytes decompressed, over the …-byte limit"
    )
    assert cause_of("unknown binary format 'elf'") == cause_of("unknown binary format 'pe'")
    assert cause_of("payload cannot be decompressed: Unknown frame descriptor") == "payload cannot be decompressed"
    assert cause_of("body field 'compile_seconds' is 1e+300, not a number") != cause_of("stored bytes do not match")


def test_many_refusals_of_two_causes_are_three_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="cachestore.client")
    log = RejectionLog("local:tier.sqlite")
    for i in range(40):
        log.add(f"{i:064x}", f"payload declares {1000 + i} bytes decompressed, over the 512-byte limit")
    for i in range(15):
        log.add(f"{i:064x}", "stored bytes do not match their digest")
    log.log_summary()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 53
    assert warnings[-1] == (
        "tier local:tier.sqlite: rejected 55 entries in all: 40 payload declares … bytes decompressed, over the "
        "…-byte limit; 15 stored bytes do not match their digest"
    )


def test_a_writer_cannot_flood_the_log_with_causes_of_its_own(caplog: pytest.LogCaptureFixture) -> None:
    log = RejectionLog("t")
    for i in range(500):
        log.add("k" * 64, f"reason {chr(97 + i % 26)}{chr(97 + i // 26 % 26)}x")
    assert len(log.counts) == MAX_CAUSES + 1 and log.counts[OTHER] == 500 - MAX_CAUSES
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == MAX_CAUSES + 1


def test_a_compile_on_a_tier_of_damaged_entries_prints_a_line_per_cause(tmp_path: Path) -> None:
    """In a process of its own: what reaches stderr is what a user reads (no handler of pytest's between)."""
    graph = write_graph(tmp_path, mixed_graph("damaged-log"))
    tier = tmp_path / "tier.sqlite"
    args = ["compile", str(graph), "--tier", f"local:{tier}", "--out", str(tmp_path / "out"), "--json"]
    assert CliRunner().invoke(main, args).exit_code == 0
    with sqlite3.connect(tier) as db:
        damaged = db.execute("UPDATE entries SET data = randomblob(300)").rowcount
    assert damaged >= 5
    warm = subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True, timeout=120)
    assert warm.returncode == 0, warm.stderr
    assert json.loads(warm.stdout)["tier_rejected"] == damaged
    causes = {cause_of(line.split("...: ", 1)[1]) for line in warm.stderr.splitlines() if "...: " in line}
    lines = warm.stderr.splitlines()
    assert len(lines) == len(causes) + 1 and 1 <= len(causes) <= 3, warm.stderr  # random bytes: a cause or two
    assert f"rejected {damaged} entries in all" in lines[-1]
