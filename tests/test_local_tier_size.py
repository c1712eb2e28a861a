"""The local tier keeps to `max_size` (issue 16): writes past it delete the least recently used entries and the
file shrinks; a file of the previous schema is upgraded to one that can shrink; `inspect du` shows the cap."""

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


def request(key: str, size: int = 64 * 1024) -> StoreRequest:
    entry = Entry(os.urandom(size), ["x"], ["out"], "bir", "bir-1", {"kernel_name": "k", "key": key})  # incompressible
    data = encode_entry(entry)
    return StoreRequest(key, entry.digest, data, lambda holder: data, "k")


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


def test_deleting_entries_gives_the_space_back(tmp_path: Path) -> None:
    path = tmp_path / "tier.sqlite"
    tier = SqliteBackend(path)  # no cap
    tier.store([request(f"key-{i}") for i in range(40)], TTL)
    full = on_disk(path)
    assert full > 40 * 64 * 1024
    tier.delete_entries([(f"key-{i}", None) for i in range(40)])  # what gc does
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
