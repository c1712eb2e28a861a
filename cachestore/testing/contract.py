"""The store contract as pytest tests, written once against cachestore.api's Backend and Reader protocols, as
dogpile ships dogpile/testing/fixtures.py. A store's test module subclasses `StoreContract` and gives it one
fixture, `open_store`: a function opening the store under test (a fresh, empty one for the test, the same one
on every call) with `max_entry_bytes` and `partition` keywords, closing what it opened when the test ends:

    class TestMyStore(StoreContract):
        @pytest.fixture
        def open_store(self, tmp_path):
            opened = []
            def open_store(**options):
                opened.append(MyBackend(tmp_path / "store", **options))
                return opened[-1]
            yield open_store
            for store in opened:
                store.close()

A store that can be opened read-only gives `open_read_only` too (the same store, refusing writes); without it
the read-only test is skipped. Only the protocols are used: entries are any bytes (stores do not decode them),
times are read back through `RawEntry.ttl`, and expiry is waited for (a second or two).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from bridge.errors import NkiCacheError
from cachestore.api import BatchRefused, KeyUsage, MetricsBatch, Store, StoreRequest, WriteItem
from cachestore.entry import TooLarge
from cachestore.keys import partition

TTL = 3600
TOOLCHAIN = "contract0toolchain"  # the compiler the metrics batches name
PARTITION = partition(TOOLCHAIN)  # where the store's entries are: that compiler's trusted partition
OTHER_PARTITION = partition("contract1toolchain")  # another compiler's
# Keys a store must keep apart and give back as they are: separators, dots, spaces, non-ASCII, a long one.
ODD_KEYS = ["../../escape", "a/b\\c", ".hidden", "with space", "ключ-✓", "x" * 100, "a" * 64]


def request(cache_key: str, data: bytes, kernel: str = "softmax", **options: Any) -> StoreRequest:
    """A store of `data` under `cache_key`."""
    return StoreRequest(cache_key, f"digest-{cache_key}", data, kernel, **options)


def wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def usage_batch(batch_id: str, host: str, worker: str, keys: dict[str, KeyUsage], **totals: float) -> MetricsBatch:
    calls: dict[str, int] = {}
    for usage in keys.values():
        calls[usage.kernel_name] = calls.get(usage.kernel_name, 0) + usage.usage
    record = {"pass_id": batch_id, "host": host, "finished": 1000.0 + len(batch_id)}
    return MetricsBatch(batch_id, host, worker, dict(totals), calls, keys, record, TOOLCHAIN)


def entry_ttls(store: Store) -> dict[str, float]:
    """The seconds each entry has left: every entry a store under test keeps has an expiry."""
    ttls = {}
    for raw in store.scan_entries():
        assert raw.ttl is not None, raw
        ttls[raw.cache_key] = raw.ttl
    return ttls


def lease_free(store: Store, key: str) -> bool:
    return store.lease_holder(key) is None


def contend_at_once(handles: list[Store], key: str) -> list[str]:
    """The owners that won `key`'s lease when each handle asked for it at once, from a thread of its own."""
    start, won = threading.Barrier(len(handles)), []

    def contend(index: int, handle: Store) -> None:
        start.wait()
        if handle.acquire_lease(key, f"w{index}", 30):
            won.append(f"w{index}")

    threads = [threading.Thread(target=contend, args=pair) for pair in enumerate(handles)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    return won


class StoreContract:
    """The contract's tests; a subclass provides the `open_store` fixture (see the module's docstring)."""

    @pytest.fixture
    def open_store(self) -> Callable[..., Store]:
        raise NotImplementedError("a store's test class provides open_store")

    @pytest.fixture
    def open_read_only(self) -> Callable[..., Store] | None:
        return None

    @pytest.fixture
    def store(self, open_store: Callable[..., Store]) -> Store:
        return open_store(partition=PARTITION)

    # -- entries ----------------------------------------------------------------------------------
    def test_missing_keys_read_as_absent(self, store: Store) -> None:
        assert store.fetch(["nope", "a" * 64], TTL) == {}
        assert store.fetch(["nope"], None) == {}
        assert store.get_entries(["nope"]) == {}
        assert store.find_keys("no") == []
        assert list(store.scan_entries()) == []
        assert list(store.entry_keys()) == []
        assert store.entry_partitions() == []

    def test_store_then_fetch_round_trips_and_another_handle_sees_it(
        self, store: Store, open_store: Callable[..., Store]
    ) -> None:
        items = {f"key-{i}": b"entry %d " % i * (i + 1) for i in range(3)}
        store.store([request(key, data) for key, data in items.items()], TTL)
        assert store.fetch(["key-1", "missing", "key-2"], TTL) == {"key-1": items["key-1"], "key-2": items["key-2"]}
        assert open_store(partition=PARTITION).fetch(list(items), None) == items
        store.store([request("key-0", b"second")], TTL)
        assert store.fetch(["key-0"], TTL) == {"key-0": b"second"}  # stored again: replaced
        assert sorted(raw.cache_key for raw in store.scan_entries()) == sorted(items)

    def test_any_key_is_its_own_and_comes_back_as_it_was(self, store: Store) -> None:
        store.put_entries([WriteItem(key, key.encode() * 2, None, TTL) for key in ODD_KEYS])
        assert store.get_entries(ODD_KEYS) == {key: key.encode() * 2 for key in ODD_KEYS}
        assert sorted(raw.cache_key for raw in store.scan_entries()) == sorted(ODD_KEYS)
        assert store.find_keys("../", 5) == ["../../escape"]
        assert store.get_entries(["escape", "../escape", "a/b"]) == {}

    def test_an_entry_over_the_bound_is_its_size_unread(self, open_store: Callable[..., Store]) -> None:
        store = open_store(partition=PARTITION, max_entry_bytes=1000)
        sizes = {"small": 10, "exact": 1000, "over": 1001, "far-over": 5000}
        store.put_entries([WriteItem(key, b"e" * size, None, TTL) for key, size in sizes.items()])
        expected = {
            "small": b"e" * 10,
            "exact": b"e" * 1000,
            "over": TooLarge(1001, 1000),
            "far-over": TooLarge(5000, 1000),
        }
        assert store.fetch([*sizes, "missing"], TTL) == expected
        assert store.fetch(list(sizes), None) == expected
        assert store.get_entries(list(sizes)) == expected
        assert {raw.cache_key: raw.data for raw in store.scan_entries()} == expected
        assert {raw.cache_key: raw.data for raw in store.scan_entries(with_ttl=False)} == expected

    # -- expiry -----------------------------------------------------------------------------------
    def test_entries_expire_by_the_calls_ttl_or_their_own(self, store: Store) -> None:
        store.store([request("short", b"short"), request("own", b"own", ttl=1)], 1)
        store.store([request("own-ttl", b"own", ttl=1), request("kept", b"kept")], TTL)
        assert set(store.get_entries(["short", "own", "own-ttl", "kept"])) == {"short", "own", "own-ttl", "kept"}
        # Polled without refreshing (get_entries); past a second and a little, whatever the store's resolution.
        assert wait_until(lambda: set(store.get_entries(["short", "own", "own-ttl", "kept"])) == {"kept"}, 5)
        assert store.fetch(["short", "own-ttl", "kept"], TTL) == {"kept": b"kept"}
        assert [raw.cache_key for raw in store.scan_entries()] == ["kept"]
        assert [key for _, key in store.entry_keys()] == ["kept"]
        assert store.find_keys("") == ["kept"]

    def test_a_fetch_with_a_ttl_refreshes_it_and_one_without_does_not(self, store: Store) -> None:
        store.store([request("k", b"v"), request("other", b"v")], 60)
        ttls = entry_ttls(store)
        assert all(0 < ttl <= 60 for ttl in ttls.values()), ttls
        assert store.fetch(["k", "other"], None) and store.get_entries(["k"])
        assert all(0 < ttl <= 60 for ttl in entry_ttls(store).values())  # reading only keeps the TTL
        assert store.fetch(["k"], TTL) == {"k": b"v"}
        ttls = entry_ttls(store)
        assert TTL - 60 < ttls["k"] <= TTL and ttls["other"] <= 60
        store.refresh_ttls([("other", 2 * TTL), ("missing", TTL)])
        ttls = entry_ttls(store)
        assert 2 * TTL - 60 < ttls["other"] <= 2 * TTL
        assert store.get_entries(["missing"]) == {}  # refreshing is no store

    # -- scans and administration -----------------------------------------------------------------
    def test_put_get_find_scan_and_delete(self, store: Store) -> None:
        keys = [f"{prefix}-{i}" for prefix in ("aa", "ab", "b") for i in range(4)]
        store.put_entries([WriteItem(key, key.encode(), f"digest-{key}", TTL) for key in keys])
        assert store.get_entries(keys) == {key: key.encode() for key in keys}
        scan = store.scan_entries()
        assert iter(scan) is scan  # streamed, not a list made first
        assert {raw.cache_key: (raw.data, raw.partition) for raw in scan} == {k: (k.encode(), PARTITION) for k in keys}
        assert sorted(store.find_keys("a", limit=100)) == sorted(k for k in keys if k.startswith("a"))
        assert sorted(store.find_keys("ab")) == [f"ab-{i}" for i in range(4)]
        assert len(store.find_keys("a", limit=3)) == 3
        assert sorted(store.entry_keys()) == sorted((PARTITION, key) for key in keys)
        store.delete_entries(["aa-0", "b-1", "never-stored"])
        assert set(store.get_entries(keys)) == set(keys) - {"aa-0", "b-1"}
        assert "aa-0" not in store.find_keys("aa")
        assert store.expired_count() == (0, 0)

    def test_partitions_keep_entries_and_leases_apart(self, store: Store) -> None:
        store.store([request("shared-key", b"one")], TTL)
        other = store.in_partition(OTHER_PARTITION)
        assert other.partition == OTHER_PARTITION and store.partition == PARTITION
        assert other.fetch(["shared-key"], TTL) == {} and other.get_entries(["shared-key"]) == {}
        assert list(other.scan_entries()) == [] and other.find_keys("shared") == []
        other.store([request("shared-key", b"two")], TTL)
        assert store.fetch(["shared-key"], TTL) == {"shared-key": b"one"}
        assert other.fetch(["shared-key"], TTL) == {"shared-key": b"two"}
        assert store.entry_partitions() == sorted([PARTITION, OTHER_PARTITION])
        assert sorted(store.entry_keys()) == [(PARTITION, "shared-key"), (OTHER_PARTITION, "shared-key")]
        assert store.acquire_lease("shared-key", "me", 30) and other.acquire_lease("shared-key", "you", 30)
        assert (store.lease_holder("shared-key"), other.lease_holder("shared-key")) == ("me", "you")
        other.delete_entries(["shared-key"])
        assert store.fetch(["shared-key"], None) == {"shared-key": b"one"}
        assert store.entry_partitions() == [PARTITION]

    def test_read_only_refuses_writes(self, store: Store, open_read_only: Callable[..., Store] | None) -> None:
        if open_read_only is None:
            pytest.skip("this store is not opened read-only")
        store.store([request("k", b"v")], TTL)
        reader = open_read_only(partition=PARTITION)
        assert reader.fetch(["k"], None) == {"k": b"v"}
        with pytest.raises(NkiCacheError):
            reader.put_entries([WriteItem("new", b"v", None, TTL)])
        with pytest.raises(NkiCacheError):
            reader.delete_entries(["k"])
        assert store.get_entries(["k", "new"]) == {"k": b"v"}

    # -- the variant index ------------------------------------------------------------------------
    def test_the_variant_index_keeps_what_each_store_set(self, store: Store) -> None:
        store.store([request("k1", b"v", "softmax", index_fields={b"k tag": b"1", b"h \x00\xff": b"tag"})], TTL)
        store.store([request("k2", b"v", "matmul", index_fields={b"k tag": b"2"})], TTL)
        answers = store.read_variant_index(
            [("softmax", [b"k tag", b"h \x00\xff", b"unset"]), ("matmul", [b"k tag"]), ("never-stored", [b"k tag"])]
        )
        assert answers == [[b"1", b"tag", None], [b"2"], [None]]
        store.store([request("k3", b"v", "softmax", index_fields={b"k tag": b"3"})], TTL)
        assert store.read_variant_index([("softmax", [b"k tag"])]) == [[b"3"]]

    # -- leases -----------------------------------------------------------------------------------
    def test_a_lease_is_exclusive_and_released_or_renewed_only_by_its_owner(self, store: Store) -> None:
        assert store.lease_holder("k") is None
        assert store.acquire_lease("k", "w1", 30) is True
        assert store.acquire_lease("k", "w2", 30) is False
        assert store.acquire_lease("k", "w1", 30) is False  # not re-entrant
        assert store.lease_holder("k") == "w1"
        assert store.renew_lease("k", "w2", 30) is False and store.lease_holder("k") == "w1"
        assert store.renew_lease("k", "w1", 60) is True
        store.release_lease("k", "w2")
        assert store.lease_holder("k") == "w1"
        store.release_lease("k", "w1")
        assert store.lease_holder("k") is None and store.renew_lease("k", "w1", 30) is False
        assert store.acquire_lease("a", "w1", 30) and store.acquire_lease("b", "w2", 30)
        store.release_leases([("a", "w1"), ("b", "not-w2")])
        assert (store.lease_holder("a"), store.lease_holder("b")) == (None, "w2")

    def test_a_lease_expires_and_its_late_holder_cannot_touch_the_next(self, store: Store) -> None:
        assert store.acquire_lease("k", "dead", 0.3)
        assert store.renew_lease("k", "dead", 0.3)
        assert wait_until(lambda: store.lease_holder("k") is None, 3)
        assert store.renew_lease("k", "dead", 30) is False  # expired: not renewed back to life
        assert store.acquire_lease("k", "next", 30) is True
        store.release_lease("k", "dead")
        assert store.renew_lease("k", "dead", 30) is False
        assert store.lease_holder("k") == "next"

    def test_an_expired_lease_is_taken_over_by_exactly_one_contender(
        self, store: Store, open_store: Callable[..., Store]
    ) -> None:
        for round_ in range(3):
            key = f"k{round_}"
            assert store.acquire_lease(key, "dead", 0.2)
            assert wait_until(partial(lease_free, store, key), 3)
            won = contend_at_once([open_store(partition=PARTITION) for _ in range(6)], key)
            assert len(won) == 1, won
            assert store.lease_holder(key) == won[0]

    # -- fleet metrics ----------------------------------------------------------------------------
    def test_metrics_apply_once_by_batch_id_and_fold(self, store: Store, open_store: Callable[..., Store]) -> None:
        usage = {"k1": KeyUsage("softmax", 3, 100.0, 110.0), "k2": KeyUsage("matmul", 1, 101.0, 101.0)}
        first = usage_batch("pass-1", "host-a", "w1", usage, passes=1, traces=2, compile_seconds=0.25)
        second = usage_batch(
            "pass-22", "host-b", "w7", {"k1": KeyUsage("softmax", 2, 90.0, 105.0)}, passes=1, traces=1, cache_hits=4
        )
        second.toolchain = ""  # names no toolchain: counted in the fleet's and the worker's totals only
        assert store.apply_metrics(first) is True
        assert store.apply_metrics(first) is False
        assert open_store(partition=PARTITION).apply_metrics(first) is False  # once per store, not per handle
        assert store.apply_metrics(second) is True and store.apply_metrics(second) is False
        assert store.totals() == pytest.approx({"passes": 2, "traces": 3, "compile_seconds": 0.25, "cache_hits": 4})
        workers = {(host, worker): totals for host, worker, totals in store.workers()}
        assert workers == {("host-a", "w1"): first.totals, ("host-b", "w7"): second.totals}
        assert store.toolchains() == {TOOLCHAIN: first.totals}
        assert store.kernels() == {
            "softmax": {"call_count": 5, "variants": 1},
            "matmul": {"call_count": 1, "variants": 1},
        }
        assert dict(store.key_usage()) == {"k1": 5, "k2": 1} and store.key_count() == 2
        records = store.key_records(["k1", "k2", "never"])
        assert set(records) == {"k1", "k2"}
        assert (records["k1"].kernel_name, records["k1"].usage, records["k1"].first_use, records["k1"].last_use) == (
            "softmax",
            5,
            90.0,
            110.0,
        )
        assert store.key_hosts(["k1", "k2", "never"]) == {"k1": ["host-a", "host-b"], "k2": ["host-a"]}
        assert first.pass_record is not None and second.pass_record is not None
        log = list(store.pass_log(None))
        assert [record for _, record in log] == [first.pass_record, second.pass_record]
        assert [when for when, _ in log] == [first.pass_record["finished"], second.pass_record["finished"]]
        assert store.pass_log_span(None) == (first.pass_record["finished"], second.pass_record["finished"])
        assert store.pass_log_span(time.time() + 3600) is None and list(store.pass_log(time.time() + 3600)) == []

    def test_zeroing_clears_the_counters_and_keeps_usage_and_the_log(self, store: Store) -> None:
        store.apply_metrics(usage_batch("pass-1", "h", "w", {"k": KeyUsage("softmax", 2, 1.0, 2.0)}, traces=2))
        store.zero_counters({"zeroed": True, "finished": 2000.0})
        assert store.totals() == {} and list(store.workers()) == [] and store.toolchains() == {}
        assert dict(store.key_usage()) == {"k": 2} and store.kernels()["softmax"]["call_count"] == 2
        assert [record for _, record in store.pass_log(None)][-1] == {"zeroed": True, "finished": 2000.0}
        store.apply_metrics(usage_batch("pass-2", "h", "w", {"k": KeyUsage("softmax", 1, 3.0, 4.0)}, traces=1))
        assert store.totals() == {"traces": 1} and dict(store.key_usage()) == {"k": 3}

    def test_an_invalid_batch_is_refused_whole_and_its_id_stays_free(self, store: Store) -> None:
        bad = usage_batch("pass-1", "h", "w", {"k": KeyUsage("softmax", 1, 1.0, 1.0)}, traces=float("nan"))
        with pytest.raises(BatchRefused):
            store.apply_metrics(bad)
        assert store.totals() == {} and list(store.key_usage()) == [] and list(store.pass_log(None)) == []
        good = usage_batch("pass-1", "h", "w", {"k": KeyUsage("softmax", 1, 1.0, 1.0)}, traces=1)
        assert store.apply_metrics(good) is True and store.totals() == {"traces": 1}
