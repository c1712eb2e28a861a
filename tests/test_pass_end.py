"""A pass's end hands its writes to the tier client and returns: it waits for no round trip (issue 16).

What still waits for them: `flush()` and `close()` (close drains everything queued), the next pass of the same
process (it reads the traces still queued from the client itself), and a fleet job's compiling process, which
answers a job, and so lets the worker acknowledge it, only once the job's writes are stored. A close that gives
up waiting on a send never closes the backend under the flusher thread still using it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers_graphs import MIXED_DISTINCT_KEYS, local_or_fake_backend, mixed_graph, stored_entries

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from cachestore.client import TierClient
from cachestore.settings import Settings
from workers.job_process import answer_job

WRITES = ("store", "apply_metrics")
GATE_LIMIT = 30.0  # a write never waits on the gate longer than this, so a failing test cannot hang the suite


class GatedBackend:
    """A real backend whose writes wait until the test opens `gate`; it records whether it was ever closed
    while a write was still running (what crashed SQLite and fakeredis's Lua)."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.gate = threading.Event()
        self.writing = 0
        self.closed = False
        self.closed_while_writing = False
        self.used_after_close: list[str] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.closed_while_writing = self.writing > 0
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.closed:
                self.used_after_close.append(name)
            if name not in WRITES:
                return attribute(*args, **kwargs)
            with self._lock:
                self.writing += 1
            try:
                assert self.gate.wait(GATE_LIMIT), "the test never opened the gate"
                return attribute(*args, **kwargs)
            finally:
                with self._lock:
                    self.writing -= 1

        return call


def settings(**changes: Any) -> Settings:
    # A long flush_interval: the writes go out at the pass's end because it asks, not because a timer ran out;
    # a long final_flush_timeout: a pass that waited for its writes would wait for the gate, not give up early.
    return Settings(**{"tier": "test", "host": "h", "worker": "w", "flush_interval": 5.0, "final_flush_timeout": 20.0,
                       **changes})  # fmt: skip


@pytest.fixture(params=["local", "fakeredis"])
def gated(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    backend = GatedBackend(local_or_fake_backend(request.param, tmp_path))
    yield backend
    backend.gate.set()
    if not backend.closed:
        backend.inner.close()


def wait_until(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_a_pass_returns_before_its_writes_are_stored_and_they_go_out_at_once(gated: GatedBackend) -> None:
    client = TierClient(lambda: gated, settings(single_flight=False))
    loop = BirCodeGenLoop(tier=client)
    started = time.monotonic()
    loop.run(load_graph(mixed_graph()))
    # Returned while every write still waits at the gate: the entries and the pass's metrics batch are queued.
    assert time.monotonic() - started < 10.0  # (a pass waiting for them would wait out the gate, 30 s)
    assert loop.traces == MIXED_DISTINCT_KEYS
    assert client.pending() == MIXED_DISTINCT_KEYS + 1
    # Being sent without anyone calling flush, long before flush_interval (5 s): the pass's end asked for it.
    assert wait_until(lambda: gated.writing == 1, 2.0)
    assert stored_entries(gated.inner) == {} and gated.inner.totals().get("passes", 0) == 0
    gated.gate.set()
    assert wait_until(lambda: client.pending() == 0, 2.0)
    assert len(stored_entries(gated.inner)) == MIXED_DISTINCT_KEYS
    assert gated.inner.totals()["passes"] == 1
    client.close(timeout=5)
    assert client.counts()["tier_dropped"] == 0


def test_flush_waits_for_what_the_pass_handed_over(gated: GatedBackend) -> None:
    client = TierClient(lambda: gated, settings(single_flight=False))
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph()))
    assert not client.flush(timeout=0.2)  # still at the gate: not stored, and flush says so
    threading.Timer(0.3, gated.gate.set).start()
    assert client.flush(timeout=10)
    assert len(stored_entries(gated.inner)) == MIXED_DISTINCT_KEYS and gated.inner.totals()["passes"] == 1
    client.close(timeout=5)


def test_the_next_pass_reads_the_traces_still_queued_without_a_lease_wait(gated: GatedBackend) -> None:
    client = TierClient(lambda: gated, settings(single_flight=True, lease_wait=5.0))
    first = BirCodeGenLoop(tier=client)
    first.run(load_graph(mixed_graph()))
    started = time.monotonic()
    second = BirCodeGenLoop(tier=client)
    second.run(load_graph(mixed_graph()))  # nothing stored yet: the leases of the first pass are still held
    assert (first.traces, second.traces, second.remote_hits) == (MIXED_DISTINCT_KEYS, 0, MIXED_DISTINCT_KEYS)
    assert second.lease_waits == 0 and time.monotonic() - started < 2.0
    assert stored_entries(gated.inner) == {}  # all of it answered by the client itself
    gated.gate.set()
    client.close(timeout=10)
    assert len(stored_entries(gated.inner)) == MIXED_DISTINCT_KEYS
    assert gated.inner.totals()["passes"] == 2


def test_close_drains_everything_queued(gated: GatedBackend) -> None:
    client = TierClient(lambda: gated, settings(single_flight=False))
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph()))
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph("other", rows=96)))
    threading.Timer(0.3, gated.gate.set).start()
    client.close(timeout=10)
    assert client.counts()["tier_dropped"] == 0
    assert len(stored_entries(gated.inner)) == MIXED_DISTINCT_KEYS + 2  # the second graph's two new Matmuls
    assert gated.inner.totals()["passes"] == 2
    assert gated.closed and not gated.closed_while_writing


def test_a_close_that_gives_up_on_a_send_leaves_the_backend_to_the_flusher(gated: GatedBackend) -> None:
    client = TierClient(lambda: gated, settings(single_flight=False, op_timeout=0.1))
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph()))
    client.close(timeout=0.2)  # gives up: the flusher is stuck in the send, past close's join (1 s)
    flusher = client._outbox.thread
    assert flusher is not None and flusher.is_alive() and gated.writing == 1
    assert not gated.closed  # not closed under the running send
    assert client.counts()["tier_dropped"] == MIXED_DISTINCT_KEYS + 1  # not known to be delivered
    gated.gate.set()
    flusher.join(timeout=10)
    assert not flusher.is_alive()
    assert gated.closed and not gated.closed_while_writing  # closed by the flusher, once its send was done
    assert gated.used_after_close == []


def test_a_close_with_the_flusher_idle_closes_the_backend_itself(gated: GatedBackend) -> None:
    gated.gate.set()
    client = TierClient(lambda: gated, settings(single_flight=False))
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph()))
    client.close(timeout=5)
    assert gated.closed and not gated.closed_while_writing and gated.used_after_close == []
    assert client._outbox.thread is not None and not client._outbox.thread.is_alive()


def test_a_fleet_job_is_answered_only_once_its_pass_is_stored(gated: GatedBackend) -> None:
    """The worker acknowledges a job on its compiling process's answer (workers/fleet.py, _complete): the answer
    waits for the job's entries and its metrics batch, so a process killed right after it loses neither."""
    client = TierClient(lambda: gated, settings(single_flight=False))
    job = {"id": "j1", "file": "mixed.json", "graph": json.dumps(mixed_graph())}
    opened: list[float] = []

    def open_gate() -> None:
        opened.append(time.monotonic())
        gated.gate.set()

    threading.Timer(0.5, open_gate).start()
    result, artifact = answer_job(job, client, client.settings.limits(), None, lambda job: None)
    answered = time.monotonic()
    assert result.error is None and artifact is not None
    assert opened and answered >= opened[0]  # it waited for the gate
    # Stored when answered, before any close: what a kill right now would leave in the tier.
    assert client.pending() == 0
    assert len(stored_entries(gated.inner)) == MIXED_DISTINCT_KEYS
    assert gated.inner.totals()["passes"] == 1
    client.close(timeout=5)


def test_a_pass_that_only_read_leaves_its_metrics_to_the_flushers_timer(gated: GatedBackend) -> None:
    """Nobody waits for a warm pass's metrics: they go with the flusher's next window (flush_interval), so the
    batches of many short passes go out in one wake-up instead of one send racing each next pass."""
    gated.gate.set()
    client = TierClient(lambda: gated, settings(single_flight=False, flush_interval=1.0))
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph()))  # traced: sent at once
    assert wait_until(lambda: client.pending() == 0, 0.9)
    warm = BirCodeGenLoop(tier=client)
    warm.run(load_graph(mixed_graph()))
    assert warm.remote_hits == MIXED_DISTINCT_KEYS and warm.traces == 0
    assert client.pending() == 1  # its metrics batch, waiting for the window
    assert wait_until(lambda: client.pending() == 0, 5.0)  # sent by the timer, nobody asking
    assert gated.inner.totals()["passes"] == 2
    client.close(timeout=5)


def test_the_compiling_thread_hands_entries_over_while_the_flusher_is_sending(gated: GatedBackend) -> None:
    """While the flusher waits on a slow send, a trace's publish and a lease's release still return at once (the
    send runs outside the outbox lock), and what they handed over is answered from memory until it is stored."""
    client = TierClient(lambda: gated, settings(single_flight=False))
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph()))
    assert wait_until(lambda: gated.writing == 1, 5.0)  # the flusher is sending, held at the gate
    result = {"binary": b"handed over", "input_names": ["x"], "output_names": ["out"], "format": "bir"}
    started = time.monotonic()
    for i in range(3):
        client.publish_trace(f"handed-{i}", result, {"kernel_name": "softmax", "i": i}, 0.01)
    client.release_lease("handed-0")
    returned = time.monotonic() - started
    assert returned < 1.0 and gated.writing == 1  # (a send under the lock would keep each call until the gate opens)
    # Handed over all the same: answered from memory now, stored once the gate opens.
    assert client.lookup("handed-1") is not None  # (a lookup of one key, the hit path's own)
    assert set(client.find_many(["handed-0", "handed-2"])[0]) == {"handed-0", "handed-2"}
    gated.gate.set()
    assert client.flush(timeout=10)
    assert {"handed-0", "handed-1", "handed-2"} <= set(stored_entries(gated.inner))
    client.close(timeout=5)


def test_a_pass_record_is_made_into_its_metrics_batch_on_the_flusher(gated: GatedBackend, monkeypatch) -> None:
    """The pass's end only hands its record over; the batch (the counts per key and kernel, its log record) is
    built on the flusher thread, once, however many times it is sent."""
    from cachestore import client as client_module

    built_on: list[str] = []
    make = client_module.metrics_batch

    def recording(*args: Any, **kwargs: Any) -> Any:
        built_on.append(threading.current_thread().name)
        return make(*args, **kwargs)

    monkeypatch.setattr(client_module, "metrics_batch", recording)
    gated.gate.set()
    client = TierClient(lambda: gated, settings(single_flight=False))
    BirCodeGenLoop(tier=client).run(load_graph(mixed_graph()))
    assert client.flush(timeout=10)
    assert built_on == ["nkicache-tier-flusher"]
    assert gated.inner.totals()["passes"] == 1
    client.close(timeout=5)


def test_what_the_compiling_thread_hands_over_is_bounded_by_outbox_limit(gated: GatedBackend) -> None:
    """A flusher stuck on a send does not take what is handed over meanwhile: past outbox_limit items the oldest
    are dropped and counted."""
    client = TierClient(lambda: gated, settings(single_flight=False, outbox_limit=5))
    result = {"binary": b"bounded", "input_names": ["x"], "output_names": ["out"], "format": "bir"}
    client.publish_trace("first", result, {"kernel_name": "softmax"}, 0.01)
    client.send_now()
    assert wait_until(lambda: gated.writing == 1, 5.0)  # stuck at the gate with "first"
    for i in range(40):
        client.publish_trace(f"waiting-{i}", result, {"kernel_name": "softmax", "i": i}, 0.01)
        assert client.pending() <= 5
    assert client.counts()["tier_dropped"] >= 40 - 5
    gated.gate.set()
    client.close(timeout=5)
