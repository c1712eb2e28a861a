"""The circuit breaker (cachestore/breaker.py) and what the tier client does with it: after a failure the tier
is left alone for the cooldown; a tier not proven yet is asked by one call at a time, and no other call waits
behind it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from cachestore.breaker import Breaker
from cachestore.client import TierClient
from cachestore.settings import load_settings
from cachestore.stores import open_tier


def test_a_new_store_is_asked_by_one_call_until_one_succeeds() -> None:
    ends: list[str] = []
    breaker = Breaker(cooldown=60, on_probe_end=lambda: ends.append("end"))
    probe = breaker.admit()
    assert probe is True
    assert breaker.admit() is None and not breaker.available()  # the others treat it as down meanwhile
    breaker.succeeded()
    breaker.done(probe)
    assert ends == ["end"]
    assert breaker.admit() is False and breaker.admit() is False  # proven: every call goes through, none probes
    assert breaker.available()


def test_a_probe_that_fails_opens_it_and_the_first_call_after_the_cooldown_probes_again() -> None:
    breaker = Breaker(cooldown=0.2)
    probe = breaker.admit()
    breaker.trip()
    breaker.done(bool(probe))
    assert breaker.is_open() and breaker.admit() is None and 0 < breaker.cooling <= 0.2
    assert not breaker.reopens_by(time.monotonic()) and breaker.reopens_by(time.monotonic() + 1)
    time.sleep(0.25)
    assert not breaker.is_open() and breaker.cooling == 0
    assert breaker.admit() is True and breaker.admit() is None  # unproven again: one call at a time


def test_a_failure_of_a_proven_store_opens_it_for_every_caller() -> None:
    breaker = Breaker(cooldown=60)
    breaker.done(bool(breaker.admit()))
    breaker.succeeded()
    breaker.trip()
    assert breaker.admit() is None and breaker.is_open()


@pytest.fixture
def frozen_address() -> Iterator[str]:
    """A loopback port that accepts connections (the kernel's backlog) and never answers: a frozen server."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


def test_no_lookup_waits_behind_another_on_a_tier_that_has_not_answered(frozen_address: str) -> None:
    """While one thread waits out op_timeout on a frozen tier, a lookup from another returns a miss at once,
    counted as skipped; then the first one's timeout opens the breaker for everyone."""
    settings = load_settings({"tier": frozen_address, "op_timeout": 3.0, "breaker_cooldown": 60})
    client = open_tier(settings)
    assert isinstance(client, TierClient)
    try:
        first = threading.Thread(target=client.lookup, args=["a" * 64])
        first.start()
        deadline = time.monotonic() + 2.5
        while client.available and time.monotonic() < deadline:  # the first lookup is under way
            time.sleep(0.005)
        started = time.monotonic()
        assert client.lookup("b" * 64) is None
        assert time.monotonic() - started < 1.0  # did not wait for the 3 s timeout
        assert client.counts()["tier_timeouts"] == 0 and client.stats.snapshot()["tier_skipped"] == 1
        first.join()
        assert client.counts()["tier_timeouts"] == 1 and not client.available  # the breaker is open now
    finally:
        client.close()


def test_an_index_read_that_times_out_opens_the_breaker(frozen_address: str) -> None:
    """The variant index is read like any other tier call: a timeout is counted and the tier is not asked
    again during the cooldown, so the pass's lookups that follow do not wait for a timeout of their own."""
    settings = load_settings({"tier": frozen_address, "op_timeout": 0.3, "breaker_cooldown": 60})
    client = open_tier(settings)
    assert isinstance(client, TierClient)
    try:
        components = {"kernel_name": "k", "operands": {}, "results": {}, "attrs": {}}
        assert client.variant_facts({"c" * 64: components}) is None
        assert client.counts()["tier_timeouts"] == 1 and not client.available
        started = time.monotonic()
        assert client.lookup("c" * 64) is None
        assert time.monotonic() - started < 0.2
    finally:
        client.close()
