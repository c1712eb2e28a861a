"""The guard between a tier client and its store: every call to the store goes through `Guard.call`, which
opens the store on first use, lets the call through only while the breaker (cachestore.breaker) admits it, and
turns the store's failures into counted outcomes, so that a store that is down, slow or refusing never makes a
compile fail. The deadline of one call is the backend's own (`Backend`'s operation timeout)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from cachestore.api import Backend, BatchRefused, ConnectionsDropped, TierBusy, TierError, TierTimeout
from cachestore.breaker import Breaker

logger = logging.getLogger(__name__)
T = TypeVar("T")
SLOW_ANSWERS = 10  # a call is overdue once it waited this many times the slowest answer (and its caller's patience)


class Guard:
    def __init__(
        self, open_store: Callable[[], Backend], breaker: Breaker, count: Callable[[str], None], description: str
    ) -> None:
        """`count(name)` adds one to the client's counter `name` (tier_timeouts, tier_errors, tier_dropped,
        tier_skipped)."""
        self._open_store = open_store
        self.breaker = breaker
        self._count = count
        self.description = description
        self.store: Backend | None = None  # opened by the first call let through
        self._calls: dict[int, float] = {}  # thread id -> when its call to the store started (one per thread)
        self._slowest: dict[int, float] = {}  # thread id -> seconds of its slowest call the store answered

    def open(self) -> bool:
        """Open the store now, if it is not open yet; False when it cannot be (counted, and the breaker opens).
        Making the client object is not the store answering: the breaker is not told it succeeded."""
        return self.store is not None or self.call(lambda store: None, "open", answers=False)[0]

    def call(self, operation: Callable[[Backend], T], what: str, *, answers: bool = True) -> tuple[bool, T | None]:
        """(ok, result) of `operation` on the store; a failure is counted and opens the breaker. The result is None
        when not ok, and for an item the store refused as invalid (ok: done with). `answers`: whether the
        operation's success shows the store answering (it proves the store to the breaker)."""
        probe = self.breaker.admit()
        if probe is None:
            if what == "lookup":
                self._count("tier_skipped")
            return False, None
        caller = threading.get_ident()
        started = self._calls[caller] = time.monotonic()
        try:
            ok, result = self._attempt(operation, what, answers)
            if ok and answers:
                self._slowest[caller] = max(self._slowest.get(caller, 0.0), time.monotonic() - started)
            return ok, result
        finally:
            self._calls.pop(caller, None)
            self.breaker.done(probe)

    def overdue(self, caller: int, patience: float) -> bool:
        """Whether the call thread `caller` (a threading.get_ident()) makes to the store has waited longer than
        `patience`, and longer than SLOW_ANSWERS times the slowest of its calls the store answered (a thread's
        calls are alike: a pass's reads, or the flusher's batches; on a loaded machine all are slow, and the
        wait stretches). Never before the store first answered the thread: until then the breaker lets one
        call at a time wait on an unproven store, and a thread's first call includes connecting."""
        started, slowest = self._calls.get(caller), self._slowest.get(caller)
        if started is None or slowest is None:
            return False
        return time.monotonic() - started > max(patience, SLOW_ANSWERS * slowest)

    def give_up(self, why: str) -> None:
        """Take the store as failed now, as a timeout would (counted, the breaker opens), and cut short the calls
        still waiting on it: a caller that cannot afford to wait for the operation timeout saw it not answer."""
        self._count("tier_timeouts")
        self._trip("a read", TierTimeout(why), reachable=True)
        if self.store is not None:
            self.store.abort_calls()

    def _attempt(self, operation: Callable[[Backend], T], what: str, answers: bool) -> tuple[bool, T | None]:
        try:
            if self.store is None:
                self.store = self._open_store()
            result = operation(self.store)
            if answers:
                self.breaker.succeeded()
            return True, result
        except TierBusy as exc:
            # Another process of this machine held the embedded tier's lock for the whole wait: counted, and
            # the write stays queued (a read is a miss), but the tier stays on for the rest of the compile.
            self._count("tier_timeouts")
            logger.warning("tier %s busy during %s (%s); retried, not turned off", self.description, what, exc)
        except TierTimeout as exc:
            self._count("tier_timeouts")
            self._trip(what, exc, reachable=True)
        except ConnectionsDropped:
            pass  # another call timed out and counted it: what this call sent stays queued
        except BatchRefused as exc:
            # The tier answered: it is up, and this one item is bad. Done with (ok), so the outbox moves on to
            # what follows it instead of retrying it forever behind an open breaker.
            self._count("tier_dropped")
            logger.warning("tier %s refused a write during %s; dropped: %s", self.description, what, exc)
            self.breaker.succeeded()
            return True, None
        except TierError as exc:
            self._count("tier_errors")
            self._trip(what, exc)
        return False, None

    def _trip(self, what: str, exc: Exception, reachable: bool = False) -> None:
        self.breaker.trip(reachable)
        logger.warning(
            "tier %s failed during %s (%s); not asked again for %.1f s",
            self.description,
            what,
            exc,
            self.breaker.cooldown,
        )
