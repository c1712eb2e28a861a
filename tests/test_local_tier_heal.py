"""A local tier that heals (issue 35): a file SQLite reports as corrupt, or that is no tier at all, is moved
aside as `PATH.corrupt-<time>` and a fresh tier started, with one warning; processes that find one broken file
at once replace it once; the write-ahead log keeps within max_size."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sqlite3
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_local_tier_size import CAP, request

from cachestore.backends import sqlite as sqlite_module
from cachestore.backends.sqlite import SCHEMA_VERSION, SqliteBackend
from workers.cli import main

GRAPHS = Path(__file__).parent / "data" / "graphs"
WARNING = "is no usable tier"


def compile_json(tier: Path, out: Path, caplog: pytest.LogCaptureFixture) -> tuple[dict, list[str]]:
    """The compile's JSON report, and the warnings of the tier's replacement it logged."""
    caplog.clear()
    result = CliRunner().invoke(main, ["compile", str(GRAPHS), "--json", "--tier", f"local:{tier}", "--out", str(out)])
    assert result.exit_code == 0, result.output
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and WARNING in r.getMessage()]
    return json.loads(result.stdout), warnings


def traced(report: dict) -> int:
    return report["traces"]


def foreign_database(path: Path) -> None:
    path.unlink()
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE notes (body TEXT)")
    db.execute("INSERT INTO notes VALUES ('not a tier')")
    db.commit()
    db.close()


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated": lambda path: path.write_bytes(path.read_bytes()[:4096]),
    "zero-filled": lambda path: path.write_bytes(bytes(path.stat().st_size)),
    "garbage": lambda path: path.write_bytes(os.urandom(path.stat().st_size)),
    "another-database": foreign_database,
}


def asides(path: Path) -> list[Path]:
    """The files moved aside (without their -wal and -shm)."""
    return sorted(p for p in path.parent.iterdir()
                  if p.name.startswith(f"{path.name}.corrupt-") and not p.name.endswith(("-wal", "-shm")))  # fmt: skip


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_broken_tier_file_heals_on_the_next_compile(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    tier = tmp_path / "tier.sqlite"
    first, _ = compile_json(tier, tmp_path / "out1", caplog)
    assert traced(first) == first["cache_misses"] > 0
    DAMAGE[damage](tier)
    broken = tier.read_bytes()

    healing, warnings = compile_json(tier, tmp_path / "out2", caplog)
    assert len(warnings) == 1, caplog.text
    (aside,) = asides(tier)
    assert str(tier) in warnings[0] and str(aside) in warnings[0] and "\n" not in warnings[0], warnings
    if damage == "another-database":  # kept, for whoever wants it back (in WAL mode: opening it set that)
        assert sqlite3.connect(aside).execute("SELECT body FROM notes").fetchall() == [("not a tier",)]
    else:
        assert aside.read_bytes() == broken  # kept as it was, for whoever wants to look at it
    assert (healing["tier_errors"], healing["tier_dropped"]) == (0, 0), healing
    assert traced(healing) == healing["cache_misses"]  # a fresh tier: everything traced once more

    warm, warnings = compile_json(tier, tmp_path / "out3", caplog)
    assert traced(warm) == 0 and warm["remote_hits"] == warm["cache_misses"], warm
    assert warnings == [] and asides(tier) == [aside]


def test_a_tier_of_a_newer_schema_is_not_replaced(tmp_path: Path) -> None:
    """A schema this build does not know is another build's tier, not a broken one: an error, the file kept."""
    tier = tmp_path / "tier.sqlite"
    SqliteBackend(tier).close()
    db = sqlite3.connect(tier)
    db.execute("UPDATE meta SET value = ? WHERE name = 'schema'", (str(SCHEMA_VERSION + 1),))
    db.commit()
    db.close()
    with pytest.raises(sqlite_module.TierUnavailable, match=f"schema v{SCHEMA_VERSION + 1}"):
        SqliteBackend(tier)
    assert asides(tier) == []


def open_at_once(path: str, barrier: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue) -> None:
    barrier.wait()
    try:
        backend = SqliteBackend(path)
        backend.put_entries([])
        backend.store([request(f"key-{os.getpid()}", size=1024)], 3600)
        backend.close()
        results.put("ok")
    except Exception:  # reported to the test, which fails on it
        results.put(traceback.format_exc())


@pytest.mark.parametrize("round_", range(5))
def test_processes_opening_one_corrupt_file_at_once_replace_it_once(tmp_path: Path, round_: int) -> None:
    tier = tmp_path / "tier.sqlite"
    SqliteBackend(tier).close()
    tier.write_bytes(os.urandom(64 * 1024))
    processes = 4
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(processes), context.Queue()
    started = [context.Process(target=open_at_once, args=(str(tier), barrier, results)) for _ in range(processes)]
    for process in started:
        process.start()
    outcomes = [results.get(timeout=60) for _ in started]
    for process in started:
        process.join(timeout=60)
    assert outcomes == ["ok"] * processes
    assert len(asides(tier)) == 1  # one replacement: no process moved aside the fresh file another started
    backend = SqliteBackend(tier, create=False)
    stored = {key for (key,) in backend._read("SELECT cache_key FROM entries")}
    assert stored == {f"key-{process.pid}" for process in started}  # every process wrote to the one good tier
    backend.close()


def test_the_write_ahead_log_stays_within_max_size(tmp_path: Path) -> None:
    path = tmp_path / "tier.sqlite"
    writer = SqliteBackend(path, max_size=CAP)
    reader = SqliteBackend(path, max_size=CAP)  # another connection reading along, as a second process would
    wal = path.with_name(path.name + "-wal")
    largest_wal = largest_total = 0
    for i in range(200):  # 200 x 64 KiB: three times the cap
        writer.store([request(f"key-{i:03d}")], 3600)
        if i % 3 == 0:
            reader.fetch([f"key-{i:03d}"], 3600)
        wal_bytes = wal.stat().st_size if wal.is_file() else 0
        largest_wal = max(largest_wal, wal_bytes)
        largest_total = max(largest_total, wal_bytes + path.stat().st_size)
    writer.close()
    reader.close()
    # The log is checkpointed at the trim's slack (a tenth of the cap), plus the one write that crossed it.
    assert largest_wal <= 0.15 * CAP, largest_wal
    assert largest_total <= 1.15 * CAP, largest_total


class LockedOnce:
    """A connection whose switch to WAL answers "database is locked" at once the first `times` times, as SQLite
    does (without its busy handler) where waiting could deadlock: a reader of a file another process is
    switching to WAL, as when several open the file one of them just replaced."""

    refusals = 0

    def __init__(self, connection: sqlite3.Connection, times: int) -> None:
        self.connection, self.times = connection, times

    def execute(self, sql: str, *args: object) -> object:
        if sql == "PRAGMA journal_mode=WAL" and LockedOnce.refusals < self.times:
            LockedOnce.refusals += 1
            busy = sqlite3.OperationalError("database is locked")
            busy.sqlite_errorcode = sqlite3.SQLITE_BUSY
            raise busy
        return self.connection.execute(sql, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.connection, name)


@pytest.mark.parametrize("refusals", [1, sqlite_module.SETUP_ATTEMPTS - 1])
def test_a_set_up_answered_locked_without_waiting_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusals: int
) -> None:
    """Issue 48: the heal flake ("database is locked" from the connection's set-up while a replaced file is
    opened by several processes) is a busy answer SQLite gives without waiting; the set-up is tried again."""
    real_connect = sqlite3.connect
    LockedOnce.refusals = 0
    monkeypatch.setattr(sqlite3, "connect", lambda *args, **kwargs: LockedOnce(real_connect(*args, **kwargs), refusals))
    store = SqliteBackend(tmp_path / "tier.sqlite")
    try:
        stored = request("k", 1024)
        store.store([stored], 3600)
        assert store.get_entries(["k"]) == {"k": stored.full} and LockedOnce.refusals == refusals
    finally:
        store.close()


def test_a_tier_file_the_store_made_itself_is_not_taken_for_a_replaced_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first write to a new tier file went through the 'deleted or replaced by another process' path: the
    connection that made the file had taken its identity before there was one. Every first compile on a new
    local tier printed that warning, dropped its connection and set the tables up again."""
    path = tmp_path / "tier.sqlite"
    store = SqliteBackend(path)  # makes the file
    try:
        written = request("first", 1024)
        store.store([written], 3600)
        assert store.get_entries(["first"]) == {"first": written.full}
    finally:
        store.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_writes_after_the_tier_file_is_deleted_go_to_a_new_file_not_nowhere(tmp_path: Path) -> None:
    """Issue 45 F13: the tier file deleted mid-compile (by hand, a cleanup job) took every later write of the
    open connection with it, silently. The next write notices and goes to a new file at the path."""
    path = tmp_path / "tier.sqlite"
    store = SqliteBackend(path)
    try:
        before = request("before", 1024)
        store.store([before], 3600)
        for leftover in tmp_path.glob("tier.sqlite*"):
            leftover.unlink()
        after = request("after", 1024)
        store.store([after], 3600)
    finally:
        store.close()
    reader = SqliteBackend(path)
    try:
        assert reader.get_entries(["before", "after"]) == {"after": after.full}
    finally:
        reader.close()
