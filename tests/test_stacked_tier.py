"""Stacked tiers (`--tier local:PATH --tier redis://HOST`): reads go down the stack and fill the levels above,
writes go to every level, leases belong to the shared (farthest) level, and each level keeps its own breaker,
so a failing level never turns another off."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers_graphs import MIXED_DISTINCT_KEYS, local_or_fake_backend, mixed_graph, stored_entries, write_graph
from test_read_only import WRITE_METHODS, RecordingBackend

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from cachestore.api import TierUnavailable, WriteItem
from cachestore.client import TierClient
from cachestore.settings import Settings, SettingsError, load_settings
from cachestore.stacked import StackedTier, level_settings
from cachestore.stores import open_backend, open_tier, tier_client
from cachestore.tier_urls import redact_url, shared_level, tier_levels
from workers.cli import main as nkicache
from workers.passes import compile_graph

OTHER = mixed_graph("other", rows=96)  # shares the RMSNorm and Softmax variants of mixed_graph()
OTHER_NEW_KEYS = 2  # its two Matmul variants are new


def settings(**changes: Any) -> Settings:
    return Settings(**{"tier": "test", "host": "host-a", "worker": "w1", "flush_interval": 0.05, **changes})


def stack(near: Any, far: Any, **far_changes: Any) -> StackedTier:
    return StackedTier([TierClient(lambda: near, settings(), "near"),
                        tier_client(lambda: far, settings(**far_changes), "far")])  # fmt: skip


def compile_with(store: Any, graph: dict) -> BirCodeGenLoop:
    loop = BirCodeGenLoop(tier=store)
    loop.run(load_graph(graph))
    return loop


def compile_and_close(store: Any, graph: dict) -> BirCodeGenLoop:
    loop = compile_with(store, graph)
    store.close(timeout=10)
    return loop


@pytest.fixture
def near(tmp_path: Path) -> Any:
    backend = local_or_fake_backend("local", tmp_path)
    yield backend
    backend.close()


@pytest.fixture
def far(tmp_path: Path) -> Any:
    backend = local_or_fake_backend("fakeredis", tmp_path)
    yield backend
    backend.close()


# -- settings: a repeated flag, a list in the config file, a space-separated variable ---------------------
def test_a_stack_from_the_flags_the_config_file_and_the_environment(tmp_path: Path) -> None:
    expected = f"local:{tmp_path}/l1.sqlite redis://127.0.0.1:6379/0"
    levels = (f"local:{tmp_path}/l1.sqlite", "redis://127.0.0.1:6379/0")
    assert load_settings({"tier": levels}, environ={}).tier == expected
    config = tmp_path / "nkicache.toml"
    config.write_text(f"tier = {json.dumps(list(levels))}\n")
    assert load_settings(environ={"NKICACHE_CONFIG": str(config)}).tier == expected
    assert load_settings(environ={"NKICACHE_TIER": "  ".join(levels)}).tier == expected
    assert tier_levels(expected) == list(levels)
    assert shared_level(expected) == "redis://127.0.0.1:6379/0"


def test_a_local_path_with_spaces_is_still_one_level(tmp_path: Path) -> None:
    path = f"local:{tmp_path}/my tiers/off here.sqlite"
    assert tier_levels(path) == [path]
    assert tier_levels(f"{path} redis://h:1") == [path, "redis://h:1"]


@pytest.mark.parametrize(
    ("levels", "problem"),
    [
        (["off", "redis://h:1"], "off cannot be a level of a stack"),
        (["local:/a", "local:/a"], "names one level twice"),
        (["local:/a", "redis://"], "level 'redis://' redis:// needs a host"),
        (["local:/a", "memcached://h:1"], "level 'memcached://h:1' is not a tier"),
        (["redis://h:1 memcached://h:2"], "holds a space"),
        ([], "must be a URL or a list of URLs"),
        (["local:/a", 3], "must be a URL or a list of URLs"),
    ],
)
def test_a_bad_stack_is_one_clear_error(tmp_path: Path, levels: list, problem: str) -> None:
    config = tmp_path / "nkicache.toml"
    config.write_text(f"tier = {json.dumps(levels)}\n")
    with pytest.raises(SettingsError, match=problem) as raised:
        load_settings(environ={"NKICACHE_CONFIG": str(config)})
    assert str(config) in str(raised.value)
    if all(isinstance(level, str) for level in levels) and levels and "memcached" not in levels[-1]:
        # (in one string, "local:/a memcached://h:1" is a local path holding a space)
        with pytest.raises(SettingsError, match=problem):
            load_settings(environ={"NKICACHE_TIER": " ".join(levels)})


def test_a_stack_is_shown_without_its_passwords() -> None:
    shown = redact_url("local:/a rediss://user:SECRET@h:1/0?password=OTHER")
    assert shown == "local:/a rediss://user@h:1/0"


def test_read_only_applies_to_the_shared_level_only() -> None:
    base = settings(tier="local:/a redis://h:1", tier_mode="read-only")
    levels = tier_levels(base.tier)
    assert [level_settings(base, levels, i).tier_mode for i in range(2)] == ["read-through", "read-only"]
    assert [level_settings(base, levels, i).tier for i in range(2)] == levels
    mirror = base.replace(tier_mode="mirror")
    assert {level_settings(mirror, levels, i).tier_mode for i in range(2)} == {"mirror"}


# -- reads go down the stack and fill the levels above ---------------------------------------------------
def test_a_hit_on_the_far_level_fills_the_near_one_and_the_next_compile_stays_near(near: Any, far: Any) -> None:
    compile_and_close(TierClient(lambda: far, settings(worker="writer")), mixed_graph())  # another machine
    recorded = RecordingBackend(far)
    first = stack(near, recorded)
    loop = compile_and_close(first, mixed_graph())
    assert (loop.traces, loop.remote_hits) == (0, MIXED_DISTINCT_KEYS)
    assert first.level_hits() == {"near": 0, "far": MIXED_DISTINCT_KEYS}
    assert set(stored_entries(near)) == set(stored_entries(far))  # filled

    recorded.called.clear()
    second = stack(near, recorded)
    loop = compile_and_close(second, mixed_graph())
    assert (loop.traces, loop.remote_hits) == (0, MIXED_DISTINCT_KEYS)
    assert second.level_hits() == {"near": MIXED_DISTINCT_KEYS, "far": 0}
    assert "fetch" not in recorded.called  # the far level was not read at all


def test_a_trace_is_written_to_every_level_and_leases_are_the_shared_levels(near: Any, far: Any) -> None:
    recorded_near, recorded_far = RecordingBackend(near), RecordingBackend(far)
    loop = compile_and_close(stack(recorded_near, recorded_far), mixed_graph())
    assert loop.traces == MIXED_DISTINCT_KEYS
    assert len(stored_entries(near)) == len(stored_entries(far)) == MIXED_DISTINCT_KEYS
    lease_calls = {"acquire_lease", "release_lease", "release_leases", "renew_lease", "lease_holder"}
    assert lease_calls.isdisjoint(recorded_near.called)
    assert "acquire_lease" in recorded_far.called
    assert "apply_metrics" in recorded_near.called and "apply_metrics" in recorded_far.called


def test_stacked_artifacts_are_byte_identical_to_a_single_tier_and_to_none(near: Any, far: Any) -> None:
    graph = mixed_graph()
    _, untiered = compile_graph(graph)
    single_tier = TierClient(lambda: far, settings())
    _, single = compile_graph(graph, tier=single_tier)
    single_tier.close(timeout=10)  # its writes stored, and its flusher done with `far` before the fixture closes it
    store = stack(near, far)
    _, near_hits = compile_graph(graph, tier=store)
    assert store.level_hits()["near"] == 0 and store.level_hits()["far"] == MIXED_DISTINCT_KEYS
    store.flush(10)
    result, from_near = compile_graph(graph, tier=store)
    store.close(timeout=10)
    assert result.level_hits == {"near": MIXED_DISTINCT_KEYS, "far": 0}
    assert untiered == single == near_hits == from_near


# -- a level failing under the others ---------------------------------------------------------------------
class DownBackend:
    """A Redis that does not answer: every call fails as the Redis backend does when it is down."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any, **kwargs: Any) -> Any:
            raise TierUnavailable("connection refused")

        return fail


class NoWritesBackend(RecordingBackend):
    """A remote whose credentials may read, not write (sccache #2773): every write is refused."""

    def __getattr__(self, name: str) -> Any:
        if name in WRITE_METHODS or name in ("release_leases",):
            raise_refused = TierUnavailable(f"NOPERM this user has no permissions to run the '{name}' command")

            def refuse(*args: Any, **kwargs: Any) -> Any:
                self.called.append(name)
                raise raise_refused

            return refuse
        return super().__getattr__(name)


def test_a_down_far_level_leaves_the_near_level_serving(near: Any, far: Any) -> None:
    compile_and_close(stack(near, far), mixed_graph())  # both levels hold the graph
    down = stack(near, DownBackend())
    loop = compile_with(down, mixed_graph())
    assert (loop.traces, loop.remote_hits) == (0, MIXED_DISTINCT_KEYS)
    # A graph with variants the near level does not hold asks the far one, which fails: traced, and kept near.
    other = compile_with(down, OTHER)
    assert other.traces == OTHER_NEW_KEYS
    down.close(timeout=10)
    assert down.levels[1].counts()["tier_errors"] >= 1  # its breaker opened (the first pass's metrics batch)
    assert down.levels[0].counts()["tier_errors"] == 0  # the near level never failed
    again = compile_and_close(stack(near, DownBackend()), OTHER)
    assert (again.traces, again.remote_hits) == (0, MIXED_DISTINCT_KEYS)


def test_a_remote_that_refuses_writes_does_not_break_the_near_level(near: Any, far: Any) -> None:
    refusing = NoWritesBackend(far)
    store = stack(near, refusing)
    loop = compile_and_close(store, mixed_graph())
    assert loop.traces == MIXED_DISTINCT_KEYS
    assert store.levels[1].counts()["tier_errors"] >= 1 and store.levels[0].counts()["tier_errors"] == 0
    assert len(stored_entries(near)) == MIXED_DISTINCT_KEYS and not stored_entries(far)
    again = compile_and_close(stack(near, NoWritesBackend(far)), mixed_graph())
    assert (again.traces, again.remote_hits) == (0, MIXED_DISTINCT_KEYS)


def test_a_read_only_shared_level_still_fills_the_near_level(near: Any, far: Any) -> None:
    compile_and_close(TierClient(lambda: far, settings(worker="writer")), mixed_graph())
    before = stored_entries(far)
    recorded = RecordingBackend(far)
    store = stack(near, recorded, tier_mode="read-only")
    assert not store.single_flight  # a read-only shared level takes no lease
    hits = compile_with(store, mixed_graph())
    traced = compile_with(store, OTHER)
    store.close(timeout=10)
    assert (hits.remote_hits, traced.traces) == (MIXED_DISTINCT_KEYS, OTHER_NEW_KEYS)
    assert not set(WRITE_METHODS) & set(recorded.called)
    assert stored_entries(far) == before
    assert len(stored_entries(near)) == MIXED_DISTINCT_KEYS + OTHER_NEW_KEYS


# -- end to end: Redis, the command line --------------------------------------------------------------------
def test_a_killed_redis_behind_a_local_level_still_serves_from_it(private_redis_server: Any, tmp_path: Path) -> None:
    server = private_redis_server()
    levels = [f"local:{tmp_path}/l1.sqlite", server.url]
    tier_settings = load_settings({"tier": tuple(levels), "namespace": "stacked"}, environ={})
    compile_and_close(open_tier(tier_settings), mixed_graph())
    server.kill()
    store = open_tier(tier_settings)
    loop = compile_with(store, mixed_graph())  # its metrics batch cannot reach Redis: counted, nothing more
    other = compile_with(store, OTHER)
    store.close(timeout=5)
    assert (loop.traces, loop.remote_hits) == (0, MIXED_DISTINCT_KEYS)
    assert other.traces == OTHER_NEW_KEYS
    assert other.tier_counts()["tier_errors"] + other.tier_counts()["tier_timeouts"] >= 1
    assert store.levels[0].counts()["tier_errors"] == 0


def test_compile_json_reports_hits_per_level(private_redis_server: Any, tmp_path: Path) -> None:
    redis_url = private_redis_server().url
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    write_graph(graphs, mixed_graph())
    local = f"local:{tmp_path}/l1.sqlite"
    env = {"NKICACHE_NAMESPACE": "stacked"}

    def run(*tiers: str, out: str) -> dict:
        flags = [arg for tier in tiers for arg in ("--tier", tier)]
        done = CliRunner().invoke(nkicache, ["compile", str(graphs), "--out", str(tmp_path / out), "--workers", "1",
                                             "--json", *flags], env=env)  # fmt: skip
        assert done.exit_code == 0, done.output
        return json.loads(done.output)

    cold = run(local, redis_url, out="a")
    warm = run(local, redis_url, out="b")
    alone = run(redis_url, out="c")
    assert cold["level_hits"] == {local: 0, redis_url: 0} and cold["traces"] == MIXED_DISTINCT_KEYS
    assert warm["level_hits"] == {local: MIXED_DISTINCT_KEYS, redis_url: 0} and warm["traces"] == 0
    assert alone["level_hits"] == {redis_url: MIXED_DISTINCT_KEYS}
    assert warm["tier"] == f"{local} {redis_url}"
    artifacts = {out: (tmp_path / out / "mixed.nkibb").read_bytes() for out in "abc"}
    assert artifacts["a"] == artifacts["b"] == artifacts["c"]


def test_a_stack_answers_every_call_a_tier_client_does() -> None:
    """The pool, the fleet worker, warm and the codegen loop take either: what one offers, the other must."""
    public = {name for name in dir(TierClient) if not name.startswith("_")}
    assert public - set(dir(StackedTier)) == set()


def test_commands_on_one_store_use_the_shared_level(tmp_path: Path) -> None:
    """report, inspect, warm and the fleet's queue open the farthest level of a configured stack."""
    from cachestore.backends.sqlite import SqliteBackend
    from cachestore.stores import open_backend

    near, far = tmp_path / "near.sqlite", tmp_path / "far.sqlite"
    SqliteBackend(far).close()  # the shared level exists; the near one does not, and must not be made
    reader = open_backend(load_settings({"tier": (f"local:{near}", f"local:{far}")}, environ={}), reading=True)
    try:
        assert Path(reader.path) == far and not near.exists()
    finally:
        reader.close()


@pytest.mark.redis
def test_a_trusted_writers_entries_copied_near_still_verify_there(redis_url: str, tmp_path: Path) -> None:
    """Under a trust policy, the near level keeps the far level's entries as stored, with their writer's
    signature: a reader with no key of its own (whose near level is an untrusted, unsigned scope) would
    otherwise store copies nobody signed, which the policy refuses on every later read."""
    import redis as redis_module
    from helpers_graphs import delete_namespace, unique_namespace
    from helpers_trust import client_of, writer_keys

    keys = writer_keys(tmp_path)
    namespace = unique_namespace()
    far_only = Settings(tier=redis_url, namespace=namespace, host="h", flush_interval=0.05)
    stacked = far_only.replace(tier=f"local:{tmp_path / 'near.sqlite'} {redis_url}")
    try:
        ci = client_of(far_only, keys, "ci")
        compile_and_close(ci, mixed_graph("signed"))
        for run in range(2):
            reader = client_of(stacked, keys, None, tier_mode="read-only")
            loop = compile_and_close(reader, mixed_graph("signed"))
            assert (loop.remote_hits, loop.traces) == (MIXED_DISTINCT_KEYS, 0)
            assert reader.counts()["tier_rejected"] == 0
            near_hits, far_hits = reader.level_hits().values()
            assert (near_hits, far_hits) == ((0, MIXED_DISTINCT_KEYS) if run == 0 else (MIXED_DISTINCT_KEYS, 0))
    finally:
        client = redis_module.Redis.from_url(redis_url)
        delete_namespace(client, namespace)
        client.close()


def test_a_warm_stack_whose_near_level_holds_everything_reads_nothing_from_redis(
    private_redis_server: Any, tmp_path: Path
) -> None:
    """Issue 44: a warm `--tier local:… --tier redis://…` compile with the default --workers (its plan reads the
    variant index) sends Redis no read of an entry, a lease or the index; only the pass's metrics go there."""
    from test_sentinel import monitored_commands

    server = private_redis_server()
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    for rows in (64, 96, 128):
        write_graph(graphs, mixed_graph(f"m{rows}", rows=rows))
    tiers = ["--tier", f"local:{tmp_path}/l1.sqlite", "--tier", server.url]
    env = {"NKICACHE_NAMESPACE": "stacked"}

    def compile_to(out: str) -> dict:
        done = CliRunner().invoke(nkicache, ["compile", str(graphs), "--out", str(tmp_path / out), "--json", *tiers],
                                  env=env)  # fmt: skip
        assert done.exit_code == 0, done.output
        return json.loads(done.output)

    cold = compile_to("cold")
    runs: list[dict] = []
    commands = monitored_commands(server.url, lambda: runs.append(compile_to("warm")), whole=True)
    assert cold["traces"] > 0 and cold["workers"] > 1
    assert runs[0]["traces"] == 0 and runs[0]["level_hits"][server.url] == 0
    metrics = [command for command in commands if "metrics" in command]
    others = [command for command in commands if "metrics" not in command and not command.startswith("HELLO")]
    assert metrics, "MONITOR saw nothing of the passes' metrics batches, which go to every level"
    assert not others, others[:5]


def test_an_entry_refused_at_the_near_level_is_read_from_the_far_one(tmp_path: Path) -> None:
    """Issue 45 F15: a near level holding entries under the wrong keys (two swapped: each intact, each another
    variant's) re-traced them although the far level held good copies. Now a refused entry's key is read from the
    next level, and the good copy is written back near."""
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    write_graph(graphs, mixed_graph())
    near, far = f"local:{tmp_path}/near.sqlite", f"local:{tmp_path}/far.sqlite"

    def run(*tiers: str, out: str) -> dict:
        flags = [arg for tier in tiers for arg in ("--tier", tier)]
        done = CliRunner().invoke(nkicache, ["compile", str(graphs), "--out", str(tmp_path / out), "--workers", "1",
                                             "--json", *flags])  # fmt: skip
        assert done.exit_code == 0, done.output
        return json.loads(done.output)

    run(far, out="far")
    run(near, out="near")
    backend = open_backend(load_settings({"tier": near}, environ={}))
    try:
        entries = stored_entries(backend)
        first, second = sorted(entries)[:2]
        backend.put_entries(
            [WriteItem(first, entries[second], None, 3600), WriteItem(second, entries[first], None, 3600)]
        )
    finally:
        backend.close()
    stacked = run(near, far, out="stacked")
    assert stacked["traces"] == 0 and stacked["tier_rejected"] == 2
    assert stacked["level_hits"][far] == 2 and stacked["remote_hits"] == MIXED_DISTINCT_KEYS
    assert (tmp_path / "stacked" / "mixed.nkibb").read_bytes() == (tmp_path / "far" / "mixed.nkibb").read_bytes()
    again = run(near, far, out="again")
    assert again["tier_rejected"] == 0 and again["level_hits"] == {near: MIXED_DISTINCT_KEYS, far: 0}
