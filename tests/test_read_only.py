"""`--tier-mode read-only`: a client that reads the tier (hits) and never writes to it: no entries, leases,
lease releases, TTL refreshes nor metrics batches, nothing in its outbox. On the embedded tier the file is
left as it was (and a missing one is an empty tier, not created); on Redis only reading commands are sent.
The ACL end-to-end test (the nkicache-reader user) is in test_acl.py."""

from __future__ import annotations

import hashlib
import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from click.testing import CliRunner
from helpers_graphs import MIXED_DISTINCT_KEYS, local_or_fake_backend, mixed_graph, write_graph

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from cachestore.backends.redis import RedisBackend
from cachestore.backends.sqlite import SqliteBackend
from cachestore.client import TierClient, TierStats
from cachestore.keys import KeySpace
from cachestore.read_only import ReadOnlyTier
from cachestore.settings import Settings, SettingsError, load_settings
from cachestore.stores import open_tier
from workers.cli import main as nkicache

WRITE_METHODS = ("store", "apply_metrics", "acquire_lease", "release_lease", "renew_lease")


class RecordingBackend:
    """Forwards every call to a real backend and records which methods were called."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.called: list[str] = []
        self.fetch_ttls: list[int | None] = []

    def fetch(self, cache_keys, ttl):
        self.fetch_ttls.append(ttl)
        return self.__getattr__("fetch")(cache_keys, ttl)

    def close(self) -> None:
        self.called.append("close")  # the fixture closes the real one

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            self.called.append(name)
            return attribute(*args, **kwargs)

        return call


@pytest.fixture(params=["local", "fakeredis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    tier = local_or_fake_backend(request.param, tmp_path)
    yield tier
    tier.close()


def settings(**changes: Any) -> Settings:
    return Settings(**{"tier": "test", "host": "host-a", "worker": "w1", "flush_interval": 0.05, **changes})


def compile_with(client: TierClient, graph: dict) -> BirCodeGenLoop:
    loop = BirCodeGenLoop(tier=client)
    loop.run(load_graph(graph))
    return loop


def fill(backend: Any, graph: dict) -> None:
    """A read-through writer compiles `graph` into the tier."""
    writer = TierClient(lambda: backend, settings(worker="writer"))
    loop = compile_with(writer, graph)
    writer.close(timeout=10)
    assert loop.traces == MIXED_DISTINCT_KEYS


def test_the_setting_takes_read_only() -> None:
    assert load_settings({"tier_mode": "read-only"}).read_only
    assert not load_settings({"tier_mode": "mirror"}).read_only
    with pytest.raises(SettingsError, match="tier_mode"):
        load_settings({"tier_mode": "readonly"})


def test_the_command_line_offers_every_tier_mode_the_settings_take() -> None:
    from cachestore import settings as settings_module
    from workers import cli_common

    assert cli_common.TIER_MODES == settings_module.TIER_MODES


def test_a_read_only_client_hits_and_traces_its_misses_without_one_write(backend: Any) -> None:
    fill(backend, mixed_graph("filled"))
    recording = RecordingBackend(backend)
    reader = ReadOnlyTier(TierClient(lambda: recording, settings(tier_mode="read-only", worker="reader")))
    assert reader.reads and not reader.writes and not reader.single_flight
    hits = compile_with(reader, mixed_graph("filled"))
    misses = compile_with(reader, mixed_graph("other", rows=96))  # other shapes: variants the tier lacks
    reader.close(timeout=10)

    assert (hits.remote_hits, hits.traces) == (MIXED_DISTINCT_KEYS, 0)
    assert misses.traces > 0 and misses.lease_waits == 0
    assert reader.pending() == 0
    assert not set(recording.called) & set(WRITE_METHODS), recording.called
    assert set(recording.called) <= {"fetch", "read_variant_index", "close"}, recording.called  # reads only
    assert recording.fetch_ttls and set(recording.fetch_ttls) == {None}  # read, never refreshed
    counts = reader.counts()
    assert counts.pop("entries_found") == hits.remote_hits + misses.remote_hits  # the entries it answered
    assert counts == dict.fromkeys(set(TierStats.NAMES) - {"entries_found"}, 0)  # no error, nothing dropped
    # What the reader traced was not stored, and the fleet metrics hold the writer's pass alone.
    assert len({raw.cache_key for raw in backend.scan_entries()}) == MIXED_DISTINCT_KEYS
    assert backend.totals()["passes"] == 1


def test_a_read_only_clients_port_writes_are_no_ops(backend: Any) -> None:
    """Called directly (as a loop would with single flight on), the write methods send and queue nothing."""
    recording = RecordingBackend(backend)
    reader = ReadOnlyTier(TierClient(lambda: recording, settings(tier_mode="read-only")))
    loop = BirCodeGenLoop()
    loop.run(load_graph(mixed_graph("direct")))
    result = {"binary": b"x", "input_names": ["a"], "output_names": ["b"], "format": "klir"}
    assert reader.acquire_lease("key") is True  # trace it yourself
    reader.publish_trace("key", result, {"kernel_name": "k"}, 0.1, release_lease=True)
    reader.release_lease("key")
    reader.record_pass(loop.pass_record("direct", 0.0, 1.0))
    assert reader.pending() == 0 and reader.flush(timeout=1) is True
    reader.close(timeout=1)
    assert recording.called == [], recording.called
    assert reader.counts()["tier_dropped"] == 0


def test_a_read_only_hit_on_redis_leaves_the_ttl_alone() -> None:
    """The read-through path refreshes an entry's TTL (EXPIRE); a read-only client reads it with PTTL and
    GETRANGE only, so an entry a writer gave a short life keeps it."""
    server = fakeredis.FakeServer()
    redis_client = fakeredis.FakeRedis(server=server)
    backend = RedisBackend(redis_client, KeySpace(f"t{uuid.uuid4().hex}"))
    fill(backend, mixed_graph("ttl"))
    entry_keys = list(redis_client.scan_iter(match=backend.keys.entry_pattern()))
    for key in entry_keys:
        redis_client.expire(key, 1000)
    reader = ReadOnlyTier(TierClient(lambda: backend, settings(tier_mode="read-only")))
    assert compile_with(reader, mixed_graph("ttl")).remote_hits == MIXED_DISTINCT_KEYS
    assert all(0 < redis_client.ttl(key) <= 1000 for key in entry_keys)
    writer = TierClient(lambda: backend, settings())  # the control: a read-through hit does refresh
    assert compile_with(writer, mixed_graph("ttl")).remote_hits == MIXED_DISTINCT_KEYS
    writer.close(timeout=10)
    assert all(redis_client.ttl(key) > 1000 for key in entry_keys)


# -- the embedded tier, through `nkicache compile` ----------------------------------------------------------
def compile_json(*args: str) -> dict:
    result = CliRunner().invoke(nkicache, ["compile", "--workers", "1", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_read_only_compile_leaves_the_local_tier_file_byte_for_byte(tmp_path: Path) -> None:
    tier = tmp_path / "tier.sqlite"
    graph = write_graph(tmp_path, mixed_graph("local-ro"))
    other = write_graph(tmp_path, mixed_graph("local-ro-other", rows=96))
    filled = compile_json(str(graph), "--out", str(tmp_path / "cold"), "--tier", f"local:{tier}")
    assert filled["traces"] == MIXED_DISTINCT_KEYS
    before = sha256(tier)

    ro = ["--tier", f"local:{tier}", "--tier-mode", "read-only"]
    hits = compile_json(str(graph), "--out", str(tmp_path / "warm"), *ro)
    misses = compile_json(str(other), "--out", str(tmp_path / "other"), *ro)
    again = compile_json(str(other), "--out", str(tmp_path / "again"), *ro)

    assert sha256(tier) == before  # no entry, TTL refresh, lease nor metric written; nothing upgraded
    assert hits["tier_mode"] == "read-only"
    assert (hits["remote_hits"], hits["traces"]) == (MIXED_DISTINCT_KEYS, 0)
    assert misses["traces"] > 0 and again["traces"] == misses["traces"]  # its traces were not stored
    for run in (hits, misses, again):
        assert run["compiled"] == 1
        assert run["tier_errors"] == run["tier_timeouts"] == run["tier_rejected"] == run["tier_dropped"] == 0, run
    warm, cold = tmp_path / "warm" / "local-ro.nkibb", tmp_path / "cold" / "local-ro.nkibb"
    assert warm.read_bytes() == cold.read_bytes()


def test_a_read_only_compile_on_a_missing_local_tier_reads_it_as_empty(tmp_path: Path) -> None:
    tier = tmp_path / "not-yet" / "tier.sqlite"
    graph = write_graph(tmp_path, mixed_graph("missing"))
    run = compile_json(str(graph), "--out", str(tmp_path / "out"), "--tier", f"local:{tier}", "--tier-mode",
                       "read-only")  # fmt: skip
    assert run["compiled"] == 1 and run["traces"] == MIXED_DISTINCT_KEYS and run["remote_hits"] == 0
    assert run["tier_errors"] == run["tier_timeouts"] == run["tier_dropped"] == 0, run
    assert not tier.parent.exists()  # neither the file nor its folder was made


def test_a_read_only_client_finds_a_local_tier_made_after_it_started(tmp_path: Path) -> None:
    path = tmp_path / "tier.sqlite"
    reader = open_tier(settings(tier=f"local:{path}", tier_mode="read-only"))
    assert compile_with(reader, mixed_graph("late")).remote_hits == 0
    assert not path.exists()
    writer = SqliteBackend(path)
    fill(writer, mixed_graph("late"))
    assert compile_with(reader, mixed_graph("late")).remote_hits == MIXED_DISTINCT_KEYS
    assert reader.counts()["tier_errors"] == 0
    reader.close(timeout=1)
    writer.close()


@pytest.mark.parametrize(
    "command",
    [["warm"], ["worker", "--max-jobs", "1"], ["report", "--zero"], ["inspect", "gc"], ["inspect", "gc", "--max-bytes",
     "1M"], ["inspect", "import", "SNAPSHOT"]],
)  # fmt: skip
def test_commands_that_must_write_refuse_read_only(tmp_path: Path, command: list[str]) -> None:
    tier = tmp_path / "tier.sqlite"
    snapshot = tmp_path / "snapshot.nkisnap"
    snapshot.write_bytes(b"")
    env = {"NKICACHE_TIER": f"local:{tier}", "NKICACHE_TIER_MODE": "read-only"}
    result = CliRunner().invoke(nkicache, [str(snapshot) if part == "SNAPSHOT" else part for part in command], env=env)
    assert result.exit_code == 2, result.output
    assert "tier_mode is read-only" in result.output
    assert not tier.exists()


@pytest.mark.parametrize("command", [["submit", "GRAPH"], ["requeue", "--all"], ["purge", "--dead-letters"]])
def test_fleet_commands_that_write_refuse_read_only(tmp_path: Path, command: list[str]) -> None:
    graph = write_graph(tmp_path, mixed_graph("submitted"))
    with socket.socket() as probe:  # a Redis URL nothing answers: the refusal comes before any command is sent
        probe.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{probe.getsockname()[1]}/0"
    env = {"NKICACHE_TIER": url, "NKICACHE_TIER_MODE": "read-only"}
    result = CliRunner().invoke(nkicache, [str(graph) if part == "GRAPH" else part for part in command], env=env)
    assert result.exit_code == 2, result.output
    assert "tier_mode is read-only" in result.output


def test_a_dry_run_gc_only_looks_and_is_allowed_read_only(tmp_path: Path) -> None:
    tier = tmp_path / "tier.sqlite"
    fill(SqliteBackend(tier), mixed_graph("kept"))
    env = {"NKICACHE_TIER": f"local:{tier}", "NKICACHE_TIER_MODE": "read-only"}
    result = CliRunner().invoke(nkicache, ["inspect", "gc", "--dry-run", "--unused-for", "0s", "--json"], env=env)
    assert result.exit_code == 0, result.output
    assert '"dry_run": true' in result.output
