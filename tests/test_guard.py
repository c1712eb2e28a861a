"""cachestore.guard: the one place a client's store calls are opened, admitted, counted and turned off."""

from __future__ import annotations

from collections import Counter

from cachestore.api import TierTimeout, TierUnavailable
from cachestore.breaker import Breaker
from cachestore.guard import Guard


class Store:
    value_ttls = False

    def __init__(self, failure: Exception | None = None) -> None:
        self.failure = failure

    def fetch(self, cache_keys: list[str], ttl: int | None) -> dict:
        if self.failure is not None:
            raise self.failure
        return {key: b"x" for key in cache_keys}


def guard_of(store: Store) -> tuple[Guard, Counter]:
    counts: Counter[str] = Counter()

    def open_store() -> Store:
        return store

    guard = Guard(open_store, Breaker(60.0), lambda name: counts.update([name]), "t")
    return guard, counts


def test_opening_is_not_the_store_answering() -> None:
    guard, counts = guard_of(Store())
    assert guard.store is None and guard.open() and guard.store is not None
    assert not guard.breaker.reachable  # a client object made proves nothing
    assert guard.call(lambda store: store.fetch(["k"], None), "lookup") == (True, {"k": b"x"})
    assert guard.breaker.reachable and counts == Counter()


def test_a_timeout_is_counted_and_turns_the_store_off_for_the_cooldown() -> None:
    guard, counts = guard_of(Store(TierTimeout("slow")))
    assert guard.call(lambda store: store.fetch(["k"], None), "lookup") == (False, None)
    assert counts == Counter(tier_timeouts=1) and guard.breaker.is_open() and guard.breaker.reachable
    assert guard.call(lambda store: store.fetch(["k"], None), "lookup") == (False, None)  # not asked: skipped
    assert counts == Counter(tier_timeouts=1, tier_skipped=1)


def test_a_store_that_is_down_is_an_error_not_reachable() -> None:
    guard, counts = guard_of(Store(TierUnavailable("refused")))
    assert guard.call(lambda store: store.fetch(["k"], None), "store") == (False, None)
    assert counts == Counter(tier_errors=1) and guard.breaker.is_open() and not guard.breaker.reachable
