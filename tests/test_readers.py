"""The shared reader suite: every backend's reader side (cachestore.api.Reader) answers the same questions
the same way: the embedded SQLite tier, the Redis tier on fakeredis and on a real redis-server, and a
snapshot file exported from a tier. tests/test_cluster.py runs it once more on the 3-master cluster.

Each reader holds one known data set (`populate`): three entries, one a reference to another, and two
metrics batches from two workers. A snapshot keeps entries and per-key usage but no fleet totals, workers,
kernel counts or pass log; it says so by being `read_only`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_tier_backends import backend_of, decoded, entry, request_for

from cachestore.api import KeyUsage, MetricsBatch, Reader, WriteItem
from cachestore.backends.snapshot import SnapshotError, SnapshotReader, write_snapshot
from cachestore.entry import encode_entry
from cachestore.keys import partition, split_partition

TTL = 3600
FULL, SAME_BINARY, OTHER = "aa01" + "0" * 60, "aa02" + "0" * 60, "bb03" + "0" * 60
FINISHED = (1000.0, 2000.0)  # when the two passes ended, as their records say
TOOLCHAINS = ("0123456789abcdef", "fedcba9876543210")  # the compilers that ran the two passes
OTHER_TOOLCHAIN = "00000000000000ff"  # a compiler that holds no entries until a test writes some


def populate(backend: Any) -> dict[str, bytes]:
    """Three entries and two workers' metrics batches; returns what was stored, {key: encoded entry}."""
    backend.store([request_for(FULL, entry(b"alpha" * 50, shape=1)), request_for(OTHER, entry(b"gamma", "matmul"))],
                  TTL)  # fmt: skip
    backend.store([request_for(SAME_BINARY, entry(b"alpha" * 50, shape=2))], TTL)  # the same binary, another key
    first = MetricsBatch(
        "batch-1", "h1", "w1", {"passes": 1, "kernels": 4, "cache_hits": 3},
        {"softmax": 3, "matmul": 1},
        {FULL: KeyUsage("softmax", 3, 100.0, 200.0), OTHER: KeyUsage("matmul", 1, 150.0, 150.0)},
        {"graph": "g1", "finished": FINISHED[0]}, TOOLCHAINS[0],
    )  # fmt: skip
    second = MetricsBatch(
        "batch-2", "h2", "w2", {"passes": 1, "kernels": 2, "cache_hits": 2}, {"softmax": 2},
        {FULL: KeyUsage("softmax", 2, 50.0, 300.0)}, {"graph": "g2", "finished": FINISHED[1]}, TOOLCHAINS[1],
    )  # fmt: skip
    assert backend.apply_metrics(first) and backend.apply_metrics(second)
    return {raw.cache_key: raw.data for raw in backend.scan_entries()}


@pytest.fixture(params=["local", "fakeredis", pytest.param("redis", marks=pytest.mark.redis), "snapshot"])
def reader(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Reader]:
    with backend_of("local" if request.param == "snapshot" else request.param, request, tmp_path) as backend:
        populate(backend)
        if request.param != "snapshot":
            yield backend
            return
        path = tmp_path / "tier.snapshot"
        assert write_snapshot(backend, path) == 3
        yield SnapshotReader(path)


def stored(reader: Reader) -> dict[str, bytes]:
    return {raw.cache_key: raw.data for raw in reader.scan_entries()}


# -- entries ----------------------------------------------------------------------------------------------
def test_scan_streams_every_entry_with_the_time_it_has_left(reader: Reader) -> None:
    stream = reader.scan_entries()
    assert iter(stream) is stream  # a generator, not a list built up front
    raws = {raw.cache_key: raw for raw in stream}
    assert set(raws) == {FULL, SAME_BINARY, OTHER}
    assert all(0 < raw.ttl <= TTL for raw in raws.values())
    assert decoded(raws[SAME_BINARY].data).binary == decoded(raws[FULL].data).binary == b"alpha" * 50
    assert {raw.cache_key: raw.data for raw in reader.scan_entries(with_ttl=False)} == stored(reader)


def test_entry_keys_name_every_entry_of_every_partition_without_reading_values(reader: Reader) -> None:
    listed = list(reader.entry_keys())
    assert sorted(listed) == sorted((reader.partition, key) for key in (FULL, SAME_BINARY, OTHER))
    if isinstance(reader, SnapshotReader):
        return
    elsewhere = reader.in_partition(partition(OTHER_TOOLCHAIN))
    elsewhere.put_entries([WriteItem(OTHER, stored(reader)[OTHER], None, TTL)])
    assert (partition(OTHER_TOOLCHAIN), OTHER) in set(reader.entry_keys())
    assert len(list(reader.entry_keys())) == 4


def test_coverage_weighs_each_toolchains_variants_by_fleet_usage(reader: Reader) -> None:
    from cachestore.report import Coverage, build_report
    from cachestore.report_render import render_text

    assert build_report(reader, top=0, timeline=False).coverage == {}  # one toolchain: nothing to compare
    if isinstance(reader, SnapshotReader):
        return
    reader.in_partition(partition(OTHER_TOOLCHAIN)).put_entries([WriteItem(FULL, stored(reader)[FULL], None, TTL)])
    coverage = build_report(reader, top=0, timeline=False).coverage
    # FULL was used 5 times, OTHER once, SAME_BINARY never: the other toolchain holds 5 of the 6 uses.
    mine = split_partition(reader.partition)[0]  # the toolchain whose trusted partition the reader is in
    assert coverage[OTHER_TOOLCHAIN] == {mine: Coverage(3, 1, 6, 5, round(5 / 6, 6))}
    assert coverage[mine] == {OTHER_TOOLCHAIN: Coverage(1, 1, 5, 5, 1.0)}
    text = render_text(build_report(reader, top=0, timeline=False), width=160)
    assert f"│ {OTHER_TOOLCHAIN}" in text and "5 of 6" in text and "83.3%" in text


def test_get_entries_returns_only_what_is_there(reader: Reader) -> None:
    everything = stored(reader)
    assert reader.get_entries([OTHER, "ff" * 32, FULL]) == {OTHER: everything[OTHER], FULL: everything[FULL]}
    assert reader.get_entries([]) == {}


def test_find_keys_by_prefix(reader: Reader) -> None:
    assert reader.find_keys("aa") == [FULL, SAME_BINARY]
    assert reader.find_keys("aa0", limit=1) in ([FULL], [SAME_BINARY])
    assert reader.find_keys("bb03") == [OTHER]
    assert reader.find_keys("cc") == []


def test_writes_round_trip_or_are_refused_by_a_read_only_reader(reader: Reader) -> None:
    item = WriteItem("cc04" + "0" * 60, encode_entry(entry(b"delta")), entry(b"delta").digest, TTL)
    if isinstance(reader, SnapshotReader):
        with pytest.raises(SnapshotError, match="read-only"):
            reader.put_entries([item])
        with pytest.raises(SnapshotError, match="read-only"):
            reader.delete_entries([FULL])
        return
    reader.put_entries([item])
    assert reader.get_entries([item.cache_key]) == {item.cache_key: item.data}
    reader.delete_entries([item.cache_key, OTHER])
    assert set(stored(reader)) == {FULL, SAME_BINARY}


def test_only_a_store_that_keeps_expired_entries_counts_and_purges_them(reader: Reader) -> None:
    if isinstance(reader, SnapshotReader):
        assert reader.expired_count() == (0, 0)
        return
    data = encode_entry(entry(b"epsilon"))
    reader.put_entries([WriteItem("dd05" + "0" * 60, data, None, 0.05)])
    time.sleep(0.2)
    assert "dd05" + "0" * 60 not in stored(reader)  # expired entries are never listed
    assert reader.expired_count() == ((1, len(data)) if reader.keeps_expired else (0, 0))
    reader.purge_expired()
    assert reader.expired_count() == (0, 0)
    assert set(stored(reader)) == {FULL, SAME_BINARY, OTHER}


# -- per-key metrics --------------------------------------------------------------------------------------
def test_key_records_sum_the_batches(reader: Reader) -> None:
    records = reader.key_records([FULL, OTHER, SAME_BINARY])
    assert set(records) == {FULL, OTHER}  # the reference's key was never used
    full = records[FULL]
    assert (full.kernel_name, full.usage, full.first_use, full.last_use) == ("softmax", 5, 50.0, 300.0)
    assert (records[OTHER].kernel_name, records[OTHER].usage) == ("matmul", 1)


def test_key_hosts_and_usage(reader: Reader) -> None:
    assert reader.key_hosts([FULL, OTHER, SAME_BINARY]) == {FULL: ["h1", "h2"], OTHER: ["h1"]}
    assert dict(reader.key_usage()) == {FULL: 5, OTHER: 1}
    assert reader.key_count() == 2


# -- fleet metrics ----------------------------------------------------------------------------------------
def test_fleet_totals_workers_and_kernels(reader: Reader) -> None:
    if isinstance(reader, SnapshotReader):  # a snapshot keeps per-key usage only
        assert (reader.totals(), list(reader.workers()), reader.kernels()) == ({}, [], {})
        return
    assert reader.totals() == {"passes": 2, "kernels": 6, "cache_hits": 5}
    assert sorted(reader.workers()) == [
        ("h1", "w1", {"passes": 1, "kernels": 4, "cache_hits": 3}),
        ("h2", "w2", {"passes": 1, "kernels": 2, "cache_hits": 2}),
    ]
    assert reader.kernels() == {"matmul": {"call_count": 1, "variants": 1}, "softmax": {"call_count": 5, "variants": 1}}


def test_pass_log_in_order_with_the_time_each_pass_ended(reader: Reader) -> None:
    if isinstance(reader, SnapshotReader):
        assert (list(reader.pass_log(None)), reader.pass_log_span(None)) == ([], None)
        return
    log = list(reader.pass_log(None))
    assert [(when, record["graph"]) for when, record in log] == [(FINISHED[0], "g1"), (FINISHED[1], "g2")]
    assert reader.pass_log_span(None) == FINISHED
    # `since` is compared with when a record was appended, which was just now.
    assert list(reader.pass_log(time.time() + 3600)) == []
    assert reader.pass_log_span(time.time() + 3600) is None


def test_totals_per_toolchain_are_applied_once_with_the_batch(reader: Reader) -> None:
    if isinstance(reader, SnapshotReader):  # a snapshot keeps per-key usage only
        assert reader.toolchains() == {}
        return
    assert reader.toolchains() == {
        TOOLCHAINS[0]: {"passes": 1, "kernels": 4, "cache_hits": 3},
        TOOLCHAINS[1]: {"passes": 1, "kernels": 2, "cache_hits": 2},
    }
    backend: Any = reader
    assert backend.apply_metrics(MetricsBatch("batch-3", "h2", "w2", {"passes": 1, "kernels": 5}, {}, {}, None,
                                              TOOLCHAINS[0]))  # fmt: skip
    # The same batch id again counts once, per toolchain too; a batch naming no toolchain counts in none.
    assert not backend.apply_metrics(MetricsBatch("batch-1", "h1", "w1", {"passes": 1}, toolchain=TOOLCHAINS[1]))
    assert backend.apply_metrics(MetricsBatch("batch-4", "h1", "w1", {"passes": 1, "kernels": 7}))
    assert reader.toolchains() == {
        TOOLCHAINS[0]: {"passes": 2, "kernels": 9, "cache_hits": 3},
        TOOLCHAINS[1]: {"passes": 1, "kernels": 2, "cache_hits": 2},
    }
    assert reader.totals() == {"passes": 4, "kernels": 18, "cache_hits": 5}


def test_a_local_tier_from_before_toolchain_totals_reads_and_then_gains_them(tmp_path: Path) -> None:
    import sqlite3

    from cachestore.backends.sqlite import SqliteBackend

    path = tmp_path / "old.sqlite"
    tier = SqliteBackend(path)
    populate(tier)
    tier.close()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE toolchain_totals")  # as the previous build left its files
    db.close()
    old = SqliteBackend(path, create=False)  # a report opens it without writing
    assert old.toolchains() == {}
    assert old.totals() == {"passes": 2, "kernels": 6, "cache_hits": 5}
    tier = SqliteBackend(path)  # a compile opens it for writing: the table is created
    assert tier.apply_metrics(MetricsBatch("batch-3", "h1", "w1", {"passes": 1}, toolchain=TOOLCHAINS[0]))
    assert tier.toolchains() == old.toolchains() == {TOOLCHAINS[0]: {"passes": 1}}
    assert tier.totals()["passes"] == 3
    old.close()
    tier.close()
