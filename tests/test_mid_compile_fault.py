"""A tier that fails after a parallel compile's plan was made (issue 45): a frozen server does not hold a pass for
its operation timeout, and the variants the plan left to the tier go back to the pool."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers_graphs import unique_namespace, wait_until

from bench.broken_tier import MidCompileFault
from bridge.limits import Limits
from bridge.parallel import key_variants
from cachestore.client import TierClient
from cachestore.settings import Settings
from cachestore.stores import open_tier
from workers import variant_pool
from workers.compile_run import CtrlC
from workers.passes import PassResult
from workers.variant_pool import (
    FREE,
    SKIPPED,
    TAKEN,
    TIER_PATIENCE_SECONDS,
    WATCH_SECONDS,
    Claims,
    Scheduler,
    TierReader,
    TierWatch,
)
from workers.workload import generate_workload

NKICACHE = str(Path(sys.executable).with_name("nkicache"))


def test_claims_put_back_skipped_tasks_and_keep_taken_ones() -> None:
    claims = Claims(multiprocessing.get_context("fork"), 4)
    claims.skip([1, 2])
    assert claims.take(0, 4) == 0 and claims.take(7, 4) == 3 and claims.take(0, 4) is None
    claims.skip([0, 1, 2, 3], skipped=False)  # a taken task stays taken
    assert list(claims.state) == [TAKEN, FREE, FREE, TAKEN]
    assert claims.take(7, 4) == 1 and claims.take(0, 4) == 2 and claims.take(0, 4) is None
    assert claims.taken_by_one(7) == [1, 3]
    claims.stop()
    claims.skip([0], skipped=False)
    assert claims.take(0, 4) is None  # a stopped compile takes nothing, whatever is put back


class Answer:
    """A TierAnswer: the tier holds every variant but the first graph's (`skipped`), once `ready`."""

    def __init__(self, skipped: set[int], ready: bool):
        self.skipped, self.ready, self.counts_before = skipped, ready, None

    def known(self, timeout: float = 0.0) -> bool:
        return self.ready


class Woken:
    """Helpers without a process: they trace nothing, and count how often they were told to go."""

    def __init__(self) -> None:
        self.times = 0
        self.pipes: dict = {}

    def go(self) -> None:
        self.times += 1


def scheduler_of(tmp_path: Path, answered: bool = True) -> tuple[Scheduler, Woken, Answer]:
    paths = [str(p) for p in generate_workload(tmp_path / "graphs", 3, seed=2)]
    plan = key_variants(paths, shared=False, target_name=None, limits=Limits())
    answer, helpers = Answer({task.task_id for task in plan.tasks if task.graph > 0}, answered), Woken()
    claims = Claims(multiprocessing.get_context("fork"), len(plan.tasks))
    return Scheduler(plan, answer, claims, helpers, None, Limits()), helpers, answer


def test_a_tier_failing_after_the_plan_puts_the_later_passes_tasks_back(tmp_path: Path) -> None:
    scheduler, helpers, answer = scheduler_of(tmp_path)
    skipped = answer.skipped
    assert all(not scheduler.needs[graph] & skipped for graph in scheduler.needs)
    state = scheduler.claims.state
    assert {p for p, task in enumerate(scheduler.tasks) if state[p] == SKIPPED} == skipped
    scheduler.passes_done = 1  # the tier fails during the second pass: it traces its own
    scheduler._put_back()
    scheduler._wait_for_put_back()
    assert helpers.times == 1  # the tasks put back (compile_in_parallel starts them)
    for position, task in enumerate(scheduler.tasks):
        assert state[position] == (SKIPPED if task.graph == 1 else FREE), task
        if task.graph == 2:
            assert task.task_id in scheduler.needs[2]  # the last pass waits for its variants as with no tier
    assert not scheduler.needs[1] & skipped


def test_a_tier_failing_before_its_answer_is_applied_answers_for_nothing(tmp_path: Path) -> None:
    scheduler, _, answer = scheduler_of(tmp_path, answered=False)
    scheduler._put_back()  # during the first pass, before the tier's answer is applied
    answer.ready = True
    scheduler._apply_answer()
    scheduler._wait_for_put_back()
    assert list(scheduler.claims.state) == [FREE] * len(scheduler.tasks)
    assert scheduler.needs == {graph: set(tasks) for graph, tasks in scheduler.plan.needs.items()}


class FrozenPrefetch:
    """A tier whose first pass's prefetch is never answered until given up on (a server frozen mid-compile), as
    TierWatch sees one: through `overdue`, `give_up` and `failed`."""

    reads = True

    def __init__(self) -> None:
        self.failed = False
        self.waiting: dict[int, float] = {}  # thread -> when its read started
        self.released = threading.Event()
        self.read_by: list[int] = []
        self.waited: list[float] = []

    def read(self) -> str:
        self.read_by.append(threading.get_ident())
        started = self.waiting[threading.get_ident()] = time.monotonic()
        self.released.wait(10)
        del self.waiting[threading.get_ident()]
        self.waited.append(time.monotonic() - started)
        return "answered"

    def overdue(self, thread: int, patience: float) -> bool:
        started = self.waiting.get(thread)
        return started is not None and time.monotonic() - started > patience

    def give_up(self, why: str) -> None:
        self.failed = True
        self.released.set()


def test_a_pass_waiting_for_a_frozen_tier_leaves_its_process_tracing(tmp_path: Path, monkeypatch: Any) -> None:
    """A pass's prefetch is read on the reader's thread: this process traces the later passes' variants while it
    waits, instead of idling until TierWatch gives up on the tier, and TierWatch watches that thread."""
    paths = [str(p) for p in generate_workload(tmp_path / "graphs", 3, seed=2)]
    plan = key_variants(paths, shared=False, target_name=None, limits=Limits())
    claims = Claims(multiprocessing.get_context("fork"), len(plan.tasks))
    tier = FrozenPrefetch()
    scheduler = Scheduler(plan, Answer(set(), True), claims, Woken(), tier, Limits())  # type: ignore[arg-type]
    later = {task.task_id for task in plan.tasks if task.graph > 0}
    during_the_wait: list[set[int]] = []

    def compile_graph(path: str, *, read_tier: Any, **_: Any) -> tuple[PassResult, None]:
        if path == paths[0]:
            assert read_tier(tier.read) == "answered"
            during_the_wait.append(later & scheduler.outcomes.keys())
        return PassResult(path), None

    monkeypatch.setattr(variant_pool, "compile_graph", compile_graph)
    try:
        results = scheduler.run(paths, str(tmp_path / "out"), None, lambda _: None, CtrlC())
    finally:
        tier.released.set()
        scheduler.close()
    assert [r.file for r in results] == paths
    assert tier.read_by == [scheduler.reader.ident] and tier.failed  # given up on, the reader's read overdue
    assert tier.waited[0] < 5  # long before the read's own 10 s
    assert during_the_wait[0], "no later pass's variant was traced while the first pass waited for the tier"


def test_a_read_that_fails_on_the_readers_thread_fails_in_the_pass() -> None:
    """The pass sees the reader's exception as if it had read itself (compile_graph turns it into the pass's
    error), and the reader goes on serving the next pass."""
    reader = TierReader(lambda: False)
    try:
        with pytest.raises(ZeroDivisionError):
            reader.read(lambda: 1 / 0)
        assert reader.read(lambda: threading.get_ident()) == reader.ident != threading.get_ident()
    finally:
        reader.close()


class GatedFetch:
    """A store that answers its first `answered` reads at once, and then waits until released (or cut short)."""

    value_ttls = False

    def __init__(self, answered: int = 0) -> None:
        self.answered = answered
        self.reading, self.released = threading.Event(), threading.Event()

    def fetch(self, cache_keys: list[str], ttl: int | None) -> dict:
        if self.answered > 0:
            self.answered -= 1
            return {}
        self.reading.set()
        self.released.wait(10)
        return {}

    def abort_calls(self) -> None:
        self.released.set()

    def close(self) -> None:
        pass


def test_tier_watch_takes_no_first_read_under_way_for_a_failure() -> None:
    """The plan's read is the first call to a tier not proven yet: the breaker's probe, during which other calls
    find the tier unavailable. TierWatch must not take that for a failure: it would put the tasks back and throw
    the tier's answer away, and a warm compile whose plan read outlasted WATCH_SECONDS traced every variant."""
    store = GatedFetch()
    client = TierClient(lambda: store, Settings(), "gated tier")
    failures: list[float] = []
    watch = TierWatch(client, [threading.get_ident()], lambda: failures.append(1.0))
    reader = threading.Thread(target=client.find_many, args=(["ab" * 32],))
    try:
        reader.start()
        assert store.reading.wait(10)
        assert not client.available  # another call would find it busy being probed
        threading.Event().wait(WATCH_SECONDS * 10)
        assert failures == [] and not client.failed
        store.released.set()
        reader.join(10)
        client.give_up("the test's patience")  # a failure, this time
        assert wait_until(lambda: failures == [1.0], timeout=10)
        assert client.failed
    finally:
        store.released.set()
        watch.stop()
        client.close(timeout=1)


def test_a_pass_read_unanswered_for_a_tenth_of_a_second_is_given_up_on() -> None:
    """A frozen Redis leaves the pass's process idle until TierWatch gives up on it: each millisecond of that
    patience cost the figure mid_compile_fault_overhead about one of wall time, so a proven tier's read left
    unanswered for 0.12 s (far more than ten times its answered read) is overdue."""
    store = GatedFetch(answered=1)
    client = TierClient(lambda: store, Settings(), "gated tier")
    try:
        # The pass's thread: a read answered (the tier proven to it, its slowest answer known), then one not.
        reader = threading.Thread(target=lambda: [client.find_many([key]) for key in ("ab" * 32, "cd" * 32)])
        reader.start()
        assert store.reading.wait(10)
        threading.Event().wait(0.12)
        assert client.overdue(reader.ident, TIER_PATIENCE_SECONDS)
    finally:
        store.released.set()
        client.close(timeout=1)


def test_give_up_cuts_short_a_read_waiting_on_a_frozen_server(private_redis_server: Any) -> None:
    server = private_redis_server()
    client = open_tier(Settings(tier=server.url, namespace=unique_namespace(), op_timeout=60.0))
    assert client.find_many(["ab" * 32]) == ({}, set())  # connected and proven
    server.process.send_signal(signal.SIGSTOP)
    try:
        reader = threading.Thread(target=client.find_many, args=(["cd" * 32],))
        reader.start()
        wait_until(lambda: client.overdue(reader.ident, 0.1), timeout=10)
        client.give_up("the test's patience")
        reader.join(timeout=10)
        assert not reader.is_alive()  # long before the 60 s operation timeout
        assert not client.overdue(reader.ident, 0.0)
        assert client.counts()["tier_timeouts"] == 1 and not client.available
    finally:
        server.process.send_signal(signal.SIGCONT)
        client.close(timeout=1)


def compile_json(graphs: Path, out: Path, tier: str, env: dict[str, str]) -> dict:
    line = [NKICACHE, "compile", str(graphs), "--workers", "2", "--tier", tier, "--out", str(out), "--json"]
    done = subprocess.run(line, capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) | {"stderr": done.stderr}


@pytest.fixture(scope="module")
def six_models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict[str, bytes]]:
    """The default workload's first six models, tier off's report of them and its artifacts."""
    graphs = tmp_path_factory.mktemp("graphs")
    generate_workload(graphs, 6, 0)
    out = tmp_path_factory.mktemp("off")
    off = compile_json(graphs, out, "off", {**os.environ})
    return graphs, off, {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_a_tier_failing_mid_compile_costs_no_pass_its_timeout(tmp_path: Path, fault: int, six_models: tuple) -> None:
    """Redis stopped or killed once the compile stored 20 entries, with a 60 s operation timeout: no pass waits
    for it longer than the compile's patience, and the artifacts are tier off's."""
    graphs, off, off_artifacts = six_models
    env = {**os.environ, "NKICACHE_OP_TIMEOUT": "60", "NKICACHE_NAMESPACE": unique_namespace()}
    injector = MidCompileFault(fault)
    try:
        run = compile_json(graphs, tmp_path / "out", injector.url(), env)
        assert injector.faults == 1  # the fault came mid-compile
    finally:
        injector.close()
    assert [(g["file"], g["error"]) for g in run["graphs"]] == [(g["file"], None) for g in off["graphs"]]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == off_artifacts
    assert run["tier_timeouts"] + run["tier_errors"] >= 1
    assert max(graph["seconds"] for graph in run["graphs"]) < 30, run["stderr"]
