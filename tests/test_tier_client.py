"""TierClient over the embedded tier and fakeredis: verified reads, rejections counted, the circuit breaker,
the bounded outbox, and metrics held through an outage delivered exactly once."""

from __future__ import annotations

import collections
import hashlib
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers_entries import old_reference, payload_of
from helpers_graphs import TierView, local_or_fake_backend, wait_until

from bridge.port import PassRecord
from cachestore.api import KeyUsage, MetricsBatch, TierTimeout, TierUnavailable, batch_problem
from cachestore.backends.redis import RedisBackend
from cachestore.backends.sqlite import SqliteBackend
from cachestore.client import TierClient
from cachestore.entry import Entry, SignaturePolicy, decode_entry, encode_entry
from cachestore.settings import Settings

KEY = b"fleet-key-0123456789abcdef"
OTHER_KEY = b"another-key-0123456789abcd"
BINARY = b"\x00BIR" + bytes(range(200)) + b"MARKER-IN-THE-BINARY" + bytes(50)


@pytest.fixture(params=["local", "fakeredis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SqliteBackend | RedisBackend]:
    tier = local_or_fake_backend(request.param, tmp_path)
    yield tier
    tier.close()


class FlakyBackend:
    """A backend that fails on demand: while `down`, for the next `fail[method]` calls, or (for metrics)
    after applying a batch but before answering, as when a reply is lost."""

    def __init__(self, inner: SqliteBackend | RedisBackend):
        self.inner = inner
        self.value_ttls = inner.value_ttls  # the store's declared ability, as its own
        self.down = False
        self.error: type[Exception] = TierUnavailable
        self.fail: collections.Counter = collections.Counter()
        self.lose_replies = 0
        self.calls: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def _gate(self, method: str) -> None:
        with self._lock:
            self.calls[method] += 1
            if self.down:
                raise self.error(f"{method}: the tier is down")
            if self.fail[method] > 0:
                self.fail[method] -= 1
                raise self.error(f"{method}: failing on purpose")

    def fetch(self, cache_keys, ttl):
        self._gate("fetch")
        return self.inner.fetch(cache_keys, ttl)

    def store(self, requests, ttl):
        self._gate("store")
        self.inner.store(requests, ttl)

    def apply_metrics(self, batch):
        self._gate("apply_metrics")
        applied = self.inner.apply_metrics(batch)
        with self._lock:
            if self.lose_replies > 0:
                self.lose_replies -= 1
                raise TierTimeout("applied, but the reply was lost")
        return applied

    def acquire_lease(self, cache_key, owner, ttl):
        self._gate("acquire_lease")
        return self.inner.acquire_lease(cache_key, owner, ttl)

    def release_lease(self, cache_key, owner):
        self._gate("release_lease")
        self.inner.release_lease(cache_key, owner)

    def release_leases(self, leases):
        self._gate("release_lease")
        self.inner.release_leases(leases)

    def lease_holder(self, cache_key):
        self._gate("lease_holder")
        return self.inner.lease_holder(cache_key)

    def refresh_ttls(self, items):
        self._gate("refresh_ttls")
        self.inner.refresh_ttls(items)

    def scan_entries(self):
        self._gate("scan_entries")
        return self.inner.scan_entries()

    def ping(self):
        self._gate("ping")

    def close(self):
        pass


def settings(**changes) -> Settings:
    base = {"tier": "test", "host": "host-a", "worker": "w1", "breaker_cooldown": 0.3, "flush_interval": 0.05}
    return Settings(**{**base, **changes})


def client_for(backend, **changes) -> TierClient:
    return TierClient(lambda: backend, settings(**changes), "test tier")


def make_entry(binary: bytes = BINARY, shape: int = 64) -> Entry:
    return Entry(
        binary=binary,
        input_names=["lhsT", "rhs"],
        output_names=["out"],
        format="bir",
        version_identifier="bir-1",
        key_components={"kernel_name": "matmul_tiled", "operands": {"shapes": [[shape, 32]], "dtypes": ["float32"]}},
        producer_host="host-a",
        producer_worker="w1",
        created=1_700_000_000.5,
        compile_seconds=0.25,
    )


def counts(client: TierClient) -> dict[str, int]:
    return client.stats.snapshot()


# -- verified reads -----------------------------------------------------------------------------------
def test_read_through_returns_the_verified_entry(backend) -> None:
    writer = client_for(backend)
    writer.publish("key-1", make_entry())
    assert writer.flush(timeout=5) is True
    reader = client_for(backend, worker="w2")
    found = reader.lookup("key-1")
    assert found == make_entry() and found.binary == BINARY
    assert reader.lookup("missing") is None
    assert counts(reader) == {**dict.fromkeys(counts(reader), 0), "entries_found": 1}  # one found, no fault
    writer.close()
    reader.close()


def test_signed_entries_between_clients(backend) -> None:
    writer = client_for(backend, hmac_key=KEY)
    writer.publish("key-1", make_entry())
    assert writer.flush(timeout=5)
    same_key = client_for(backend, hmac_key=KEY)
    assert same_key.lookup("key-1").signed is True
    no_key = client_for(backend)
    assert no_key.lookup("key-1") == make_entry()  # no key: accepted on its digest, and counted
    assert counts(no_key)["tier_unverified"] == 1 and counts(same_key)["tier_unverified"] == 0
    strict = client_for(backend, reject_unverifiable=True)
    assert strict.lookup("key-1") is None and counts(strict)["tier_rejected"] == 1
    wrong_key = client_for(backend, hmac_key=OTHER_KEY)
    assert wrong_key.lookup("key-1") is None and counts(wrong_key)["tier_rejected"] == 1
    writer.close()


def test_a_binary_stored_under_another_key_is_stored_whole_again(backend) -> None:
    client = client_for(backend, hmac_key=KEY)
    client.publish("key-1", make_entry(shape=64))
    assert client.flush(timeout=5)
    client.publish("key-2", make_entry(shape=128))  # another key, the same binary
    assert client.flush(timeout=5)
    stored = decode_entry(TierView.of(backend).raw("key-2"), SignaturePolicy(KEY))  # compressed: decode to look
    assert stored.binary == BINARY
    found = client_for(backend, hmac_key=KEY).lookup("key-2")
    assert found.binary == BINARY and found.key_components == make_entry(shape=128).key_components
    client.close()


def _with_schema(data: bytes, schema: int) -> bytes:
    return data[:3] + bytes([schema]) + data[4:]


def _flip_binary_byte(data: bytes) -> bytes:
    forged = bytearray(data)
    forged[-len(payload_of(data)) // 2] ^= 0x01  # in the compressed payload, where the binary is
    return bytes(forged)


CORRUPTIONS = {
    "garbage": lambda good, signed: b"\xde\xad\xbe\xef not an entry",
    "truncated": lambda good, signed: good[: len(good) // 2],
    "truncated-by-one": lambda good, signed: good[:-1],
    "forged-binary": lambda good, signed: _flip_binary_byte(good),
    "wrong-version": lambda good, signed: _with_schema(good, 99),
    "wrongly-signed": lambda good, signed: encode_entry(make_entry(), OTHER_KEY),
    "unsigned": lambda good, signed: encode_entry(make_entry()),
    "pickle": lambda good, signed: __import__("pickle").dumps(make_entry()),
    "empty": lambda good, signed: b"",
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_bad_entries_are_rejected_and_counted(backend, corruption: str) -> None:
    client = client_for(backend, hmac_key=KEY)
    good = encode_entry(make_entry(), KEY)
    TierView.of(backend).put_raw("bad-key", CORRUPTIONS[corruption](good, True))
    assert client.lookup("bad-key") is None
    # A writer's hit on Redis reads one GETRANGE, which tells an empty value from no key no more than Redis does:
    # an empty value there is a plain miss (tests/test_hit_path.py), elsewhere a rejected entry.
    empty_is_a_miss = corruption == "empty" and isinstance(backend, RedisBackend)
    assert counts(client)["tier_rejected"] == (0 if empty_is_a_miss else 1)
    assert counts(client)["tier_errors"] == 0 and counts(client)["tier_timeouts"] == 0
    TierView.of(backend).put_raw("bad-key", good)
    assert client.lookup("bad-key") == make_entry()  # the same key, intact, is read again
    assert counts(client)["tier_rejected"] == (0 if empty_is_a_miss else 1)


def test_an_older_builds_reference_entry_is_rejected_and_never_followed(backend) -> None:
    """Builds with content dedupe stored an entry whose binary another key held as a reference to that key.
    It is a miss, counted as rejected with its cause, and the key it names is never read."""
    view = TierView.of(backend)
    view.put_raw("holder", encode_entry(make_entry(), KEY))  # the very binary, intact
    view.put_raw("ref", old_reference(make_entry(), "holder", KEY))
    client = client_for(backend, hmac_key=KEY)
    fetched: list[list[str]] = []
    fetch = backend.fetch
    backend.fetch = lambda keys, ttl: fetched.append(list(keys)) or fetch(keys, ttl)
    reasons: list[str] = []
    reject = client.reject
    client.reject = lambda key, reason: reasons.append(reason) or reject(key, reason)
    try:
        assert client.lookup("ref") is None
        assert client.find_many(["ref"]) == ({}, {"ref"})  # held, but nothing served
    finally:
        del backend.fetch
    assert fetched == [["ref"], ["ref"]]  # never "holder"
    assert counts(client)["tier_rejected"] == 2 and counts(client).get("entries_found", 0) == 0
    assert reasons == ["entry is a reference to another key's binary (an older build's dedupe): not followed"] * 2
    assert client.lookup("holder") == make_entry()  # the entry that holds the binary is served as ever


def test_entries_over_the_size_limit_are_rejected(backend) -> None:
    # An incompressible binary: its body is no larger than its stored form, which is what the limit is about
    # (a body that decompresses past the limit is refused too: tests/test_entry.py).
    binary = random.Random(7).randbytes(4096)
    data = encode_entry(make_entry(binary))
    TierView.of(backend).put_raw("big", data)
    small = client_for(backend, max_entry_bytes=len(data) - 1)
    assert small.lookup("big") is None and counts(small)["tier_rejected"] == 1
    assert client_for(backend, max_entry_bytes=len(data)).lookup("big") == make_entry(binary)


def test_entries_over_the_size_limit_are_not_written(backend) -> None:
    client = client_for(backend, max_entry_bytes=100)
    client.publish("big", make_entry())
    assert client.flush(timeout=5)
    assert TierView.of(backend).raw("big") is None


# -- the circuit breaker ------------------------------------------------------------------------------
@pytest.mark.parametrize(("error", "counter"), [(TierUnavailable, "tier_errors"), (TierTimeout, "tier_timeouts")])
def test_breaker_opens_skips_then_retries(backend, error: type[Exception], counter: str) -> None:
    flaky = FlakyBackend(backend)
    client = client_for(flaky, breaker_cooldown=0.3)
    client.publish("key-1", make_entry())
    assert client.flush(timeout=5)

    flaky.down, flaky.error = True, error
    started = time.monotonic()
    assert client.lookup("key-1") is None
    assert flaky.calls["fetch"] == 1 and counts(client)[counter] == 1
    other = "tier_timeouts" if counter == "tier_errors" else "tier_errors"
    assert counts(client)[other] == 0 and counts(client)["tier_rejected"] == 0

    for _ in range(5):  # during the cool-down the tier is not asked at all
        assert client.lookup("key-1") is None
    assert flaky.calls["fetch"] == 1 and counts(client)["tier_skipped"] == 5
    assert client.acquire_lease("key-1") is True  # cannot ask: trace
    assert flaky.calls["acquire_lease"] == 0

    flaky.down = False
    assert wait_until(lambda: client.lookup("key-1") is not None, timeout=5)
    assert time.monotonic() - started >= 0.3
    assert flaky.calls["fetch"] == 2 and counts(client)[counter] == 1
    client.close()


def test_an_unreachable_tier_at_start_is_retried_after_the_cooldown(backend) -> None:
    attempts = []

    def factory():
        attempts.append(time.monotonic())
        if len(attempts) == 1:
            raise TierUnavailable("connection refused")
        return backend

    TierView.of(backend).put_raw("k", encode_entry(make_entry()))
    client = TierClient(factory, settings(breaker_cooldown=0.2))
    assert client.lookup("k") is None and counts(client)["tier_errors"] == 1
    assert client.lookup("k") is None and len(attempts) == 1  # not even connecting during the cool-down
    assert wait_until(lambda: client.lookup("k") is not None, timeout=3)
    assert len(attempts) == 2 and attempts[1] - attempts[0] >= 0.2
    assert counts(client)["tier_errors"] == 1
    client.close()


# -- the outbox ---------------------------------------------------------------------------------------
def test_the_outbox_is_bounded_and_drops_are_counted(backend) -> None:
    flaky = FlakyBackend(backend)
    client = client_for(flaky, outbox_limit=5, breaker_cooldown=0.5)
    flaky.down = True
    assert client.lookup("x") is None  # opens the breaker
    for i in range(12):
        client.publish(f"key-{i}", make_entry(b"binary-%d" % i))
    assert client.pending() == 5
    assert counts(client)["tier_dropped"] == 7
    assert client.flush(timeout=0.2) is False  # the tier is down: a flush does not wait

    flaky.down = False
    assert client.flush(timeout=10, through_outage=True) is True
    view = TierView.of(backend)
    assert [i for i in range(12) if view.raw(f"key-{i}") is not None] == [7, 8, 9, 10, 11]  # the newest kept
    assert counts(client)["tier_dropped"] == 7
    client.close()


def test_close_counts_what_it_could_not_deliver(backend) -> None:
    flaky = FlakyBackend(backend)
    client = client_for(flaky, breaker_cooldown=30)
    flaky.down = True
    client.publish("a", make_entry())
    client.record(MetricsBatch("b1", "host-a", "w1", {"passes": 1}))
    assert wait_until(lambda: counts(client)["tier_errors"] >= 1, timeout=5)
    started = time.monotonic()
    client.close(timeout=5)  # the breaker stays open past the deadline: no point waiting
    assert time.monotonic() - started < 2
    assert counts(client)["tier_dropped"] == 2 and client.pending() == 0


def test_close_does_not_wait_out_the_cooldown_of_a_tier_that_refused_every_connection(backend) -> None:
    """Down from the start (Redis not running): the breaker would let a retry through within close()'s deadline,
    but a tier that was never there is not waited for, so the exit is not late by a cooldown (a paused server,
    which takes calls and times out, is: test_tier_faults' slow Redis)."""
    flaky = FlakyBackend(backend)
    flaky.down = True
    client = client_for(flaky, breaker_cooldown=0.5, final_flush_timeout=5)
    client.publish("a", make_entry())
    assert wait_until(lambda: counts(client)["tier_errors"] >= 1, timeout=5)
    attempts = flaky.calls["store"]
    client.close()
    assert flaky.calls["store"] == attempts  # no retry after the cooldown
    assert counts(client)["tier_dropped"] == 1 and client.pending() == 0


def test_close_waits_no_longer_than_final_flush_timeout_for_a_tier_that_hangs(backend) -> None:
    """A tier that takes a send and does not answer (frozen, trickling): close() gives up at its deadline, the
    flush and the flusher's stop together, and the send left under way closes the backend when it ends."""
    sending, released = threading.Event(), threading.Event()

    class HangingBackend(FlakyBackend):
        def store(self, requests, ttl):
            sending.set()
            released.wait(10)
            super().store(requests, ttl)

    client = client_for(HangingBackend(backend), final_flush_timeout=1.0)
    client.publish("a", make_entry())
    assert sending.wait(5)  # the flusher is inside the send
    started = time.monotonic()
    client.close()
    took = time.monotonic() - started
    released.set()
    assert took < 1.5, took  # it waited the flush's 1 s and then up to 3 s more for the flusher


def test_a_write_after_close_is_dropped_and_counted_and_starts_no_flusher(backend) -> None:
    """A publish, a lease release or a metrics batch after close(): nothing goes out on the closed backend (a
    flusher started again would send there, from a daemon thread the process may kill mid-write)."""
    client = client_for(backend)
    client.publish("before", make_entry())
    assert client.acquire_lease("after")
    client.close()
    threads = threading.active_count()
    client.publish("after", make_entry())
    client.release_lease("after")
    client.record(MetricsBatch("b-after", "host-a", "w1", {"passes": 1}))
    assert counts(client)["tier_dropped"] == 3 and client.pending() == 0
    assert threading.active_count() == threads and not client._outbox.thread.is_alive()
    view = TierView.of(backend)
    assert view.raw("before") is not None and view.raw("after") is None


def test_writes_keep_their_order_through_failures(backend) -> None:
    flaky = FlakyBackend(backend)
    client = client_for(flaky, breaker_cooldown=0.1)
    assert client.acquire_lease("key-1") is True
    flaky.fail["store"] = 2
    client.publish("key-1", make_entry(), release_lease=True)
    assert client.flush(timeout=10, through_outage=True)
    assert flaky.calls["store"] == 3
    assert backend.lease_holder("key-1") is None  # released only after the entry was stored
    assert client.lookup("key-1") == make_entry()
    client.close()


def test_a_run_of_entries_and_lease_releases_goes_in_two_round_trips(backend) -> None:
    flaky = FlakyBackend(backend)
    client = client_for(flaky, breaker_cooldown=0.1)
    keys = [f"key-{i}" for i in range(10)]
    assert all(client.acquire_lease(key) for key in keys)
    flaky.down = True  # the writes queue up behind an outage, as they do behind a slow round trip
    for i, key in enumerate(keys):
        client.publish(key, make_entry(shape=i + 1), release_lease=True)
    assert wait_until(lambda: flaky.calls["store"] >= 1, timeout=5)
    flaky.down = False
    stores_before = flaky.calls["store"]
    assert client.flush(timeout=10, through_outage=True)
    assert flaky.calls["store"] - stores_before == 1 and flaky.calls["release_lease"] == 1  # not one per trace
    assert all(backend.lease_holder(key) is None for key in keys)
    assert all(client.lookup(key) == make_entry(shape=i + 1) for i, key in enumerate(keys))
    client.close()


# -- metrics through an outage ------------------------------------------------------------------------
def pass_batch(i: int) -> MetricsBatch:
    totals = {"passes": 1, "kernels": 3 + i, "cache_hits": i, "cache_misses": 3, "traces": 3 - i % 2,
              "compile_seconds": 0.5 * i}  # fmt: skip
    keys = {f"key-{i % 2}": KeyUsage("matmul_tiled", 2 + i, 100.0 + i, 101.0 + i)}
    record = {"pass_id": f"pass-{i}", **totals}
    return MetricsBatch(f"pass-{i}", "host-a", "w1", totals, {"matmul_tiled": 2 + i}, keys, record)


def expected_totals(batches: list[MetricsBatch]) -> dict[str, float]:
    summed: dict[str, float] = collections.defaultdict(float)
    for item in batches:
        for name, value in item.totals.items():
            summed[name] += value
    return dict(summed)


@pytest.mark.parametrize("failure", ["errors", "timeouts", "lost-replies"])
def test_metrics_held_during_an_outage_are_delivered_exactly_once(backend, failure: str) -> None:
    flaky = FlakyBackend(backend)
    client = client_for(flaky, breaker_cooldown=0.1)
    batches = [pass_batch(i) for i in range(4)]
    if failure == "lost-replies":
        flaky.lose_replies = 3  # applied each time, but the client hears a timeout and retries
    else:
        flaky.error = TierTimeout if failure == "timeouts" else TierUnavailable
        flaky.fail["apply_metrics"] = 3
    for item in batches:
        client.record(item)
    assert client.flush(timeout=15, through_outage=True) is True
    view = TierView.of(backend)
    assert view.totals() == pytest.approx(expected_totals(batches))
    assert view.kernel_calls() == {"matmul_tiled": sum(2 + i for i in range(4))}
    assert view.variants() == {"matmul_tiled": 2}
    assert [record["pass_id"] for record in view.pass_log()] == [f"pass-{i}" for i in range(4)]
    assert flaky.calls["apply_metrics"] == 4 + 3
    failures = counts(client)["tier_timeouts"] + counts(client)["tier_errors"]
    assert failures == 3 and counts(client)["tier_dropped"] == 0
    client.close()


def test_close_waits_for_a_tier_that_answered_before_to_return(backend) -> None:
    flaky = FlakyBackend(backend)
    client = client_for(flaky, breaker_cooldown=0.2)
    assert client.lookup("k") is None  # it answered (a miss): its outage may be a blip, worth waiting out
    flaky.down = True
    batches = [pass_batch(i) for i in range(3)]
    for item in batches:
        client.record(item)
    assert wait_until(lambda: counts(client)["tier_errors"] >= 1, timeout=5)
    threading.Timer(0.5, lambda: setattr(flaky, "down", False)).start()
    client.close(timeout=10)
    assert TierView.of(backend).totals() == pytest.approx(expected_totals(batches))
    assert counts(client)["tier_dropped"] == 0


# -- batches no tier would take -----------------------------------------------------------------------
NAN = float("nan")
POISONS = {
    "nan-compile-seconds": lambda b: b.totals.update(compile_seconds=NAN),
    "infinite-last-use": lambda b: setattr(b.keys["key-1"], "last_use", float("inf")),
    "text-kernel-calls": lambda b: b.kernel_calls.update(matmul_tiled="4"),
    "bool-usage": lambda b: setattr(b.keys["key-1"], "usage", True),
    "nan-in-the-pass-record": lambda b: b.pass_record.update(finished=NAN),
}


@pytest.mark.parametrize("poison", POISONS)
def test_a_batch_with_a_bad_number_is_dropped_counted_and_later_batches_arrive(backend, poison, caplog) -> None:
    flaky = FlakyBackend(backend)
    client = client_for(flaky)
    bad = pass_batch(1)  # its one key is key-1
    POISONS[poison](bad)
    good = [pass_batch(0), pass_batch(2)]
    for item in (good[0], bad, good[1]):
        client.record(item)
    assert client.flush(timeout=10) is True
    view = TierView.of(backend)
    assert view.totals() == pytest.approx(expected_totals(good))
    assert [record["pass_id"] for record in view.pass_log()] == ["pass-0", "pass-2"]
    assert flaky.calls["apply_metrics"] == 2  # never sent
    dropped, errors, applied = (counts(client)[name] for name in ("tier_dropped", "tier_errors", "metrics_applied"))
    assert (dropped, errors, applied) == (1, 0, 2)
    assert [r.getMessage() for r in caplog.records if "pass-1" in r.getMessage()] == [
        f"metrics batch pass-1 not sent to tier test tier: {batch_problem(bad)}"
    ]
    client.close()


def test_a_pass_record_with_a_nan_is_dropped_not_sent(backend) -> None:
    flaky = FlakyBackend(backend)
    client = client_for(flaky)
    counts_of_pass = {"passes": 1, "kernels": 2, "compile_seconds": NAN}
    client.record_pass(PassRecord("g", "nan-pass", 1.0, 2.0, counts_of_pass))
    client.record_pass(PassRecord("g", "next-pass", 3.0, 4.0, {"passes": 1, "kernels": 3, "compile_seconds": 0.5}))
    assert client.flush(timeout=10) is True
    assert TierView.of(backend).totals() == {"passes": 1, "kernels": 3, "compile_seconds": 0.5}
    assert (flaky.calls["apply_metrics"], counts(client)["tier_dropped"]) == (1, 1)
    client.close()


def test_a_batch_the_tier_refuses_is_dropped_not_retried_and_the_breaker_stays_closed(backend, monkeypatch) -> None:
    """A client that lets a NaN through (an older one, say): the tier itself refuses the batch, writes none of it,
    and the client moves on to the batches behind it instead of retrying it behind an open breaker."""
    import cachestore.client

    monkeypatch.setattr(cachestore.client, "batch_problem", lambda batch: None)
    flaky = FlakyBackend(backend)
    client = client_for(flaky, breaker_cooldown=30)
    bad = pass_batch(1)
    bad.totals["compile_seconds"] = NAN
    good = [pass_batch(0), pass_batch(2)]
    for item in (good[0], bad, good[1]):
        client.record(item)
    assert client.flush(timeout=10) is True  # with the breaker open for 30 s it would give up at once
    assert TierView.of(backend).totals() == pytest.approx(expected_totals(good))
    assert flaky.calls["apply_metrics"] == 3  # the refused batch was sent once
    assert (counts(client)["tier_dropped"], counts(client)["tier_errors"], counts(client)["tier_timeouts"]) == (1, 0, 0)
    assert client.lookup("any-key") is None and counts(client)["tier_skipped"] == 0  # the tier is still asked
    client.close()
    assert counts(client)["tier_dropped"] == 1


# -- waiting on another worker's lease ----------------------------------------------------------------
def test_a_waiter_stops_at_a_rejected_entry_instead_of_recounting_it(backend) -> None:
    holder = client_for(backend, worker="holder")
    assert holder.acquire_lease("key-1")
    backend.store([_raw_request("key-1", b"not an entry")], 60)
    waiter = client_for(backend, worker="waiter", lease_wait=5.0)
    started = time.monotonic()
    assert waiter.wait_for_entry("key-1") is None
    assert time.monotonic() - started < 1.0  # did not wait out the lease
    assert counts(waiter)["tier_rejected"] == 1  # counted once, not once per poll


def test_a_holder_that_let_a_wait_run_out_is_not_waited_on_again(backend) -> None:
    dead = client_for(backend, worker="dead")
    assert dead.acquire_lease("key-1") and dead.acquire_lease("key-2")
    waiter = client_for(backend, worker="waiter", lease_wait=0.3)
    started = time.monotonic()
    assert waiter.wait_for_entry("key-1") is None
    first = time.monotonic() - started
    started = time.monotonic()
    assert waiter.wait_for_entry("key-2") is None
    assert first >= 0.3 and time.monotonic() - started < 0.2


def _raw_request(cache_key: str, data: bytes):
    from cachestore.api import StoreRequest

    return StoreRequest(cache_key, "d" * 64, data, "matmul_tiled")


def test_a_held_lease_is_renewed_while_its_holder_lives_and_lapses_when_it_stops(backend) -> None:
    holder = client_for(backend, worker="holder", lease_ttl=0.6)
    assert holder.acquire_lease("key-1")
    time.sleep(1.5)  # more than twice the TTL: only renewals keep it
    assert backend.lease_holder("key-1") == holder.owner
    holder._leases.stop()  # the holder dies: nothing renews its leases any more
    assert wait_until(lambda: backend.lease_holder("key-1") is None, timeout=3)
    holder.close(timeout=1)


def test_a_released_lease_is_no_longer_renewed(backend) -> None:
    holder = client_for(backend, worker="holder", lease_ttl=0.6)
    assert holder.acquire_lease("key-1")
    holder.release_lease("key-1")
    assert holder.flush(timeout=5)
    assert backend.lease_holder("key-1") is None and holder._leases.held() == set()
    other = client_for(backend, worker="other", lease_ttl=30)
    assert other.acquire_lease("key-1")
    time.sleep(0.5)  # a renewal by the first holder now would be refused: the lease is another's
    assert backend.lease_holder("key-1") == other.owner
    holder.close(timeout=1)
    other.close(timeout=1)


def test_the_compiling_thread_only_hands_the_trace_to_the_flusher(backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """publish_trace returns having hashed, compressed and encoded nothing: the binary's SHA-256 and the entry's
    encoding run on the flusher thread (issue 16: they cost the compile 17-46 ms a workload)."""
    import cachestore.client as client_module
    import cachestore.entry as entry_module

    threads: dict[str, set[str]] = {"digest": set(), "encode": set()}

    def recorded(name: str, function):
        def call(*args, **kwargs):
            threads[name].add(threading.current_thread().name)
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(entry_module, "binary_digest", recorded("digest", entry_module.binary_digest))
    monkeypatch.setattr(client_module, "encode_entry", recorded("encode", client_module.encode_entry))
    client = client_for(backend, hmac_key=KEY)
    result = {"binary": BINARY, "input_names": ["lhsT", "rhs"], "output_names": ["out"], "format": "bir"}
    client.publish_trace("key-1", result, {"kernel_name": "matmul_tiled"}, 0.5)
    assert client.flush(timeout=5)
    # Only the flusher: the calling thread's name would be in a set had it hashed or encoded anything.
    assert threads == {"digest": {"nkicache-tier-flusher"}, "encode": {"nkicache-tier-flusher"}}
    found = client_for(backend, hmac_key=KEY).lookup("key-1")
    assert found.binary == BINARY and found.digest == hashlib.sha256(BINARY).hexdigest() and found.signed
    client.close()


def test_releasing_a_lease_the_tier_never_granted_writes_nothing(backend) -> None:
    """A down tier cannot say who holds a lease, so its caller traces as the holder: at the end there is no
    lease to release, no write is queued, and none is counted as dropped."""
    flaky = FlakyBackend(backend)
    client = client_for(flaky, breaker_cooldown=600)
    flaky.fail["acquire_lease"] = 1
    assert client.acquire_lease("key-1") is True  # the tier could not say: trace it
    client.release_lease("key-1")
    assert client.pending() == 0
    client.close()
    assert counts(client)["tier_dropped"] == 0
