"""The determinism sentinel (issue 22): a trusted-signed, self-consistent entry whose binary is not what the
compiler produces is quarantined at 100% sampling (never served again, kept in the quarantine scope, counted
per writer and toolchain); on the default workload nothing is quarantined. On the embedded tier and Redis."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from helpers_graphs import MIXED_DISTINCT_KEYS, mixed_graph
from helpers_trust import client_of, compile_with, fresh_tier, writer_keys

from bridge.graph import load_graph
from bridge.identity import toolchain_id
from cachestore.api import WriteItem
from cachestore.entry import SignaturePolicy, encode_entry
from cachestore.inspect import decode_or_reason
from cachestore.keys import QUARANTINE_SCOPE, partition
from cachestore.report import build_report
from cachestore.report_render import render_prometheus, render_text
from cachestore.settings import Settings, SettingsError, load_settings
from cachestore.stores import open_backend
from workers.cli import main as nkicache
from workers.sentinel import run_sentinel
from workers.workload import generate_workload


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    yield from fresh_tier(request, tmp_path)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Any]:
    return writer_keys(tmp_path)


def trusted_reader(base: Settings) -> Any:
    return open_backend(base, reading=True, partition=partition(toolchain_id()))


def policy_of(keys: dict[str, Any]) -> SignaturePolicy:
    from cachestore.trust import load_trust_policy

    return SignaturePolicy(trust=load_trust_policy(keys["policy"]))


def plant_wrong_binary(base: Settings, keys: dict[str, Any], graph: dict) -> tuple[str, bytes]:
    """ci compiles `graph`; one of its full entries is replaced by one ci signs whose binary differs (its
    digest and signature consistent with it): what a non-deterministic or miscompiling host would store."""
    ci = client_of(base, keys, "ci")
    compile_with(ci, graph)
    ci.close(timeout=10)
    store = trusted_reader(base)
    try:
        stored = store.get_entries(sorted(store.find_keys("", 100)))
        key, data = sorted(stored.items())[0]
        entry = decode_or_reason(data, cache_key=key)
        # The digest of the wrong binary (computed anew): the entry is consistent.
        wrong = msgspec.structs.replace(entry, binary=entry.binary[:-1] + bytes([entry.binary[-1] ^ 0xFF]), digest="")
        store.put_entries([WriteItem(key, encode_entry(wrong, writer=keys["ci"], cache_key=key), wrong.digest, 3600)])
    finally:
        store.close()
    return key, wrong.binary


def test_the_sentinel_quarantines_a_trusted_entry_with_a_wrong_binary(base: Settings, keys: dict[str, Any]) -> None:
    graph = mixed_graph("sentinel")
    key, wrong = plant_wrong_binary(base, keys, graph)
    reader = client_of(base, keys, None, tier_mode="read-only")
    assert reader.lookup(key).binary == wrong  # served before the sentinel runs: the signature is fine

    store = trusted_reader(base)
    try:
        report = run_sentinel(store, policy_of(keys), rate=1.0, host="s")
        assert report.sampled == report.entries > 0
        assert [item["key"] for item in report.quarantined] == [key]
        assert report.quarantined[0]["writer"] == keys["ci"].key_id_hex
        assert report.matched == report.sampled - 1 and not report.failed
        # Kept for inspection, in the quarantine scope; counted in the metrics per writer and toolchain.
        kept = store.in_partition(partition(toolchain_id(), QUARANTINE_SCOPE)).get_entries([key])
        assert decode_or_reason(kept[key]).binary == wrong
        totals = store.totals()
        assert totals["quarantined"] == 1 and totals[f"quarantined_writer:{keys['ci'].key_id_hex}"] == 1
        assert totals["sentinel_checked"] == report.sampled
        assert store.toolchains()[toolchain_id()]["quarantined"] == 1
        # `report` and Prometheus show it per writer and toolchain, with what each writer stored and served.
        report_ = build_report(store, top=0, timeline=False)
        ci_id = keys["ci"].key_id_hex
        assert report_.trust["writers"][ci_id] == {"stored": MIXED_DISTINCT_KEYS, "served": 0, "quarantined": 1}
        assert report_.trust["quarantined_by_toolchain"] == {toolchain_id(): 1}
        assert f"{ci_id}" in render_text(report_) and "1 quarantined" in render_text(report_)
        exposition = render_prometheus(report_)
        assert "nkicache_quarantined_total 1.0" in exposition
        assert f'nkicache_writer_quarantined_total{{writer="{ci_id}"}} 1.0' in exposition
    finally:
        store.close()

    # Never served again: the variant is traced anew, and the compiler's own binary is what the pass uses.
    assert reader.lookup(key) is None
    loop = compile_with(reader, graph)
    assert (loop.remote_hits, loop.traces) == (MIXED_DISTINCT_KEYS - 1, 1)
    assert loop._new_nki_frontend_kernel_cache[key]["binary"] != wrong
    reader.close()


def test_the_sentinel_command_exits_1_when_it_quarantines(base: Settings, keys: dict[str, Any]) -> None:
    key, _ = plant_wrong_binary(base, keys, mixed_graph("sentinel-cli"))
    env = {"NKICACHE_NAMESPACE": base.namespace, "NKICACHE_TRUST_POLICY": keys["policy"]}
    result = CliRunner().invoke(nkicache, ["sentinel", "--tier", base.tier, "--rate", "1"], env=env)
    assert result.exit_code == 1, result.output
    assert f"quarantined {key[:16]}" in result.output and "1 quarantined" in result.output
    again = CliRunner().invoke(nkicache, ["sentinel", "--tier", base.tier, "--rate", "1"], env=env)
    assert again.exit_code == 0 and "0 quarantined" in again.output
    bad = CliRunner().invoke(nkicache, ["sentinel", "--tier", base.tier, "--rate", "2"], env=env)
    assert bad.exit_code != 0 and "0 to 1" in bad.output


def test_on_the_default_workload_the_sentinel_quarantines_nothing(
    base: Settings, keys: dict[str, Any], tmp_path: Path
) -> None:
    ci = client_of(base, keys, "ci")
    for path in generate_workload(tmp_path / "workload", 12, 0):
        from bridge.codegen import BirCodeGenLoop

        BirCodeGenLoop(tier=ci).run(load_graph(path))
    ci.close(timeout=30)
    store = trusted_reader(base)
    try:
        report = run_sentinel(store, policy_of(keys), rate=1.0, rng=random.Random(0))
    finally:
        store.close()
    assert report.sampled == report.entries > 20
    assert (report.quarantined, report.failed, report.matched) == ([], [], report.sampled)


def test_sampling_follows_the_rate_and_the_scope_quarantine_is_reserved(base: Settings, keys: dict[str, Any]) -> None:
    ci = client_of(base, keys, "ci")
    compile_with(ci, mixed_graph("sampled"))
    ci.close(timeout=10)
    store = trusted_reader(base)
    try:
        assert run_sentinel(store, policy_of(keys), rate=0.0).sampled == 0
        recent = run_sentinel(store, policy_of(keys), rate=1.0, since=3600)
        assert recent.sampled == recent.entries  # all used by the pass just now
    finally:
        store.close()
    with pytest.raises(SettingsError, match="quarantine"):
        load_settings({"scope": "quarantine"}, environ={})
    with pytest.raises(SettingsError, match="sentinel_rate"):
        load_settings({"sentinel_rate": "1.5"}, environ={})


# Redis commands that change data (MONITOR shows every command a client sends; these must not be among them).
WRITE_COMMANDS = set(
    [
        "SET",
        "SETEX",
        "GETEX",
        "DEL",
        "UNLINK",
        "EXPIRE",
        "PEXPIRE",
        "PERSIST",
        "HSET",
        "HSETNX",
        "HINCRBY",
        "HINCRBYFLOAT",
        "HDEL",
        "SADD",
        "SREM",
        "RPUSH",
        "LPUSH",
        "XADD",
        "XACK",
        "XDEL",
        "XGROUP",
        "EVAL",
        "EVALSHA",
        "SCRIPT",
        "FCALL",
        "MSET",
        "RENAME",
        "COPY",
        "INCR",
        "INCRBY",
    ]
)


def monitored_commands(url: str, run: Any, whole: bool = False) -> list[str]:
    """The command names (`whole`: the whole commands) the server receives while `run()` runs (from a MONITOR
    connection of its own)."""
    import threading

    import redis

    monitor_client = redis.Redis.from_url(url)
    seen: list[str] = []
    with monitor_client.monitor() as monitor:
        done = threading.Event()

        def collect() -> None:
            for command in monitor.listen():
                words = command["command"].split()
                if words and words[0] == "PING" and len(words) > 1 and "sentinel-test-end" in words[1]:
                    done.set()
                    return
                seen.append(command["command"] if whole else words[0].upper() if words else "")

        thread = threading.Thread(target=collect, daemon=True)
        thread.start()
        run()
        redis.Redis.from_url(url).execute_command("PING", "sentinel-test-end")
        assert done.wait(10)
    monitor_client.close()
    return seen


def test_a_read_only_sentinel_sends_no_write_and_reports_what_it_would_quarantine(
    private_redis_server: Any, keys: dict[str, Any]
) -> None:
    """Issue 35: `sentinel --tier-mode read-only` finds the planted mismatch, says it would quarantine it, exits 1,
    and the server receives not one writing command (counted with MONITOR): the entry is still served."""
    server = private_redis_server()
    base = Settings(tier=server.url, namespace="nkicache", host="h", flush_interval=0.05)
    key, wrong = plant_wrong_binary(base, keys, mixed_graph("sentinel-ro"))
    env = {"NKICACHE_NAMESPACE": base.namespace, "NKICACHE_TRUST_POLICY": keys["policy"]}
    results = []

    def sweep() -> None:
        argv = ["sentinel", "--tier", base.tier, "--rate", "1", "--tier-mode", "read-only"]
        results.append(CliRunner().invoke(nkicache, argv, env=env))
        results.append(CliRunner().invoke(nkicache, [*argv, "--json"], env=env))

    commands = monitored_commands(server.url, sweep)
    text, as_json = results
    assert text.exit_code == 1, text.output
    assert f"would quarantine (read-only) {key[:16]}" in text.output, text.output
    assert as_json.exit_code == 1 and '"read_only": true' in as_json.output
    assert commands and not set(commands) & WRITE_COMMANDS, sorted(set(commands))
    reader = client_of(base, keys, None, tier_mode="read-only")
    try:
        assert reader.lookup(key).binary == wrong  # not moved
    finally:
        reader.close()
    store = trusted_reader(base)
    try:
        assert store.in_partition(partition(toolchain_id(), QUARANTINE_SCOPE)).get_entries([key]) == {}
        assert store.totals().get("sentinel_checked", 0) == 0
    finally:
        store.close()
