"""The local tier keeps to `max_size` (issue 16): writes past it delete the entries of least retention score
(issue 21: compile seconds saved per stored byte, halved for every week unused; among equal scores the least
recently used) and the file shrinks; a file of a previous schema is upgraded; `inspect du` shows the cap."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachestore.api import StoreRequest
from cachestore.backends import sqlite as sqlite_module
from cachestore.backends.sqlite import SqliteBackend
from cachestore.entry import Entry, encode_entry
from workers.cli import main

MiB = 1024 * 1024
CAP = 4 * MiB
TTL = 3600


def request(key: str, size: int = 64 * 1024, compile_seconds: float = 0.0) -> StoreRequest:
    entry = Entry(os.urandom(size), ["x"], ["out"], "bir", "bir-1", {"kernel_name": "k", "key": key})  # incompressible
    data = encode_entry(entry)
    return StoreRequest(key, entry.digest, data, "k", compile_seconds)


def on_disk(path: Path) -> int:
    return path.stat().st_size + sum(p.stat().st_size for p in [path.with_name(path.name + "-wal")] if p.is_file())


def test_a_tier_filled_past_max_size_stays_near_it_and_keeps_the_most_recently_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_module, "USE_GRANULARITY", 0.0)  # every read is a use (the default: a minute)
    path = tmp_path / "tier.sqlite"
    tier = SqliteBackend(path, max_size=CAP)
    keys = [f"key-{i:03d}" for i in range(200)]  # 200 x 64 KiB: 12.5 MiB, three times the cap
    sizes = []
    for i, key in enumerate(keys):
        tier.store([request(key)], TTL)
        if i % 10 == 0:
            assert tier.fetch([keys[0]], TTL)  # the first entry, used all along, is never the least recent
        sizes.append(path.stat().st_size)
    assert max(sizes) <= 1.1 * CAP, max(sizes)
    held = set(tier.fetch(keys, TTL))
    assert keys[0] in held and set(keys[-40:]) <= held  # the most recently used survive
    assert set(keys[1:100]).isdisjoint(held)  # the least recently used went
    assert 0.7 * CAP <= on_disk(path) <= 1.1 * CAP
    tier.close()
    assert path.stat().st_size <= 1.1 * CAP


def test_the_trim_keeps_what_saves_the_most_compile_time_per_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries that took long to trace survive newer cheap ones; among the cheap ones, recency decides."""
    monkeypatch.setattr(sqlite_module, "USE_GRANULARITY", 0.0)
    path = tmp_path / "tier.sqlite"
    tier = SqliteBackend(path, max_size=CAP)
    costly = [f"costly-{i:02d}" for i in range(10)]  # 10 x 64 KiB traced in 2 s each
    tier.store([request(key, compile_seconds=2.0) for key in costly], TTL)
    cheap = [f"cheap-{i:03d}" for i in range(150)]  # then 150 traced in 5 ms each, three times the cap in all
    sizes = []
    for key in cheap:
        tier.store([request(key, compile_seconds=0.005)], TTL)
        sizes.append(path.stat().st_size)
    assert max(sizes) <= 1.1 * CAP, max(sizes)  # the cap's guarantee holds whatever the ranking
    held = set(tier.fetch(costly + cheap, TTL))
    assert set(costly) <= held  # the oldest, never read again, and still kept: they save 400 times more
    assert set(cheap[-30:]) <= held and set(cheap[:60]).isdisjoint(held)  # cheap ones: least recent went first
    tier.close()
    assert path.stat().st_size <= 1.1 * CAP


def test_usage_recorded_in_the_metrics_raises_an_entrys_rank(tmp_path: Path) -> None:
    """The file's own metrics (the passes that used each key) count: an entry used by many passes outranks one
    used once that cost the same to trace."""
    from cachestore.api import KeyUsage, MetricsBatch

    tier = SqliteBackend(tmp_path / "tier.sqlite", max_size=CAP)
    popular = [f"popular-{i:02d}" for i in range(20)]
    tier.store([request(key, compile_seconds=0.1) for key in popular], TTL)
    usage = {key: KeyUsage("k", 1, 1.0, 2.0) for key in popular}
    for i in range(10):  # ten passes used each: each saved a trace
        assert tier.apply_metrics(MetricsBatch(f"pass-{i}", "host", "w", {"passes": 1}, {"k": 20}, usage))
    for i in range(120):
        tier.store([request(f"once-{i:03d}", compile_seconds=0.1)], TTL)
    assert set(tier.fetch(popular, TTL)) == set(popular)
    tier.close()


def test_a_schema_3_file_keeps_its_entries(tmp_path: Path) -> None:
    path = tmp_path / "v3.sqlite"
    tier = SqliteBackend(path, max_size=CAP)
    tier.store([request("kept")], TTL)
    tier.close()
    db = sqlite3.connect(path, isolation_level=None)  # as schema 3 made it: no compile_seconds column
    db.execute("ALTER TABLE entries DROP COLUMN compile_seconds")
    db.execute("ALTER TABLE key_usage DROP COLUMN passes")
    db.execute("UPDATE meta SET value = '3' WHERE name = 'schema'")
    db.close()
    with pytest.raises(Exception, match="has schema v3; this build uses v4"):
        SqliteBackend(path, create=False)
    tier = SqliteBackend(path, max_size=CAP)
    assert set(tier.fetch(["kept"], TTL)) == {"kept"}
    tier.store([request("new", compile_seconds=1.0)], TTL)
    rows = dict(tier._db().execute("SELECT cache_key, compile_seconds FROM entries").fetchall())
    assert rows == {"kept": 0.0, "new": 1.0}
    tier.close()


def test_deleting_entries_gives_the_space_back(tmp_path: Path) -> None:
    path = tmp_path / "tier.sqlite"
    tier = SqliteBackend(path)  # no cap
    tier.store([request(f"key-{i}") for i in range(40)], TTL)
    full = on_disk(path)
    assert full > 40 * 64 * 1024
    tier.delete_entries([f"key-{i}" for i in range(40)])  # what gc does
    assert on_disk(path) < full / 10
    tier.close()


def test_a_schema_2_file_is_upgraded_to_vacuum_incrementally(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path, isolation_level=None)  # as schema 2 made it: no auto_vacuum, no `used`
    db.execute("CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("INSERT INTO meta VALUES ('schema', '2')")
    db.execute("CREATE TABLE entries (toolchain TEXT NOT NULL, cache_key TEXT NOT NULL, data BLOB NOT NULL, "
               "digest TEXT NOT NULL, expires REAL NOT NULL, PRIMARY KEY (toolchain, cache_key))")  # fmt: skip
    db.execute("CREATE TABLE totals (name TEXT PRIMARY KEY, value REAL NOT NULL)")
    db.execute("INSERT INTO totals VALUES ('passes', 7)")
    db.close()
    tier = SqliteBackend(path, max_size=CAP)
    assert tier.totals() == {"passes": 7.0}  # the fleet metrics are kept
    assert tier._db().execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # incremental
    tier.store([request("key")], TTL)
    assert set(tier.fetch(["key"], TTL)) == {"key"}
    tier.close()


def test_inspect_du_shows_the_file_against_the_cap(tmp_path: Path) -> None:
    path = tmp_path / "tier.sqlite"
    tier = SqliteBackend(path, max_size=CAP)
    tier.store([request(f"key-{i}") for i in range(5)], TTL)
    tier.close()
    env = {"NKICACHE_TIER": f"local:{path}", "NKICACHE_MAX_SIZE": str(CAP)}
    usage = json.loads(CliRunner().invoke(main, ["inspect", "du", "--json"], env=env).stdout)
    assert usage["capacity"]["max_size"] == CAP and 5 * 64 * 1024 < usage["capacity"]["file_bytes"] < CAP
    text = CliRunner().invoke(main, ["inspect", "du"], env=env).stdout
    assert f"of max_size {CAP:,} bytes" in text
