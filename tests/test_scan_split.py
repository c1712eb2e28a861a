"""Scans split over processes (cachestore.scan_split): `inspect du` and `inspect verify` read a Redis tier's
entries in several forked processes and report exactly what one process reports, on a tier of mixed entries
(signed, writer-signed by two writers, references, corrupt, another toolchain's); a scanning process that
dies or fails fails the scan; the packed reads give back what redis-py's pipeline gave."""

from __future__ import annotations

import json
import os
import random
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import redis
from helpers_entries import old_reference
from helpers_graphs import delete_namespace, unique_namespace
from helpers_report import Tier, nkicache, run_known_fleet

from bridge.codegen import cache_key_of_stored as cache_key_of
from bridge.identity import toolchain_id
from cachestore import scan_split
from cachestore.api import RawEntry, TierError, TierUnavailable, WriteItem
from cachestore.backends.redis import RedisBackend
from cachestore.entry import Entry, SignaturePolicy, encode_entry, writer_of
from cachestore.inspect import decode_or_reason, disk_usage, partition_readers
from cachestore.keys import KeySpace, partition
from workers.verify import merged_sample, verify_entries

pytestmark = pytest.mark.redis

HMAC_KEY = b"fleet-signing-key-for-tests-0001"
OTHER_TOOLCHAIN = "0" * 16
KERNELS = ("softmax", "matmul_tiled", "rmsnorm")


@pytest.fixture
def backend(redis_url: str) -> Iterator[RedisBackend]:
    namespace = unique_namespace()
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    yield RedisBackend(client, KeySpace(namespace))
    delete_namespace(client, namespace)
    client.close()


@pytest.fixture
def small_pages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Pages of 3 names, split from the second page on; returns a list that grows by the number of processes
    of each split scan (so a test can tell that it did split)."""
    monkeypatch.setattr(scan_split, "PAGE", 3)
    monkeypatch.setattr(scan_split, "SPLIT_AFTER_PAGES", 2)
    splits: list[int] = []
    original = scan_split._scan_in_processes

    def spied(reader: Any, make_task: Any, pages: Any, processes: int, with_ttl: bool) -> list:
        splits.append(processes)
        return original(reader, make_task, pages, processes, with_ttl)

    monkeypatch.setattr(scan_split, "_scan_in_processes", spied)
    return splits


def components(kernel: str, i: int) -> dict:
    return {"kernel_name": kernel, "operands": {"shapes": [[i + 1, 8]], "dtypes": ["float32"]},
            "results": {"shapes": [[i + 1, 8]], "dtypes": ["float32"]}, "attrs": {"i": i}, "target": "Trn2",
            "num_neuroncores": 2}  # fmt: skip


def fill_mixed(backend: RedisBackend, ci: Any, laptop: Any) -> dict[str, str]:
    """About fifty entries of every kind du and verify tell apart; returns {name: cache key} of the bad ones."""
    rng = random.Random(5)
    items: list[WriteItem] = []
    holders: list[tuple[str, Entry]] = []
    for i in range(36):
        kc = components(KERNELS[i % 3], i)
        key = cache_key_of(kc)
        if i % 5 == 4:  # an earlier binary again, under its own key
            entry = msgspec.structs.replace(holders[rng.randrange(len(holders))][1], key_components=kc)
            items.append(WriteItem(key, encode_entry(entry), entry.digest, 3600))
            continue
        entry = Entry(rng.randbytes(rng.randrange(100, 3000)), ["x"], ["out"], "bir", "v", kc, "h", "w",
                      toolchain=toolchain_id())  # fmt: skip
        holders.append((key, entry))
        kind = i % 4
        if kind == 1:
            data = encode_entry(entry, HMAC_KEY)
        elif kind == 2:
            data = encode_entry(entry, writer=ci, cache_key=key)
        elif kind == 3:
            data = encode_entry(entry, writer=laptop, cache_key=key)
        else:
            data = encode_entry(entry)
        items.append(WriteItem(key, data, entry.digest, 3600))
    bad: dict[str, str] = {}
    good = {item.cache_key: item.data for item in items}
    keys = sorted(good)
    flipped = bytearray(good[keys[0]])
    flipped[len(flipped) // 2] ^= 0xFF
    corrupt = {"flipped": bytes(flipped), "truncated": good[keys[1]][:40], "junk": b"not an entry at all",
               "old schema": msgpack.packb({"binary": b"x"})}  # fmt: skip
    for n, (name, data) in enumerate(corrupt.items()):
        bad[name] = cache_key_of(components("softmax", 100 + n))
        items.append(WriteItem(bad[name], data, None, 3600))
    old = msgspec.structs.replace(holders[0][1], key_components=components("rmsnorm", 200))
    bad["old reference"] = cache_key_of(old.key_components)  # an older build's dedupe reference
    items.append(WriteItem(bad["old reference"], old_reference(old, holders[0][0]), None, 3600))
    # A body whose digest lies.
    forged = Entry(**{**holders[1][1]._fields(), "binary": b"\x00evil", "digest": "8" * 64,
                      "key_components": components("softmax", 201)})  # fmt: skip
    bad["forged"] = cache_key_of(forged.key_components)
    items.append(WriteItem(bad["forged"], encode_entry(forged), None, 3600))
    bad["misplaced"] = "ab" * 32
    items.append(WriteItem(bad["misplaced"], good[keys[2]], None, 3600))
    bad["hand-named"] = "hand-named"  # no SHA-256: stored under its text ("=" tag)
    items.append(WriteItem(bad["hand-named"], good[keys[3]], None, 3600))
    backend.put_entries(items)
    theirs = []
    for key, entry in holders[:5]:
        copy = Entry(**{**entry._fields(), "toolchain": OTHER_TOOLCHAIN})
        theirs.append(WriteItem(key, encode_entry(copy), copy.digest, 3600))
    backend.in_partition(partition(OTHER_TOOLCHAIN)).put_entries(theirs)
    return bad


def previous_disk_usage(reader: Any) -> dict:
    """`disk_usage` as it was before scans were split (commit a6ec70b), verbatim but for its name, the dedupe
    columns it had then and the partition's names (`partition_readers`, `RawEntry.partition`): one process, one
    partition after another."""
    kernels: dict[str, Counter] = defaultdict(Counter)
    partitions: dict[str, Counter] = defaultdict(Counter)
    writers: dict[str, Counter] = defaultdict(Counter)
    unreadable = Counter()
    for raw in (raw for store in partition_readers(reader) for raw in store.scan_entries(with_ttl=False)):
        partitions[raw.partition]["entries"] += 1
        partitions[raw.partition]["bytes"] += len(raw.data)
        entry = decode_or_reason(raw.data)
        writer = writers[writer_of(raw.data) if isinstance(entry, str) else entry.writer]
        writer["entries"] += 1
        writer["bytes"] += len(raw.data)
        if isinstance(entry, str):
            unreadable["entries"] += 1
            unreadable["bytes"] += len(raw.data)
            continue
        row = kernels[str(entry.key_components.get("kernel_name", ""))]
        row["entries"] += 1
        row["bytes"] += len(raw.data)
        row["binary_bytes"] += len(entry.binary)
    fields = ("entries", "bytes", "binary_bytes")
    rows = {name: {f: int(row[f]) for f in fields} for name, row in sorted(kernels.items())}
    total = {f: sum(row[f] for row in rows.values()) for f in fields}
    return {
        "kernels": rows,
        "toolchains": {name: {"entries": c["entries"], "bytes": c["bytes"]} for name, c in sorted(partitions.items())},
        "writers": {name: {"entries": c["entries"], "bytes": c["bytes"]} for name, c in sorted(writers.items())},
        "total": total,
        "unreadable": {"entries": unreadable["entries"], "bytes": unreadable["bytes"]},
        "capacity": reader.capacity() if hasattr(reader, "capacity") else None,
    }


# -- du -------------------------------------------------------------------------------------------------
def test_du_split_over_processes_counts_exactly_what_the_previous_du_counted(
    backend: RedisBackend, ci: Any, laptop: Any, small_pages: list[int]
) -> None:
    fill_mixed(backend, ci, laptop)
    before = previous_disk_usage(backend)
    # The tier holds every kind of entry du tells apart, so equal reports compare every column.
    assert before["unreadable"]["entries"] == 5  # the four corrupt ones and the old reference
    assert {ci.key_id.hex(), laptop.key_id.hex(), ""} <= set(before["writers"])
    assert before["toolchains"].keys() == {backend.partition, partition(OTHER_TOOLCHAIN)}
    assert all(row["entries"] and row["binary_bytes"] for row in before["kernels"].values())
    for processes in (1, 2, 3):
        assert disk_usage(backend, processes=processes) == before
    assert small_pages == [2, 3]  # processes=1 scanned here; the others split


def test_du_of_a_small_tier_is_not_split(backend: RedisBackend, ci: Any, laptop: Any, monkeypatch: Any) -> None:
    fill_mixed(backend, ci, laptop)  # 50 entries: one page
    monkeypatch.setattr(scan_split, "_scan_in_processes", lambda *args: pytest.fail("a one-page tier was split"))
    assert disk_usage(backend, processes=4) == previous_disk_usage(backend)


# -- verify ---------------------------------------------------------------------------------------------
def test_verify_split_over_processes_finds_what_one_process_finds(
    backend: RedisBackend, ci: Any, laptop: Any, small_pages: list[int]
) -> None:
    bad = fill_mixed(backend, ci, laptop)
    policy = SignaturePolicy(hmac_key=HMAC_KEY, require_signed=False)
    alone = verify_entries(backend, policy, processes=1)
    split = verify_entries(backend, policy, processes=2)
    assert small_pages == [2]
    assert split.checked == alone.checked == 36 + len(bad)
    assert sorted(split.bad, key=lambda item: item["key"]) == sorted(alone.bad, key=lambda item: item["key"])
    reasons = {item["key"]: item["reason"] for item in split.bad}
    assert set(reasons) == set(bad.values())
    assert reasons[bad["forged"]] == "binary does not match its digest"
    assert "reference to another key's binary" in reasons[bad["old reference"]]


def test_verify_split_over_processes_still_samples_every_good_entry(tmp_path: Path, redis_url: str,
                                                                      small_pages: list[int]) -> None:  # fmt: skip
    namespace = unique_namespace()
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    tier = Tier("redis", redis_url, namespace, RedisBackend(client, KeySpace(namespace)), client)
    try:
        run_known_fleet(tier)
        report = verify_entries(tier.backend, SignaturePolicy(require_signed=False), recompile=20, execute=3)
        assert (report.checked, report.bad, report.recompiled, report.executed) == (8, [], 8, 3)
        assert small_pages == [scan_split.default_processes()] or scan_split.default_processes() == 1
    finally:
        delete_namespace(client, namespace)
        client.close()


def test_merged_samples_draw_every_key_alike() -> None:
    """Two processes found 30 and 10 good keys: a merged sample of 4 takes each of the 40 about as often."""
    first, second = [f"a{i}" for i in range(30)], [f"b{i}" for i in range(10)]
    counts: Counter = Counter()
    rng = random.Random(1)
    for _ in range(4000):
        parts = [(rng.sample(first, 4), 30), (rng.sample(second, 4), 10)]
        drawn = merged_sample(parts, 4, rng)
        assert len(set(drawn)) == 4
        counts.update(drawn)
    assert set(counts) == set(first) | set(second)
    assert all(300 <= count <= 500 for count in counts.values()), counts  # 400 each expected (4000 * 4 / 40)
    assert merged_sample([(["x"], 1), ([], 0)], 5, rng) == ["x"]


# -- a process that dies or fails -----------------------------------------------------------------------
class _Dies:
    def __init__(self, how: str):
        self.how, self.seen = how, 0

    def add(self, batch: list[RawEntry]) -> None:
        # Whichever process gets a page (pages go to the first to ask: one may get them all).
        self.seen += len(batch)
        if self.how == "killed":
            os._exit(3)  # as a process killed by the OOM killer or a signal: no message, no result
        if self.how == "tier":
            raise TierUnavailable("redis://127.0.0.1: ConnectionError: gone")

    def result(self) -> int:
        return self.seen


def test_a_scanning_process_that_dies_fails_the_scan(backend: RedisBackend, ci: Any, laptop: Any,
                                                      small_pages: list[int]) -> None:  # fmt: skip
    fill_mixed(backend, ci, laptop)
    counted = scan_split.scan_split(backend, lambda index: _Dies("none"), processes=2)
    assert sum(counted) == 36 + 8 and len(counted) == 2
    with pytest.raises(scan_split.ScanFailed, match=r"exit code 3\) before sending its result"):
        scan_split.scan_split(backend, lambda index: _Dies("killed"), processes=2)
    with pytest.raises(TierUnavailable, match="ConnectionError: gone"):
        scan_split.scan_split(backend, lambda index: _Dies("tier"), processes=2)


class _FailsAfterOnePage:
    """A child's end of the pipe, as the parent sees it: two requests; the first page's read fails, so the child
    says why and closes, and the page the parent then sends for the second request finds the pipe closed."""

    def __init__(self) -> None:
        self.inbox = [b"", b""]  # two requests in flight
        self.pages_sent = 0
        self.error = msgpack.packb({"error": "TierUnavailable", "message": "redis://127.0.0.1: gone"})

    def recv_bytes(self) -> bytes:
        return self.inbox.pop(0)

    def send_bytes(self, data: bytes) -> None:
        self.pages_sent += 1
        if self.pages_sent == 2:  # the child failed on the first page, said so and closed meanwhile
            self.inbox.append(self.error)
            raise BrokenPipeError(32, "Broken pipe")

    def poll(self) -> bool:
        return bool(self.inbox)


class _Child:
    pid, exitcode = 12345, 0

    def join(self, timeout: float | None = None) -> None:
        pass


def test_a_child_that_fails_between_two_pages_is_heard_not_taken_for_dead() -> None:
    conn = _FailsAfterOnePage()
    pages = iter([["a"], ["b"], ["c"]])
    with pytest.raises(TierUnavailable, match="gone"):  # its own error, not "ended before sending its result"
        scan_split._deal({conn: _Child()}, pages, lambda conns: list(conns))


# -- a scan's reads of many entries ---------------------------------------------------------------------
def test_a_scans_reads_give_each_value_and_a_refused_one_leaves_the_next_read_in_step(backend: RedisBackend) -> None:
    values = {f"{i:064x}": os.urandom(i * 37) for i in range(1, 40)}
    backend.put_entries([WriteItem(key, value, None, 3600) for key, value in values.items()])
    backend.client.set(backend.keys.entry(backend.partition, "e" * 64), b"")  # an empty value: read as what it is
    names = [backend.keys.entry(backend.partition, key) for key in [*values, "e" * 64, "d" * 64]]
    packed = backend._read_entries(names, with_ttl=False)
    assert packed == [(value, None) for value in values.values()] + [(b"", None), (None, None)]
    wrong = backend.keys.entry(backend.partition, "c" * 64)
    backend.client.hset(wrong, "not", "a string")  # GETRANGE of a hash: an error reply amid the others
    with pytest.raises(TierError, match="WRONGTYPE"):
        backend._read_entries([names[0], wrong, names[1]], with_ttl=False)
    # The replies after the refused one were read too: the next read gets its own replies.
    assert backend._read_entries(names[:3], with_ttl=False) == packed[:3]


def test_the_commands_take_a_number_of_processes(redis_url: str, small_pages: list[int]) -> None:
    namespace = unique_namespace()
    client = redis.Redis.from_url(redis_url, socket_timeout=10)
    tier = Tier("redis", redis_url, namespace, RedisBackend(client, KeySpace(namespace)), client)
    try:
        run_known_fleet(tier)
        outputs = {}
        for processes in ("1", "2"):
            for command in ("du", "verify"):
                result = nkicache(tier, "inspect", command, "--processes", processes, "--json")
                assert result.exit_code == 0, result.output
                outputs[command, processes] = json.loads(result.stdout)
        assert outputs["du", "1"] == outputs["du", "2"] and outputs["du", "2"]["total"]["entries"] == 8
        assert outputs["verify", "1"] == outputs["verify", "2"] == {"checked": 8, "ok": 8, "bad": [], "recompiled": 0,
                                                                    "executed": 0}  # fmt: skip
        assert small_pages == [2, 2]
        refused = nkicache(tier, "inspect", "du", "--processes", "0")
        assert refused.exit_code == 2 and "--processes" in refused.output
    finally:
        delete_namespace(client, namespace)
        client.close()
