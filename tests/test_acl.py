"""The shared tier's ACL users against a real redis-server run with deploy/redis/redis.conf and an ACL file made
from deploy/redis/users.acl (only the password placeholders replaced: the file's command and key lists are
what is tested), and secrets that never travel on a command line.

- nkicache-worker compiles with a Redis tier (read-through, mirror, metrics, leases) and runs fleet jobs
  (submit, worker, queue), and can touch nothing outside the namespace nor run a dangerous command;
- nkicache-reader reads the namespace and cannot write anything;
- nkicache-untrusted (a laptop, a pull-request build) compiles in its own scope and cannot write the trusted
  scope's entries, leases or digest index;
- `nkicache` has no option that takes a secret; NKICACHE_REDIS_PASSWORD_FILE and NKICACHE_HMAC_KEY_FILE work.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import redis
from click.testing import CliRunner
from helpers_graphs import (
    MIXED_DISTINCT_KEYS,
    metrics_shards,
    mixed_graph,
    summed_metrics_hash,
    wait_until,
    write_graph,
)
from redis_cluster import ServerProcess, start_server, unavailable

from bench.dev_redis import pings
from bridge.identity import toolchain_id
from cachestore.entry import SignaturePolicy, decode_entry, is_signed
from cachestore.keys import KeySpace
from workers.cli import main as nkicache

pytestmark = pytest.mark.redis

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "redis"
PLACEHOLDER = "#" + "0" * 64
PASSWORDS = {"nkicache-worker": "worker-password-for-tests-1", "nkicache-reader": "reader-password-for-tests-2",
             "nkicache-untrusted": "untrusted-password-for-tests-3"}  # fmt: skip
HMAC_KEY = "fleet-hmac-key-for-the-acl-tests"
KEYS = KeySpace("nkicache")  # the namespace users.acl is written for


def acl_file_text() -> str:
    """deploy/redis/users.acl with each user's placeholder replaced by the SHA-256 of its test password."""
    lines = []
    for line in (DEPLOY / "users.acl").read_text().splitlines():
        words = line.split()
        if words[:1] == ["user"] and words[1] in PASSWORDS:
            assert PLACEHOLDER in words, f"users.acl: {words[1]} has no password placeholder"
            digest = hashlib.sha256(PASSWORDS[words[1]].encode()).hexdigest()
            line = line.replace(PLACEHOLDER, "#" + digest)
        lines.append(line)
    text = "\n".join(lines) + "\n"
    assert "user default off" in text
    return text


def redis_conf_text(acl_path: Path, directory: Path, source: str | None = None) -> str:
    """deploy/redis/redis.conf (or `source`) with this test's interface, directory and ACL file (the port is
    an argument)."""
    replaced = {"bind": "127.0.0.1", "dir": str(directory), "aclfile": str(acl_path)}
    lines = []
    for line in (source or (DEPLOY / "redis.conf").read_text()).splitlines():
        name = line.split(" ", 1)[0]
        lines.append(f"{name} {replaced[name]}" if name in replaced else line)
    return "\n".join(lines) + "\n"


def user_client(port: int, user: str, password: str | None = None, **options: Any) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, username=user, password=password or PASSWORDS[user],
                       socket_timeout=5, **options)  # fmt: skip


def _worker_answers(port: int) -> bool:
    return pings(user_client(port, "nkicache-worker", socket_connect_timeout=0.2))


def start_acl_server(directory: Path, conf_source: str | None = None) -> ServerProcess:
    """A redis-server with the deployed config (or `conf_source`) and ACL users; its files in `directory`."""
    acl_path = directory / "users.acl"
    acl_path.write_text(acl_file_text())
    conf_path = directory / "redis.conf"
    conf_path.write_text(redis_conf_text(acl_path, directory, conf_source))
    return start_server([str(conf_path), "--port", "{port}"], _worker_answers)


@pytest.fixture
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Port of a redis-server of this test's own, with the deployed config and ACL users."""
    try:
        server = start_acl_server(tmp_path_factory.mktemp("acl-redis"))
    except RuntimeError as exc:
        unavailable(str(exc))
        raise AssertionError("unreachable") from exc
    try:
        yield server.port
    finally:
        server.cleanup()


def secret_files(tmp_path: Path, user: str = "nkicache-worker", password: str | None = None) -> dict[str, str]:
    """Environment for a client of `user`: the tier URL names the user; the password and HMAC key are files."""
    password_file = tmp_path / f"{user}.password"
    password_file.write_text((password or PASSWORDS[user]) + "\n")  # a trailing newline, as editors leave it
    hmac_file = tmp_path / "hmac.key"
    hmac_file.write_text(HMAC_KEY + "\n")
    return {"NKICACHE_REDIS_PASSWORD_FILE": str(password_file), "NKICACHE_HMAC_KEY_FILE": str(hmac_file)}


@pytest.fixture
def worker_env(acl_server: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"NKICACHE_TIER": f"redis://nkicache-worker@127.0.0.1:{acl_server}/0", **secret_files(tmp_path)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def compile_json(*args: str) -> dict:
    result = CliRunner().invoke(nkicache, ["compile", "--workers", "1", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def totals(client: redis.Redis) -> dict[str, float]:
    return summed_metrics_hash(client, KEYS, lambda shard: shard.totals)


# -- the worker user ------------------------------------------------------------------------------------
def test_worker_compiles_with_the_redis_tier(acl_server: int, worker_env: dict, tmp_path: Path) -> None:
    graph = write_graph(tmp_path, mixed_graph("acl-compile"))
    cold = compile_json(str(graph), "--out", str(tmp_path / "cold"))
    warm = compile_json(str(graph), "--out", str(tmp_path / "warm"))
    mirror = compile_json(str(graph), "--out", str(tmp_path / "mirror"), "--tier-mode", "mirror")
    for run in (cold, warm, mirror):
        assert run["compiled"] == 1
        assert run["tier_errors"] == run["tier_timeouts"] == run["tier_rejected"] == run["tier_dropped"] == 0, run
    assert cold["traces"] == MIXED_DISTINCT_KEYS and cold["remote_hits"] == 0
    assert warm["remote_hits"] == MIXED_DISTINCT_KEYS and warm["traces"] == 0  # read-through
    assert mirror["traces"] == MIXED_DISTINCT_KEYS and mirror["remote_hits"] == 0  # mirror: writes, never reads
    assert (tmp_path / "warm" / "acl-compile.nkibb").read_bytes() == (
        tmp_path / "cold" / "acl-compile.nkibb"
    ).read_bytes()

    reader = user_client(acl_server, "nkicache-reader")
    try:
        fleet = totals(reader)  # the metrics scripts ran under the worker's ACL
        assert fleet["passes"] == 3
        assert fleet["traces"] == 2 * MIXED_DISTINCT_KEYS and fleet["remote_hits"] == MIXED_DISTINCT_KEYS
        entry_keys = list(reader.scan_iter(match=KEYS.entry_pattern(), count=1000))
        assert len(entry_keys) == MIXED_DISTINCT_KEYS
        for key in entry_keys:  # written with the HMAC key from NKICACHE_HMAC_KEY_FILE
            data = reader.get(key)
            assert is_signed(data)
            decode_entry(data, SignaturePolicy(HMAC_KEY.encode(), require_signed=True))
        assert list(reader.scan_iter(match=KEYS.lease_pattern(), count=1000)) == []  # leases taken and released
    finally:
        reader.close()


def nkicache_argv(*args: str) -> list[str]:
    script = Path(sys.executable).parent / "nkicache"
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "workers.cli", *args]


def test_worker_takes_renews_and_releases_a_lease(acl_server: int, worker_env: dict) -> None:
    """The lease scripts run under the worker's ACL: renewal (PEXPIRE) included, which a trace longer than a
    third of lease_ttl needs."""
    from cachestore.backends.redis import RedisBackend
    from cachestore.settings import load_settings

    backend = RedisBackend.open(load_settings())
    try:
        assert backend.acquire_lease("acl-lease", "me", 6.0)
        assert backend.renew_lease("acl-lease", "me", 60.0)
        assert backend.lease_holder("acl-lease") == "me"
        backend.release_lease("acl-lease", "me")
        assert backend.lease_holder("acl-lease") is None
    finally:
        backend.close()


def test_worker_runs_fleet_jobs(acl_server: int, worker_env: dict, tmp_path: Path) -> None:
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    for i in range(2):
        write_graph(graphs, mixed_graph(f"acl-job-{i}", rows=32 + 32 * i))
    # A valid graph no kernel compiles (`submit` refuses a file that is not one): fails twice, then is dead-lettered.
    broken = mixed_graph("broken")
    broken["ops"][0]["func_name"] = "FlashAttention"
    write_graph(graphs, broken)
    env = {"NKICACHE_JOB_MAX_ATTEMPTS": "2", "NKICACHE_HEARTBEAT_INTERVAL": "0.2", "NKICACHE_JOB_CLAIM_IDLE": "30"}
    worker = subprocess.Popen(
        nkicache_argv("worker", "--name", "acl-worker", "--max-jobs", "4"),
        env={**os.environ, **env}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        submitted = subprocess.run(
            nkicache_argv("submit", str(graphs), "--wait", "--timeout", "30", "--json", "--out", str(tmp_path / "out")),
            env={**os.environ, **env}, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        report = json.loads(submitted.stdout)
        assert report["completed"] == 2 and report["dead_letter"] == 1, (
            report,
            submitted.stderr,
            worker.poll() and worker.stderr.read(),
        )
        assert len(report["artifacts"]) == 2
        # Secrets never on a command line: nothing of them shows in the worker's argv (what `ps` prints).
        if worker.poll() is None:
            argv = Path(f"/proc/{worker.pid}/cmdline").read_bytes().decode(errors="replace")
            assert PASSWORDS["nkicache-worker"] not in argv and HMAC_KEY not in argv
    finally:
        _, errors = worker.communicate(timeout=60)
    assert worker.returncode == 0, errors
    assert "NOPERM" not in errors, errors

    status = CliRunner().invoke(nkicache, ["queue", "--json", "--dead-letters"])
    assert status.exit_code == 0, status.output
    queue = json.loads(status.output)
    assert queue["completed"] == 2 and queue["dead_letter"] == 1 and queue["failed"] == 2
    assert queue["pending"] == queue["in_flight"] == 0
    assert [d["job"].rsplit("-", 1)[0] for d in queue["dead_letters"]] == [report["batch"]]
    # The worker left: its heartbeat is gone, so the liveness probe fails.
    live = CliRunner().invoke(nkicache, ["queue", "--live-check", "--name", "acl-worker"])
    assert live.exit_code == 1, live.output

    # The reader may look at a batch and a job; the worker user may requeue and purge.
    reader = {"NKICACHE_TIER": f"redis://nkicache-reader@127.0.0.1:{acl_server}/0",
              **secret_files(tmp_path, "nkicache-reader")}  # fmt: skip
    batch = CliRunner().invoke(nkicache, ["batch", "show", report["batch"], "--json"], env=reader)
    assert batch.exit_code == 1 and json.loads(batch.output)["dead_letter"] == 1, batch.output  # 1: a dead letter
    [dead] = [d["job"] for d in queue["dead_letters"]]
    job = CliRunner().invoke(nkicache, ["job", "show", dead, "--json"], env=reader)
    assert json.loads(job.output)["status"] == "dead_letter", job.output
    requeued = CliRunner().invoke(nkicache, ["requeue", "--all"])
    assert requeued.exit_code == 0 and f"1 job requeued: {dead}" in requeued.output, requeued.output
    purged = CliRunner().invoke(nkicache, ["purge", "--waiting", "--dead-letters"])
    assert purged.exit_code == 0 and "0 dead letters, 1 waiting job" in purged.output, purged.output


def test_worker_heartbeat_passes_the_liveness_probe(acl_server: int, worker_env: dict) -> None:
    from cachestore.settings import load_settings
    from workers.fleet import Worker

    worker = Worker(load_settings(), "acl-live")
    worker._heartbeat()
    try:
        live = CliRunner().invoke(nkicache, ["queue", "--live-check", "--name", "acl-live"])
        assert live.exit_code == 0, live.output
    finally:
        worker.client.hdel(KEYS.worker_heartbeats, "acl-live")


DANGEROUS = [
    ("FLUSHALL",), ("FLUSHDB",), ("KEYS", "*"), ("CONFIG", "GET", "*"), ("CONFIG", "SET", "maxmemory", "1"),
    ("SHUTDOWN", "NOSAVE"), ("MONITOR",), ("ACL", "LIST"), ("ACL", "SETUSER", "x", "on"),
    ("SAVE",), ("BGSAVE",), ("REPLICAOF", "127.0.0.1", "1"), ("MODULE", "LIST"), ("SCRIPT", "FLUSH"),
    ("CLIENT", "KILL", "TYPE", "normal"), ("CLIENT", "PAUSE", "10"), ("CLIENT", "LIST"), ("EVAL", "return 1", "0"),
    ("PUBLISH", "nkicache:channel", "x"), ("SWAPDB", "0", "1"), ("MIGRATE", "127.0.0.1", "1", "", "0", "1"),
]  # fmt: skip
OUTSIDE = ["otherns:x", "{otherns:v1:metrics}:totals", "nkicache", "x:nkicache:y"]


@pytest.mark.parametrize("command", DANGEROUS, ids=lambda c: " ".join(c[:2]))
def test_worker_cannot_run_dangerous_commands(acl_server: int, command: tuple[str, ...]) -> None:
    client = user_client(acl_server, "nkicache-worker")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.execute_command(*command)
    finally:
        client.close()
    assert _worker_answers(acl_server)  # still up


def test_worker_cannot_touch_keys_outside_the_namespace(acl_server: int) -> None:
    client = user_client(acl_server, "nkicache-worker")
    try:
        for key in OUTSIDE:
            for command in (("SET", key, "x"), ("GET", key), ("DEL", key), ("HSET", key, "f", "1"), ("EXISTS", key)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    client.execute_command(*command)
        # Inside the namespace it may; and a script it loads is held to the same key patterns.
        assert client.set("nkicache:v1:entry:{probe}", "x") and client.delete("nkicache:v1:entry:{probe}")
        script = client.register_script("return redis.call('SET', KEYS[1], 'x')")
        assert script(keys=["nkicache:v1:lease:{probe}"]) == b"OK"
        with pytest.raises(redis.exceptions.NoPermissionError):
            script(keys=["otherns:x"])
        flush = client.register_script("return redis.call('FLUSHALL')")
        with pytest.raises(redis.exceptions.ResponseError, match="can't run this command"):
            flush(keys=["nkicache:v1:lease:{probe}"])
    finally:
        client.close()


# -- the reader user ------------------------------------------------------------------------------------
def test_reader_reads_the_namespace_and_cannot_write(acl_server: int, worker_env: dict, tmp_path: Path) -> None:
    compile_json(str(write_graph(tmp_path, mixed_graph("acl-read"))), "--out", str(tmp_path / "out"))
    reader = user_client(acl_server, "nkicache-reader")
    try:
        entry_key = next(iter(reader.scan_iter(match=KEYS.entry_pattern(), count=1000)))
        assert reader.get(entry_key) is not None and reader.ttl(entry_key) > 0
        assert totals(reader)["passes"] == 1
        shards = metrics_shards(reader, KEYS)
        assert len(shards) == 64 and reader.get(KEYS.metrics_shard_count) == b"64"
        assert any(reader.xrange(shard.pass_log) for shard in shards)
        assert any(reader.hgetall(shard.kernel_calls) for shard in shards)
        home = KEYS.metrics_shard(0)
        writes = [
            ("SET", entry_key, "x"),
            ("GETEX", entry_key, "EX", "1"),
            ("DEL", entry_key),
            ("EXPIRE", entry_key, "1"),
            ("HSET", home.totals, "passes", "0"),
            ("HINCRBY", home.totals, "x", "1"),
            ("XADD", home.pass_log, "*", "pass", "{}"),
            ("SET", KEYS.metrics_shard_count, "1"),
            ("XGROUP", "CREATE", KEYS.job_shard(0).stream(toolchain_id()), "g", "0", "MKSTREAM"),
            ("SCRIPT", "LOAD", "return 1"),
            ("EVALSHA", "0" * 40, "1", home.totals),
            ("EVAL", "return 1", "0"),
            ("FLUSHALL",),
            ("KEYS", "*"),
        ]
        for command in writes:
            with pytest.raises(redis.exceptions.NoPermissionError):
                reader.execute_command(*command)
        assert totals(reader)["passes"] == 1
    finally:
        reader.close()


def test_reader_compiles_read_only_with_no_tier_errors(
    acl_server: int, worker_env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`compile --tier-mode read-only` as nkicache-reader: hits from what the worker user stored, its own
    misses traced, and not one command the ACL refuses (no store, lease, TTL refresh nor metrics batch)."""
    graph = write_graph(tmp_path, mixed_graph("acl-ro"))
    other = write_graph(tmp_path, mixed_graph("acl-ro-other", rows=96))  # shapes the worker never compiled
    filled = compile_json(str(graph), "--out", str(tmp_path / "cold"))  # as the worker user
    assert filled["traces"] == MIXED_DISTINCT_KEYS
    worker, reader = user_client(acl_server, "nkicache-worker"), user_client(acl_server, "nkicache-reader")
    entry_keys = list(reader.scan_iter(match=KEYS.entry_pattern(), count=1000))
    for key in entry_keys:
        worker.expire(key, 1000)  # a read-through hit would give them entry_ttl (30 days) again
    passes_before = totals(reader)["passes"]

    (tmp_path / "reader").mkdir()
    monkeypatch.setenv("NKICACHE_TIER", f"redis://nkicache-reader@127.0.0.1:{acl_server}/0")
    for name, value in secret_files(tmp_path / "reader", "nkicache-reader").items():
        monkeypatch.setenv(name, value)
    hits = compile_json(str(graph), "--out", str(tmp_path / "warm"), "--tier-mode", "read-only")
    misses = compile_json(str(other), "--out", str(tmp_path / "other"), "--tier-mode", "read-only")
    try:
        for run in (hits, misses):
            assert run["compiled"] == 1 and run["tier_mode"] == "read-only"
            assert run["tier_errors"] == run["tier_timeouts"] == run["tier_rejected"] == run["tier_dropped"] == 0, run
        assert (hits["remote_hits"], hits["traces"]) == (MIXED_DISTINCT_KEYS, 0)
        assert misses["traces"] > 0 and misses["lease_waits"] == 0
        assert (tmp_path / "warm" / "acl-ro.nkibb").read_bytes() == (tmp_path / "cold" / "acl-ro.nkibb").read_bytes()
        run = subprocess.run(nkicache_argv("run", "--check", "--json", str(tmp_path / "warm"), str(tmp_path / "other")),
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        assert json.loads(run.stdout)["ok"] is True, run.stderr
        # Nothing written: the same entries with the TTLs they had, no pass counted, no lease.
        assert sorted(reader.scan_iter(match=KEYS.entry_pattern(), count=1000)) == sorted(entry_keys)
        assert all(0 < reader.ttl(key) <= 1000 for key in entry_keys)
        assert totals(reader)["passes"] == passes_before
        assert list(reader.scan_iter(match=KEYS.lease_pattern(), count=1000)) == []
    finally:
        worker.close()
        reader.close()


def test_reader_compiles_the_default_workload_read_only(
    acl_server: int, worker_env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22's "done when": the default workload (`nkicache workload`'s defaults), filled by the worker user,
    compiled by a read-only client as the reader: every lookup a hit, zero tier errors, the same artifacts."""
    graphs = tmp_path / "graphs"
    assert CliRunner().invoke(nkicache, ["workload", "--out", str(graphs)]).exit_code == 0
    cold = compile_json(str(graphs), "--out", str(tmp_path / "cold"))
    assert cold["compiled"] == cold["passes"] > 1 and cold["tier_errors"] == 0
    (tmp_path / "reader").mkdir()
    monkeypatch.setenv("NKICACHE_TIER", f"redis://nkicache-reader@127.0.0.1:{acl_server}/0")
    for name, value in secret_files(tmp_path / "reader", "nkicache-reader").items():
        monkeypatch.setenv(name, value)
    warm = compile_json(str(graphs), "--out", str(tmp_path / "warm"), "--tier-mode", "read-only")
    assert warm["tier_errors"] == warm["tier_timeouts"] == warm["tier_rejected"] == warm["tier_dropped"] == 0, warm
    assert warm["compiled"] == cold["compiled"] and warm["traces"] == 0
    assert warm["remote_hits"] == warm["tier_lookups"] == cold["tier_lookups"] > 0
    for artifact in (tmp_path / "cold").glob("*.nkibb"):
        assert (tmp_path / "warm" / artifact.name).read_bytes() == artifact.read_bytes(), artifact.name


def test_reader_runs_the_read_only_commands(acl_server: int, worker_env: dict, tmp_path: Path, monkeypatch) -> None:
    compile_json(str(write_graph(tmp_path, mixed_graph("acl-report"))), "--out", str(tmp_path / "out"))
    (tmp_path / "reader").mkdir()
    monkeypatch.setenv("NKICACHE_TIER", f"redis://nkicache-reader@127.0.0.1:{acl_server}/0")
    for name, value in secret_files(tmp_path / "reader", "nkicache-reader").items():
        monkeypatch.setenv(name, value)
    queue = CliRunner().invoke(nkicache, ["queue", "--json"])
    assert queue.exit_code == 0, queue.output  # `queue` only reads: an operator may run it as the reader
    ran = 0
    for command in (["report", "--json"], ["inspect", "ls", "--json"], ["inspect", "verify", "--json"]):
        if command[0] not in nkicache.list_commands(None):
            continue
        result = CliRunner().invoke(nkicache, command)
        assert result.exit_code == 0, (command, result.output)
        ran += 1
    if ran == 0:
        pytest.skip("nkicache report and inspect are not there yet; the reader ran `queue` only")


def test_reader_runs_the_sentinel_read_only(acl_server: int, worker_env: dict, tmp_path: Path, monkeypatch) -> None:
    """Issue 35: `sentinel --tier-mode read-only` runs as nkicache-reader (which may send no write at all) and
    checks every entry the worker user stored."""
    compile_json(str(write_graph(tmp_path, mixed_graph("acl-sentinel"))), "--out", str(tmp_path / "out"))
    (tmp_path / "reader").mkdir()
    monkeypatch.setenv("NKICACHE_TIER", f"redis://nkicache-reader@127.0.0.1:{acl_server}/0")
    for name, value in secret_files(tmp_path / "reader", "nkicache-reader").items():
        monkeypatch.setenv(name, value)
    result = CliRunner().invoke(nkicache, ["sentinel", "--tier-mode", "read-only", "--rate", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["read_only"] and report["sampled"] == report["entries"] == report["matched"] == MIXED_DISTINCT_KEYS


def test_reader_sees_the_jobs_that_wait_for_a_toolchain(
    acl_server: int, worker_env: dict, tmp_path: Path, monkeypatch
) -> None:
    """An operator runs `queue` as the reader while a job waits on its toolchain's stream and no worker is live:
    the reader's commands find every toolchain's stream, and the toolchain is named as unserved."""
    graph = write_graph(tmp_path, mixed_graph("acl-waiting"))
    submitted = CliRunner().invoke(nkicache, ["submit", str(graph), "--json"])  # as the worker user
    assert submitted.exit_code == 0, submitted.output
    toolchain = json.loads(submitted.output)["toolchain"]
    (tmp_path / "reader").mkdir()
    monkeypatch.setenv("NKICACHE_TIER", f"redis://nkicache-reader@127.0.0.1:{acl_server}/0")
    for name, value in secret_files(tmp_path / "reader", "nkicache-reader").items():
        monkeypatch.setenv(name, value)
    queue = CliRunner().invoke(nkicache, ["queue", "--json"])
    assert queue.exit_code == 0, queue.output
    status = json.loads(queue.output)
    assert status["unserved"] == {toolchain: 1} and (status["pending"], status["in_flight"]) == (1, 0)
    text = CliRunner().invoke(nkicache, ["queue"])
    assert text.exit_code == 0 and f"1 job waits for toolchain {toolchain}, which no live worker has" in text.output


# -- secrets ---------------------------------------------------------------------------------------------
SECRET_WORDS = ("password", "passwd", "secret", "hmac", "token", "credential")


def walk(command: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Parameter]]:
    for parameter in command.params:
        yield path, parameter
    if isinstance(command, click.Group):
        for name in command.list_commands(None):
            yield from walk(command.get_command(None, name), (*path, name))


def test_no_command_line_option_takes_a_secret() -> None:
    seen = 0
    for path, parameter in walk(nkicache):
        seen += 1
        names = [parameter.name or "", *getattr(parameter, "opts", []), *getattr(parameter, "secondary_opts", [])]
        for name in names:
            assert not any(word in name.lower() for word in SECRET_WORDS), f"nkicache {' '.join(path)} {name}"
    assert seen > 20  # the walk saw the whole tree


def test_password_and_hmac_key_files_work_and_a_wrong_password_is_counted(
    acl_server: int, worker_env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cachestore.settings import load_settings

    settings = load_settings()
    assert settings.redis_password == PASSWORDS["nkicache-worker"]  # the file's trailing newline stripped
    assert settings.hmac_key == HMAC_KEY.encode()
    assert PASSWORDS["nkicache-worker"] not in repr(settings) and HMAC_KEY not in repr(settings)

    graph = write_graph(tmp_path, mixed_graph("acl-secrets"))
    assert compile_json(str(graph), "--out", str(tmp_path / "a"))["tier_errors"] == 0
    (tmp_path / "wrong").mkdir()
    for name, value in secret_files(tmp_path / "wrong", password="not-the-password").items():
        monkeypatch.setenv(name, value)
    started = time.monotonic()
    refused = compile_json(str(graph), "--out", str(tmp_path / "b"))
    assert refused["compiled"] == 1 and refused["traces"] == MIXED_DISTINCT_KEYS  # compiled without the tier
    assert refused["tier_errors"] >= 1  # WRONGPASS, counted
    assert time.monotonic() - started < 10
    assert wait_until(lambda: _worker_answers(acl_server), timeout=1)


def test_the_untrusted_user_writes_its_own_scope_only(
    acl_server: int, worker_env: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 22's scopes, enforced by the server: as nkicache-untrusted, a writer whose key the trust policy
    does not list compiles in its own scope with zero tier errors; writing a trusted entry, lease or digest
    key is refused, and a client forced into the trusted scope cannot store there."""
    from cachestore.keys import partition
    from cachestore.trust import write_writer_key

    write_writer_key(tmp_path / "ci.key", "ci")
    laptop = write_writer_key(tmp_path / "laptop.key", "laptop")
    policy = tmp_path / "trust.toml"
    policy.write_text((tmp_path / "ci.key.pub").read_text())
    monkeypatch.setenv("NKICACHE_TRUST_POLICY", str(policy))
    graph = write_graph(tmp_path, mixed_graph("acl-untrusted"))
    monkeypatch.setenv("NKICACHE_WRITER_KEY_FILE", str(tmp_path / "ci.key"))
    trusted = compile_json(str(graph), "--out", str(tmp_path / "trusted"))  # the worker user, key ci
    assert trusted["traces"] == MIXED_DISTINCT_KEYS and trusted["tier_errors"] == 0

    (tmp_path / "laptop").mkdir()
    monkeypatch.setenv("NKICACHE_TIER", f"redis://nkicache-untrusted@127.0.0.1:{acl_server}/0")
    for name, value in secret_files(tmp_path / "laptop", "nkicache-untrusted").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NKICACHE_WRITER_KEY_FILE", str(tmp_path / "laptop.key"))
    cold = compile_json(str(graph), "--out", str(tmp_path / "cold"))
    warm = compile_json(str(graph), "--out", str(tmp_path / "warm"))
    for run in (cold, warm):
        assert run["tier_errors"] == run["tier_timeouts"] == run["tier_rejected"] == run["tier_dropped"] == 0, run
    assert (cold["traces"], warm["remote_hits"]) == (MIXED_DISTINCT_KEYS, MIXED_DISTINCT_KEYS)
    scope = partition(toolchain_id(), f"w-{laptop.key_id_hex}")
    untrusted, reader = user_client(acl_server, "nkicache-untrusted"), user_client(acl_server, "nkicache-reader")
    try:
        assert len(list(reader.scan_iter(match=KEYS.entry_pattern(scope), count=1000))) == MIXED_DISTINCT_KEYS
        trusted_keys = list(reader.scan_iter(match=KEYS.entry_pattern(toolchain_id()), count=1000))
        assert len(trusted_keys) == MIXED_DISTINCT_KEYS
        cache_key = KEYS.parse_entry(trusted_keys[0].decode())[1]
        for key in (KEYS.entry(toolchain_id(), cache_key), KEYS.lease(toolchain_id(), cache_key)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                untrusted.set(key, b"planted")
        with pytest.raises(redis.exceptions.NoPermissionError):
            untrusted.delete(key)
        assert untrusted.get(KEYS.entry(toolchain_id(), cache_key))  # it may read the trusted scope
        monkeypatch.setenv("NKICACHE_SCOPE", "trusted")
        other = write_graph(tmp_path, mixed_graph("acl-untrusted-other", rows=96))
        forced = compile_json(str(other), "--out", str(tmp_path / "forced"))
        assert forced["tier_errors"] > 0  # its stores and leases are refused by the server
        assert len(list(reader.scan_iter(match=KEYS.entry_pattern(toolchain_id()), count=1000))) == len(trusted_keys)
    finally:
        untrusted.close()
        reader.close()
