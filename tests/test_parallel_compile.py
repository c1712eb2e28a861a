"""`nkicache compile --workers N` traces a compile's distinct kernel variants in several processes (bridge/parallel.py,
workers/variant_pool.py) while each pass stays the specification's loop: per pass, the same counts and the same
artifact bytes as a sequential compile, for every graph of the default workload, with and without a tier."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers_graphs import delete_namespace, unique_namespace, wait_until

from bridge.limits import Limits
from bridge.miss_causes import MISS_COUNTERS
from bridge.parallel import plan_variants
from cachestore.settings import load_settings
from workers.workload import generate_workload

NKICACHE = str(Path(sys.executable).with_name("nkicache"))
# What a pass counts that does not depend on which process traced: the specification's counters and the tier's.
SAME = ("kernels", "cache_hits", "cache_misses", "remote_hits", "tier_lookups", "lease_waits", "tier_errors",
        "tier_rejected", "tier_dropped")  # fmt: skip


def compile_json(graphs: Path, out: Path, workers: int, tier: str, env: dict | None = None, expect: int = 0) -> dict:
    done = subprocess.run(
        [NKICACHE, "compile", str(graphs), "--workers", str(workers), "--tier", tier, "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL, env=env,
    )  # fmt: skip
    assert done.returncode == expect, done.stderr
    return json.loads(done.stdout)


def artifact_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def assert_same_passes(sequential: dict, parallel: dict) -> None:
    assert [g["file"] for g in parallel["graphs"]] == [g["file"] for g in sequential["graphs"]]
    for one, two in zip(sequential["graphs"], parallel["graphs"], strict=True):
        assert one["error"] is None and two["error"] is None, (one["error"], two["error"])
        assert {key: two[key] for key in SAME} == {key: one[key] for key in SAME}, one["file"]
        # Every trace made for the pass is in `traces`, wherever it ran; `parallel_traces` says how many ran elsewhere.
        assert one["parallel_traces"] == 0
        assert two["traces"] == one["traces"] >= two["parallel_traces"], one["file"]
        # Every tier miss has one cause, a parallel trace's too (the plan's lookup found it).
        for run in (one, two):
            assert sum(run[name] for name in MISS_COUNTERS) == run["tier_lookups"] - run["remote_hits"], one["file"]
            assert run["misses_unknown"] == 0


@pytest.fixture(scope="module")
def default_workload(tmp_path_factory: pytest.TempPathFactory) -> Path:
    graphs = tmp_path_factory.mktemp("workload")
    generate_workload(graphs, 6, 0)  # the first half of `nkicache workload`'s default 12 models
    return graphs


@pytest.mark.parametrize("tier", ["off", "local"])
def test_parallel_compile_counts_and_artifacts_equal_a_sequential_one(
    default_workload: Path, tmp_path: Path, tier: str
) -> None:
    runs = {}
    for workers in (1, 2):
        url = "off" if tier == "off" else f"local:{tmp_path / f'tier-{workers}.sqlite'}"  # a fresh tier each
        runs[workers] = compile_json(default_workload, tmp_path / f"out-{workers}", workers, url)
    assert runs[1]["passes"] == runs[2]["passes"] == 6
    assert_same_passes(runs[1], runs[2])
    assert runs[2]["traces"] == runs[1]["traces"] and runs[2]["parallel_traces"] > 0  # helpers traced some
    if tier == "local":
        assert runs[2]["remote_hits"] > 0  # a variant another graph needs first comes from the tier, as sequentially
    assert artifact_bytes(tmp_path / "out-2") == artifact_bytes(tmp_path / "out-1")


def test_parallel_compile_on_redis_counts_as_a_sequential_one(
    default_workload: Path, tmp_path: Path, redis_url: str, redis_client: Any
) -> None:
    runs = {}
    for workers in (1, 2):
        namespace = unique_namespace()  # a cold tier each
        try:
            env = {**os.environ, "NKICACHE_NAMESPACE": namespace}
            runs[workers] = compile_json(default_workload, tmp_path / f"out-{workers}", workers, redis_url, env)
        finally:
            delete_namespace(redis_client, namespace)
    assert_same_passes(runs[1], runs[2])
    assert artifact_bytes(tmp_path / "out-2") == artifact_bytes(tmp_path / "out-1")


def test_a_single_graph_is_traced_by_every_worker(default_workload: Path, tmp_path: Path) -> None:
    graph = default_workload / "unet-005.json"
    one = compile_json(graph, tmp_path / "one", 1, "off")
    two = compile_json(graph, tmp_path / "two", 2, "off")
    assert_same_passes(one, two)
    assert two["traces"] == one["traces"] > 1
    assert artifact_bytes(tmp_path / "two") == artifact_bytes(tmp_path / "one")


def test_the_plan_follows_what_a_sequential_compile_traces(default_workload: Path, tmp_path: Path) -> None:
    """Tier off: one task per variant of each graph (no pass reads another's traces). A tier that reads: one
    per variant of the whole compile, for the first graph that uses it, and none for what the tier holds."""
    from cachestore.stores import open_tier

    paths = [str(p) for p in sorted(default_workload.glob("*.json"))]
    alone = plan_variants(paths, tier=None, target_name=None, limits=Limits())
    sequential = compile_json(default_workload, tmp_path / "seq", 1, "off")
    assert [len(alone.owned[i]) for i in range(len(paths))] == [g["traces"] for g in sequential["graphs"]]

    tier = open_tier(load_settings({"tier": f"local:{tmp_path / 'tier.sqlite'}"}))
    try:
        shared = plan_variants(paths, tier=tier, target_name=None, limits=Limits())
        keys = [task.cache_key for task in shared.tasks]
        assert len(keys) == len(set(keys)) == len({task.cache_key for task in alone.tasks})
        for task in shared.tasks:
            assert task.graph == min(graph for graph, needs in shared.needs.items() if task.task_id in needs)
        compile_json(default_workload, tmp_path / "warm", 1, f"local:{tmp_path / 'tier.sqlite'}")
        warm = plan_variants(paths, tier=tier, target_name=None, limits=Limits())
        assert warm.tasks == [] and warm.held == len(keys)
    finally:
        tier.close()


def test_a_failing_variant_fails_its_pass_as_a_sequential_compile_does(tmp_path: Path) -> None:
    graphs = tmp_path / "graphs"
    generate_workload(graphs, 3, seed=4)
    path = sorted(graphs.glob("*.json"))[0]
    document = json.loads(path.read_text())
    kernel = next(op for op in document["ops"] if "kernel_name" in op)
    kernel["kernel_name"] = "not_this_kernel"  # the registry selects another: the trace fails
    path.write_text(json.dumps(document))
    runs = {}
    for workers in (1, 2):
        done = subprocess.run(
            [NKICACHE, "compile", str(graphs), "--workers", str(workers), "--tier", "off", "--out",
             str(tmp_path / f"out-{workers}"), "--json"], capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 1, done.stderr
        runs[workers] = json.loads(done.stdout)
    assert runs[2]["failed"] == runs[1]["failed"] != []
    assert artifact_bytes(tmp_path / "out-2") == artifact_bytes(tmp_path / "out-1")


def test_a_killed_pool_process_costs_no_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every trace task SIGKILLs the pool process that takes it: the pool breaks, this process traces what was
    lost and the rest, and every pass completes with the artifacts of a sequential compile."""
    import bridge.parallel
    import workers.variant_pool
    from workers.pool import compile_run

    paths = [str(p) for p in generate_workload(tmp_path / "graphs", 4, seed=6)]
    killed = tmp_path / "killed"

    def die(task, tier, limits):
        killed.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)

    # Forked pool processes inherit the patched module (workers.pool_process imports trace_task from it when a pool
    # process traces); the parent traces through variant_pool's own binding.
    monkeypatch.setattr(bridge.parallel, "trace_task", die)
    monkeypatch.setattr(workers.variant_pool, "pool_start_context", lambda: multiprocessing.get_context("fork"))
    settings = load_settings({"tier": "off"})
    parallel = compile_run(paths, settings=settings, workers=2, out_dir=str(tmp_path / "two"))
    sequential = compile_run(paths, settings=settings, workers=1, out_dir=str(tmp_path / "one"))
    assert killed.exists() and int(killed.read_text()) != os.getpid()
    assert not parallel.interrupted and [r.error for r in parallel.results] == [None] * 4
    for one, two in zip(sequential.results, parallel.results, strict=True):
        assert two.counts["traces"] == one.counts["traces"]
    assert artifact_bytes(tmp_path / "two") == artifact_bytes(tmp_path / "one")


def test_one_helper_of_two_killed_leaves_its_task_to_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--workers 3`: the first helper to trace is SIGKILLed mid-trace; the task it took is traced by this process,
    the other helper keeps taking tasks, and every pass completes with a sequential compile's artifacts."""
    import bridge.parallel
    import workers.variant_pool
    from bridge.parallel import trace_task
    from workers.pool import compile_run

    paths = [str(p) for p in generate_workload(tmp_path / "graphs", 4, seed=6)]
    killed, parent = tmp_path / "killed", os.getpid()

    def die_once(task, tier, limits):
        if os.getpid() != parent:
            try:
                descriptor = os.open(killed, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return trace_task(task, tier, limits)
            os.write(descriptor, str(os.getpid()).encode())
            os.kill(os.getpid(), signal.SIGKILL)
        return trace_task(task, tier, limits)

    monkeypatch.setattr(bridge.parallel, "trace_task", die_once)
    monkeypatch.setattr(workers.variant_pool, "pool_start_context", lambda: multiprocessing.get_context("fork"))
    settings = load_settings({"tier": "off"})
    parallel = compile_run(paths, settings=settings, workers=3, out_dir=str(tmp_path / "three"))
    sequential = compile_run(paths, settings=settings, workers=1, out_dir=str(tmp_path / "one"))
    assert int(killed.read_text()) not in (0, parent)
    assert not parallel.interrupted and [r.error for r in parallel.results] == [None] * 4
    traces = sum(r.counts["traces"] for r in parallel.results)
    assert traces == sum(r.counts["traces"] for r in sequential.results)  # the lost task included
    assert artifact_bytes(tmp_path / "three") == artifact_bytes(tmp_path / "one")


def test_a_helper_killed_holding_the_task_counter_costs_no_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper SIGKILLed while it holds the shared counter's lock (the OOM killer can strike anywhere): the
    others give up on the lock after CLAIM_LOCK_SECONDS, this process traces what is left, no pass is lost."""
    import workers.variant_pool
    from workers.pool import compile_run
    from workers.variant_pool import Claims

    paths = [str(p) for p in generate_workload(tmp_path / "graphs", 3, seed=6)]
    parent, take = os.getpid(), Claims.take

    def take_and_die(self, who, count):
        if os.getpid() != parent:
            self.next.get_lock().acquire()
            os.kill(os.getpid(), signal.SIGKILL)
        return take(self, who, count)

    monkeypatch.setattr(Claims, "take", take_and_die)
    monkeypatch.setattr(workers.variant_pool, "CLAIM_LOCK_SECONDS", 0.2)
    monkeypatch.setattr(workers.variant_pool, "pool_start_context", lambda: multiprocessing.get_context("fork"))
    settings = load_settings({"tier": "off"})
    parallel = compile_run(paths, settings=settings, workers=2, out_dir=str(tmp_path / "two"))
    sequential = compile_run(paths, settings=settings, workers=1, out_dir=str(tmp_path / "one"))
    assert [r.error for r in parallel.results] == [None] * 3
    assert [r.counts["traces"] for r in parallel.results] == [r.counts["traces"] for r in sequential.results]
    assert artifact_bytes(tmp_path / "two") == artifact_bytes(tmp_path / "one")


def test_a_trace_task_from_the_stream_is_checked_before_it_is_traced(default_workload: Path) -> None:
    """A fleet trace task is JSON read from a stream anyone with the queue's credentials writes: its graph is
    never taken for a path, and its op must hash to the key it names (never traced under another's key)."""
    from bridge.errors import NkiCacheError
    from bridge.parallel import task_document, task_from_document

    paths = [str(p) for p in sorted(default_workload.glob("*.json"))]
    task = plan_variants(paths, tier=None, target_name=None, limits=Limits()).tasks[0]
    document = json.loads(json.dumps(task_document(task)))
    assert task_from_document(document).cache_key == task.cache_key
    for hostile in (
        {**document, "graph": str(paths[0])},  # a path on the worker's machine
        {**document, "cache_key": "0" * 64},  # another variant's key
        {"graph": document["graph"]},  # no key at all
        [document],
    ):
        with pytest.raises(NkiCacheError, match=r"^trace task"):
            task_from_document(hostile)


def test_a_trace_task_message_of_several_variants_is_checked_whole(default_workload: Path) -> None:
    """A trace task message carries a few variants (workers/trace_tasks.py): all are traced when it is well
    formed; one forged or malformed part, a list that is no list, empty or too long, and nothing is traced."""
    from bridge.parallel import task_document
    from workers.trace_tasks import MAX_TASKS_PER_MESSAGE, enqueue_tasks, message_size, run_task

    paths = [str(p) for p in sorted(default_workload.glob("*.json"))]
    tasks = plan_variants(paths, tier=None, target_name=None, limits=Limits()).tasks[:2]
    documents = [json.loads(json.dumps(task_document(task))) for task in tasks]
    done = run_task(json.dumps({"job": "j", "tasks": documents}), None, Limits())
    assert done.error is None and done.counts["parallel_traces"] == 2
    assert run_task(json.dumps({"job": "j", **documents[0]}), None, Limits()).counts["parallel_traces"] == 1
    forged = {**documents[1], "cache_key": "0" * 64}
    too_many = [documents[0]] * (MAX_TASKS_PER_MESSAGE + 1)
    for hostile in ({"tasks": [documents[0], forged]}, {"tasks": documents[0]}, {"tasks": []}, {"tasks": too_many},
                    {"tasks": [documents[0], "x"]}):  # fmt: skip
        result = run_task(json.dumps(hostile), None, Limits())
        assert result.error.startswith("trace task: not a trace task") and result.counts["parallel_traces"] == 0
    # Messages of a few variants, never fewer messages than a handful for a job with few variants.
    assert [message_size(n) for n in (1, 8, 15, 16, 24, 94)] == [1, 1, 1, 2, 3, 3]

    class Pipe:
        def __init__(self) -> None:
            self.sent: list = []

        def __enter__(self) -> Pipe:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def xadd(self, stream: str, fields: dict) -> None:
            self.sent.append((stream, json.loads(fields["trace"])))

        def execute(self) -> list[str]:
            return [f"{i}-0" for i in range(len(self.sent))]

    pipe = Pipe()
    all_tasks = plan_variants(paths, tier=None, target_name=None, limits=Limits()).tasks
    client = type("Client", (), {"pipeline": lambda self, transaction: pipe})()
    enqueue_tasks(client, ["s0", "s1"], "j", all_tasks, "traced-for-j")
    sent_keys = [task["cache_key"] for _, message in pipe.sent for task in message["tasks"]]
    assert sent_keys == [task.cache_key for task in all_tasks]  # every variant once, in the pass's order
    assert {stream for stream, _ in pipe.sent} == {"s0", "s1"}


def recorded(calls: list[str], name: str, method: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return method(*args, **kwargs)

    return call


def test_a_fleet_trace_task_is_stored_and_its_lease_released_when_it_answers(
    default_workload: Path, redis_url: str, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's process waits on the lease for a variant another worker traces: each trace is sent as soon as
    it is made (the next one traced meanwhile), so the trace is in the tier and its lease gone within moments
    of `run_task`'s answer, not after the tier client's write-behind gathering (flush_interval, 30 s here), and
    it decodes to the binary a fresh trace gives."""
    from bridge.identity import toolchain_id
    from bridge.parallel import task_document
    from cachestore import entry as entries
    from cachestore.keys import KeySpace
    from cachestore.stores import open_tier
    from workers.trace_tasks import run_task

    namespace = unique_namespace()
    settings = load_settings({"tier": redis_url, "namespace": namespace, "flush_interval": 30.0})
    tier = open_tier(settings)
    try:
        paths = [str(p) for p in sorted(default_workload.glob("*.json"))]
        tasks = plan_variants(paths, tier=tier, target_name=None, limits=Limits()).tasks[:3]
        message = json.dumps({"job": "j", "tasks": [task_document(task) for task in tasks]})
        calls: list[str] = []  # what run_task asks of the tier's write-behind: never to wait for it
        for name in ("send_now", "flush"):
            monkeypatch.setattr(tier, name, recorded(calls, name, getattr(tier, name)))
        assert run_task(message, tier, settings.limits()).counts["parallel_traces"] == 3
        assert calls == ["send_now"] * 3
        keys = KeySpace(namespace)
        leases = [keys.lease(toolchain_id(), task.cache_key) for task in tasks]
        assert wait_until(lambda: not redis_client.exists(*leases), timeout=10)
        for task in tasks:
            stored = redis_client.get(keys.entry(toolchain_id(), task.cache_key))
            assert stored is not None
            assert not redis_client.exists(keys.lease(toolchain_id(), task.cache_key))
            entry = entries.decode_entry(stored, tier.policy, cache_key=task.cache_key)
            assert entry.binary == task_binary(task)
    finally:
        tier.close()
        delete_namespace(redis_client, namespace)


def task_binary(task: Any) -> bytes:
    """The binary tracing `task` gives, traced afresh in this process."""
    from bridge.codegen import BirCodeGenLoop
    from bridge.targets import make_target

    loop = BirCodeGenLoop(make_target(task.target))
    return loop._trace_internal_kernel_to_new_nki_frontend(task.op, task.cache_key)["binary"]


# What may differ between runs of the same compile: where and how long, never what was counted. Every other key
# of `compile --json` (each counter, per pass and in the totals, tier_rejected and misses_* included) is compared.
WHERE_AND_HOW_LONG = {"seconds", "compile_seconds", "tier_saved_seconds", "in_pass_saved_seconds", "parallel_traces",
                      "workers", "tier", "artifact", "artifacts"}  # fmt: skip


def counted(run: dict) -> dict:
    """Everything a compile counted, its tier levels named by position (each run has a tier file of its own)."""

    def strip(document: dict) -> dict:
        kept = {key: value for key, value in document.items() if key not in WHERE_AND_HOW_LONG | {"graphs"}}
        kept["level_hits"] = list(document["level_hits"].values())
        return kept

    return {**strip(run), "graphs": [strip(graph) for graph in run["graphs"]]}


def tier_with_every_other_entry_damaged(path: Path) -> None:
    import sqlite3

    with sqlite3.connect(path) as db:
        keys = [row[0] for row in db.execute("SELECT cache_key FROM entries ORDER BY cache_key")]
        for key in keys[::2]:
            db.execute("UPDATE entries SET data = ? WHERE cache_key = ?", (b"damaged", key))


def test_a_frozen_tier_costs_no_pass_its_timeout(tmp_path: Path) -> None:
    """A tier that accepts connections and never answers: the plan's read waits on a thread of its own while the
    variants are traced, the passes do not wait for it (nor ask it while it is being asked), the compile does
    not wait out op_timeout for it at its end, and it gives tier off's artifacts with one timeout counted."""
    graphs = tmp_path / "graphs"
    generate_workload(graphs, 3, 0)
    env = {**os.environ, "NKICACHE_OP_TIMEOUT": "6", "NKICACHE_BREAKER_COOLDOWN": "600"}
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)
        run = compile_json(graphs, tmp_path / "out", 2, f"redis://127.0.0.1:{frozen.getsockname()[1]}/0", env)
    off = compile_json(graphs, tmp_path / "off", 2, "off")
    assert artifact_bytes(tmp_path / "out") == artifact_bytes(tmp_path / "off")
    assert run["tier_timeouts"] == 1 and run["traces"] == off["traces"]
    assert all(graph["seconds"] < 5 for graph in run["graphs"]), [graph["seconds"] for graph in run["graphs"]]
    assert run["seconds"] < 5  # nor the compile: a plan's read that outlived it was cut short


@pytest.mark.parametrize("state", ["cold", "warm", "damaged", "read-only", "down"])
def test_every_counter_is_the_same_with_1_2_and_4_workers(tmp_path: Path, state: str) -> None:
    """The default workload's six models with a graph that fails half-way in the middle, on a cold, warm,
    damaged (every other entry corrupted), read-only and down tier: every counter of `compile --json`, per pass
    and in the totals, is the same with 1, 2 and 4 workers; only `parallel_traces` says where traces ran."""
    graphs = tmp_path / "graphs"
    paths = generate_workload(graphs, 6, 0)
    failing = json.loads(paths[3].read_text())
    kernels = [op for op in failing["ops"] if "kernel_name" in op]
    kernels[len(kernels) // 2]["kernel_name"] = "not_this_kernel"  # its trace fails half-way through the graph
    paths[3].write_text(json.dumps(failing))
    warmed = tmp_path / "warmed.sqlite"
    if state in ("warm", "damaged", "read-only"):
        compile_json(graphs, tmp_path / "warm", 1, f"local:{warmed}", expect=1)  # all but the failing graph's last ops
        assert not Path(f"{warmed}-wal").exists()  # the compile's last close checkpointed it: the file is whole
    runs = {}
    for workers in (1, 2, 4):
        tier = tmp_path / f"tier-{workers}.sqlite"
        url, env = f"local:{tier}", {**os.environ}
        if warmed.exists():  # each worker count starts from a copy of the same tier
            shutil.copyfile(warmed, tier)
        if state == "damaged":
            tier_with_every_other_entry_damaged(tier)
        if state == "read-only":
            env["NKICACHE_TIER_MODE"] = "read-only"  # what is not stored yet, no pass can read back from it
        if state == "down":
            url = "redis://127.0.0.1:9/0"  # a closed port
            # Retried after breaker_cooldown, a down tier's errors count how long the compile took: not here.
            env["NKICACHE_BREAKER_COOLDOWN"] = "600"
        runs[workers] = compile_json(graphs, tmp_path / f"out-{workers}", workers, url, env, expect=1)
    assert len(runs[1]["failed"]) == 1 and runs[1]["parallel_traces"] == 0
    for workers in (2, 4):
        assert counted(runs[workers]) == counted(runs[1]), workers
        assert artifact_bytes(tmp_path / f"out-{workers}") == artifact_bytes(tmp_path / "out-1")
    if state == "damaged":
        assert runs[1]["tier_rejected"] > 0
    if state in ("cold", "down"):  # (which process traced what varies: only `parallel_traces` says so)
        assert runs[4]["parallel_traces"] > 0
    if state == "cold":  # and a sequential compile's miss causes are the same from run to run
        again = compile_json(graphs, tmp_path / "again", 1, f"local:{tmp_path / 'again.sqlite'}", expect=1)
        causes = [name for name in runs[1] if name.startswith("misses_")]
        assert causes and {name: again[name] for name in causes} == {name: runs[1][name] for name in causes}
