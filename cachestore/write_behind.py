"""Write-behind: the tier's writes, queued by the compiling thread and sent by one background thread.

The compiling thread hands over entries to store, lease releases, TTL refreshes and metrics batches and goes
on; the flusher thread lets them gather for up to flush_interval (a pass traces several kernels in that time),
encodes the entries meanwhile, and sends them in order, in as few round trips as it can. Past `limit` items the
oldest is dropped and counted. While the breaker keeps the store off the flusher sleeps and keeps everything
queued; it is delivered when the store returns. What is queued and not stored yet is answered from here
(`unsent`): a pass returns without waiting for its stores, and the next pass may ask for them first.

What the items mean to the store (encoding, signing, the calls that send them) is the caller's: `prepare` and
`send`.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable

import msgspec

from bridge.port import PassRecord
from cachestore.api import MetricsBatch, StoreRequest
from cachestore.breaker import Breaker
from cachestore.entry import Entry

logger = logging.getLogger(__name__)
GROUP_LIMIT = 256  # entries, releases and refreshes sent in one group (one pipeline each)


class PendingStore(msgspec.Struct):
    """An entry the compiling thread handed over: `build` makes it, and the flusher thread builds, hashes,
    compresses and encodes it (`request`, kept so a retry after an outage does not encode it again)."""

    cache_key: str
    build: Callable[[], Entry]
    request: StoreRequest | None = None
    prepared: bool = False  # `request` is None after preparing when the entry is too large to store
    entry: Entry | None = None  # `build()`'s, once built (by the flusher, or by a read of it before it is sent)
    # Its value (cachestore.value), from preparing it until its first send gives `request` its TTL.
    value: float | None = None

    def built(self) -> Entry:
        if self.entry is None:
            self.entry = self.build()
        return self.entry


class LeaseRelease(msgspec.Struct):
    cache_key: str
    owner: str


class TtlRefresh(msgspec.Struct):
    """An entry read whose value earns it more than entry_ttl (cachestore.value): its TTL, set in the background."""

    cache_key: str
    ttl: int


class UnbuiltBatch(msgspec.Struct):
    """A pass's record as the compiling thread hands it over: the flusher makes it into its metrics batch
    (`made`, once, so a send retried after an outage applies the same batch id)."""

    record: PassRecord
    writer_counts: dict[str, int]
    made: MetricsBatch | None = None


Item = PendingStore | LeaseRelease | TtlRefresh | UnbuiltBatch | MetricsBatch
# Sent in groups; the others one at a time. Entries and releases are what other processes may wait for.
GROUPED = PendingStore | LeaseRelease | TtlRefresh
AWAITED = PendingStore | LeaseRelease


class WriteBehind:
    def __init__(
        self,
        *,
        send: Callable[[list[Item]], bool],
        prepare: Callable[[PendingStore], object],
        before_send: Callable[[], None],
        close_store: Callable[[], None],
        breaker: Breaker,
        flush_interval: float,
        limit: int,
        dropped: Callable[[int], None],
    ):
        """`send(group)`: deliver one group (`leading_group`), False when the store failed (it stays queued).
        `prepare(entry)`: encode a queued entry while the flusher waits for more. `before_send()`: called before
        each drain and flush (it may `put_all` what it collected). `close_store()`: called by the flusher as it
        stops when `close` could not wait for it. `dropped(n)`: n items were dropped undelivered."""
        self._send = send
        self._prepare = prepare
        self._before_send = before_send
        self._close_store = close_store
        self._breaker = breaker
        self._interval = flush_interval
        self._limit = limit
        self._dropped = dropped
        self._lock = threading.Condition()
        self._items: collections.deque[Item] = collections.deque()
        # Changed under the lock; read without it (one dict lookup, atomic) on the hit path.
        self._unsent: dict[str, PendingStore] = {}
        self._awaited = 0  # entries and lease releases queued
        self.thread: threading.Thread | None = None
        self._closing = False
        self._flush_waiters = 0  # flush() calls waiting for the queue to drain
        self._send_now = False  # a pass that traced ended: stop gathering and send, with no one waiting
        # close() found the flusher still sending after its join: the flusher closes the store as it exits, so
        # that a store is never closed under a thread still sending on it (SQLite and Lua crash, not raise).
        self._store_closed_by_flusher = False
        self._stopped = False  # the current flusher has left its loop (set by it, under the lock)
        self._pid = 0  # the process that started it (a forked child has none running)

    # -- the compiling thread's side -------------------------------------------------------------
    def put(self, item: Item, wake: bool = True) -> None:
        """Queue `item`; `wake`: the flusher now (else it finds it within flush_interval, at the pass's end or a
        flush: an entry traced mid-pass need not wake a thread that would take the GIL from the compile). The
        first item of a quiet queue wakes it all the same, so that it encodes while the pass goes on."""
        if self._closing:  # after close(): dropped and counted, as what close() could not deliver is
            self._dropped(1)
            return
        with self._lock:
            wake = wake or not self._items
            self._append(item)
            if wake:
                self._lock.notify_all()
        self.start()

    def put_all(self, items: Iterable[Item]) -> None:
        """Queue `items` for the next send (the flusher's own collection, or a flush's): the flusher is woken, none
        is started."""
        with self._lock:
            for item in items:
                self._append(item)
            self._lock.notify_all()

    def unsent(self, cache_key: str) -> PendingStore | None:
        return self._unsent.get(cache_key)

    @property
    def has_unsent(self) -> bool:
        return bool(self._unsent)

    def unsent_entries(self) -> dict[str, Entry]:
        with self._lock:
            pending = list(self._unsent.items())
        return {key: store.built() for key, store in pending}

    def send_now(self) -> None:
        """Have the flusher send what is queued without waiting out flush_interval, when it holds what other
        processes may wait for (entries, lease releases); returns at once. Metrics batches and TTL refreshes go
        out by the flusher's timer: a send at every warm pass's end would contend with the next pass."""
        with self._lock:
            if not self._awaited:
                return
            self._send_now = True
            self._lock.notify_all()
        self.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._items)

    def wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _append(self, item: Item) -> None:
        """Queue `item` (the lock held); past the limit the oldest item is dropped and counted."""
        if len(self._items) >= self._limit:
            self._forget(self._items.popleft())
            self._dropped(1)
        self._items.append(item)
        if isinstance(item, PendingStore):
            self._unsent[item.cache_key] = item
        if isinstance(item, AWAITED):
            self._awaited += 1

    def _forget(self, item: Item) -> None:
        """`item` left the queue (sent, or dropped; the lock held): no longer answered from memory."""
        if isinstance(item, PendingStore) and self._unsent.get(item.cache_key) is item:
            del self._unsent[item.cache_key]
        if isinstance(item, AWAITED):
            self._awaited -= 1

    # -- the flusher thread -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the flusher unless it runs, or close() has begun stopping it (a thread started then would send
        on the store close() closes). Its own flag is read first, without a lock (every remote hit asks), and
        the thread asked only when unsure: none yet, one that stopped, or the parent's in a forked child."""
        if self._closing or (self.thread is not None and not self._stopped and self._pid == os.getpid()):
            return
        if self.thread is None or not self.thread.is_alive():
            with self._lock:
                self.thread = threading.Thread(target=self._run, name="nkicache-tier-flusher", daemon=True)
                self._stopped = False
                self._pid = os.getpid()
            try:
                self.thread.start()
            except RuntimeError:  # no room for a thread (a job's memory limit): the pass reports it; close() joins none
                with self._lock:
                    self.thread = None
                raise

    def _run(self) -> None:
        try:
            self._flush_until_closed()
        finally:
            with self._lock:
                current = threading.current_thread() is self.thread
                self._stopped = self._stopped or current
                close_store = current and self._store_closed_by_flusher
            if close_store:
                self._close_store()

    def _flush_until_closed(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._closing or bool(self._items), self._interval)
                if self._closing and not self._items:
                    return
                if not self._breaker.available():
                    if self._closing and self._breaker.is_open():
                        return
                    # The breaker is open, or another call is probing the store: sleep until it closes, the probe
                    # ends (it wakes this thread) or new work arrives; never spin.
                    longest = self._interval * 5
                    self._lock.wait(min(self._breaker.cooling, longest) or longest)
                    continue
            self._gather()
            if not self._drain_once() and self._closing:
                return

    def _gather(self) -> None:
        """Let writes gather for up to flush_interval, so they go out in one pipeline: each round trip costs the
        compiling process a system call and a wake-up, far more than the bytes. The entries queued meanwhile are
        encoded. A pass's end (`send_now`), a waiting flush() or close() ends the gathering at once."""
        deadline = time.monotonic() + self._interval
        while True:
            with self._lock:
                if self._closing or self._flush_waiters > 0 or self._send_now:
                    return
                todo = [item for item in self._items if isinstance(item, PendingStore) and not item.prepared]
                if not todo:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    self._lock.wait(remaining)  # the pass's end, a flush() and close() notify
                    continue
            for item in todo:  # outside the lock: the compiling thread keeps queueing
                self._prepare(item)

    def _drain_once(self) -> bool:
        """Send what is queued, in order; False when the store failed (the rest stays queued)."""
        self._before_send()
        with self._lock:
            items = list(self._items)
            self._send_now = False  # what it asked to be sent is being sent
        sent = 0
        while sent < len(items):
            group = leading_group(items[sent:])
            if not self._send(group):
                break
            sent += len(group)
        with self._lock:
            for item in items[:sent]:
                # (a close() that gave up waiting on this send has cleared the queue and counted it dropped)
                if self._items and self._items[0] is item:
                    self._forget(self._items.popleft())
            self._lock.notify_all()
        return sent == len(items)

    # -- waiting for it -----------------------------------------------------------------------------
    def flush(self, timeout: float, *, through_outage: bool = False) -> bool:
        """Wait until the queue is empty, at most `timeout` seconds. While the store is down it gives up at once,
        unless `through_outage` and the breaker closes (so the flusher retries) before the deadline."""
        deadline = time.monotonic() + timeout
        self._before_send()  # what it collects (the reads' TTL refreshes) is part of what is waited for
        with self._lock:
            self._flush_waiters += 1
            self._lock.notify_all()
            try:
                while self._items:
                    remaining = deadline - time.monotonic()
                    retries_in_time = through_outage and self._breaker.reopens_by(deadline)
                    if remaining <= 0 or (self._breaker.is_open() and not retries_in_time):
                        return False
                    self._lock.wait(min(remaining, 0.05))
            finally:
                self._flush_waiters -= 1
        return True

    def close(self, timeout: float, *, through_outage: bool = False) -> bool:
        """Flush and stop the flusher within `timeout` seconds in all; what could not be delivered is dropped
        and counted. True: the flusher has stopped and the caller closes the store; False: it is still sending
        (cut off by the deadline), and it closes the store itself when done."""
        deadline = time.monotonic() + timeout
        self.flush(timeout, through_outage=through_outage)
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        flusher = self.thread
        if flusher is not None:
            flusher.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._lock:
            if self._items:
                self._dropped(len(self._items))
                self._items.clear()
            self._unsent.clear()
            self._awaited = 0
            # Decided under the lock the flusher reads it with as it stops: exactly one of the two closes it.
            running = flusher is not None and flusher is self.thread and not self._stopped
            self._store_closed_by_flusher = running
        return not running


def leading_group(items: list[Item]) -> list[Item]:
    """The first item, with the entries, lease releases and refreshes right after it when it is one of them:
    they go in one pipeline each, instead of a round trip for each."""
    if not isinstance(items[0], GROUPED):
        return items[:1]
    group: list[Item] = []
    for item in items:
        if not isinstance(item, GROUPED) or len(group) == GROUP_LIMIT:
            break
        group.append(item)
    return group
