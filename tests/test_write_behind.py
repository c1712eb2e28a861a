"""The write-behind on its own (cachestore.write_behind): order, groups, the limit, outages and close, with a
`send` that records what it is given instead of a store."""

from __future__ import annotations

import threading
from typing import Any

from cachestore.api import MetricsBatch
from cachestore.breaker import Breaker
from cachestore.write_behind import LeaseRelease, PendingStore, TtlRefresh, WriteBehind


class Recorder:
    def __init__(self, fail: int = 0, cooldown: float = 60.0):
        self.breaker = Breaker(cooldown)
        self.groups: list[list] = []
        self.fail = fail  # sends that fail before the store "comes back"
        self.dropped = 0
        self.prepared: list[str] = []
        self.closed = 0
        self.gate = threading.Event()
        self.gate.set()

    def send(self, group: list) -> bool:
        self.gate.wait(10)
        if self.fail:
            self.fail -= 1
            self.breaker.trip()  # as the guard does when a call fails
            return False
        self.groups.append(group)
        return True

    def write_behind(self, limit: int = 100, interval: float = 30.0) -> WriteBehind:
        """A flush interval longer than any test: the flusher sends when asked to (flush, send_now, close)."""
        return WriteBehind(
            send=self.send,
            prepare=lambda pending: self.prepared.append(pending.cache_key),
            before_send=lambda: None,
            close_store=lambda: setattr(self, "closed", self.closed + 1),
            breaker=self.breaker,
            flush_interval=interval,
            limit=limit,
            dropped=lambda n: setattr(self, "dropped", self.dropped + n),
        )


def entry(key: str) -> PendingStore:
    """An entry as queued: the write-behind never looks inside it, so any object stands in for it."""
    made: Any = object()
    return PendingStore(key, lambda: made)


def batch(name: str) -> MetricsBatch:
    return MetricsBatch(name, "host", "w1", {"passes": 1})


def test_items_go_out_in_order_with_entries_and_releases_grouped_and_batches_alone() -> None:
    recorder = Recorder()
    outbox = recorder.write_behind()
    first, second = entry("a"), entry("b")
    for item in (first, LeaseRelease("a", "me"), batch("m1"), second, TtlRefresh("c", 10), batch("m2")):
        outbox.put(item, wake=False)
    assert outbox.flush(10)
    assert [[type(item).__name__ for item in group] for group in recorder.groups] == [
        ["PendingStore", "LeaseRelease"],
        ["MetricsBatch"],
        ["PendingStore", "TtlRefresh"],
        ["MetricsBatch"],
    ]
    assert recorder.groups[0][0] is first and recorder.groups[2][0] is second
    assert outbox.close(10) and recorder.closed == 0  # the caller closes the store after a clean stop


def test_a_queued_entry_is_answered_until_it_is_sent() -> None:
    recorder = Recorder()
    recorder.gate.clear()  # the store holds the send
    outbox = recorder.write_behind()
    pending = entry("k")
    outbox.put(pending)
    assert outbox.unsent("k") is pending and outbox.has_unsent
    assert outbox.unsent_entries() == {"k": pending.built()}
    recorder.gate.set()
    assert outbox.flush(10)
    assert outbox.unsent("k") is None and not outbox.has_unsent and outbox.pending() == 0
    outbox.close(10)


def test_past_the_limit_the_oldest_item_is_dropped_counted_and_forgotten() -> None:
    recorder = Recorder()
    recorder.breaker.trip()  # the store is off: everything stays queued
    outbox = recorder.write_behind(limit=2)
    for key in ("x", "y", "z"):
        outbox.put(entry(key))
    assert recorder.dropped == 1 and outbox.pending() == 2
    assert outbox.unsent("x") is None and outbox.unsent("y") is not None and outbox.unsent("z") is not None
    assert not outbox.flush(1)  # gives up at once while the store is off
    assert not outbox.close(0.1) or recorder.dropped == 3
    assert recorder.dropped == 3 and recorder.groups == []


def test_what_a_failed_send_leaves_goes_out_when_the_store_returns() -> None:
    recorder = Recorder(fail=1, cooldown=0.05)
    outbox = recorder.write_behind()
    outbox.put(entry("k"))
    assert outbox.flush(5, through_outage=True)  # waits out the cooldown, then the flusher sends again
    assert [item.cache_key for item in recorder.groups[0]] == ["k"] and recorder.dropped == 0
    assert outbox.close(5)


def test_send_now_sends_entries_at_once_and_leaves_metrics_to_the_timer() -> None:
    recorder = Recorder()
    outbox = recorder.write_behind()
    outbox.put(batch("m"), wake=False)
    outbox.send_now()  # nothing awaited: the batch waits for the timer
    threading.Event().wait(0.2)
    assert recorder.groups == []
    outbox.put(entry("k"), wake=False)
    outbox.send_now()
    for _ in range(100):
        if recorder.groups:
            break
        threading.Event().wait(0.05)
    assert [type(group[0]).__name__ for group in recorder.groups] == ["MetricsBatch", "PendingStore"]
    outbox.close(5)


def test_close_drops_and_counts_what_it_cannot_deliver_and_later_puts() -> None:
    recorder = Recorder()
    recorder.gate.clear()  # the store never answers the send within close's time
    outbox = recorder.write_behind()
    outbox.put(entry("k"))
    assert not outbox.close(0.2)  # the flusher is still sending: it closes the store itself
    assert recorder.dropped == 1 and outbox.pending() == 0 and outbox.unsent("k") is None
    outbox.put(batch("late"))
    assert recorder.dropped == 2 and outbox.pending() == 0
    recorder.gate.set()
    assert outbox.thread is not None
    outbox.thread.join(10)
    assert recorder.closed == 1
