"""Shared fixtures: a real Redis for the whole session, per-test key namespaces, private servers.

Tests never flush a database: the Redis at REDIS_URL may be shared (CI points it at the machine's server
on 6379), so each test writes under its own key prefix and the prefix is cleaned with SCAN afterwards.
Tests that stop, kill or restart a server use `private_redis_server`, which never touches REDIS_URL's.

When no Redis can be had, Redis tests are skipped locally and fail under CI=true.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bench.dev_redis import RedisServer, answers_ping, start_private_server
from bench.dev_s3 import S3Server

REDIS_FIXTURES = {"redis_url", "redis_client", "redis_namespace", "private_redis_server"}
REDIS_FIXTURES |= {"redis_cluster", "private_redis_cluster"}
START_TIMEOUT_SECONDS = 10.0
CONTROLLER_POLL_SECONDS = 1.0
EXIT_CONTROLLER_GONE = 3


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: Redis tests must not be skipped)", pytrace=False)
    pytest.skip(reason)


def _start_private_server() -> RedisServer:
    """A private server on a free port (the launcher retries when another process grabs the port)."""
    if shutil.which("redis-server") is None:
        _unavailable("redis-server is not installed and REDIS_URL is not set")
    try:
        return start_private_server()
    except RuntimeError as exc:
        _unavailable(str(exc))
        raise AssertionError("unreachable") from None


def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker: exit as soon as the run's controller is gone (killed with -9, say), so the
    servers this worker started, which die with it (bench.dev_redis.die_with_parent), do not outlive the run."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    controller = os.getppid()

    def watch() -> None:
        while os.getppid() == controller:
            time.sleep(CONTROLLER_POLL_SECONDS)
        os._exit(EXIT_CONTROLLER_GONE)

    threading.Thread(target=watch, name="nkicache-controller-watch", daemon=True).start()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses a Redis fixture with `redis`, so `-m "not redis"` selects the rest."""
    for item in items:
        if REDIS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a Redis that answers: REDIS_URL when set, else a private server for this session."""
    url = os.environ.get("REDIS_URL")
    if url:
        if not answers_ping(url):
            _unavailable(f"REDIS_URL={url} does not answer PING")
        yield url
        return
    server = _start_private_server()
    try:
        yield server.url
    finally:
        server.cleanup()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on `redis_url`. Write only under `redis_namespace`; never flush."""
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def redis_namespace(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix unique to this test; every key under it is deleted afterwards."""
    prefix = f"nkicache-test:{uuid.uuid4().hex}:"
    yield prefix
    keys = list(redis_client.scan_iter(match=f"{prefix}*", count=1000))
    for start in range(0, len(keys), 1000):
        redis_client.delete(*keys[start : start + 1000])


@pytest.fixture
def private_redis_server() -> Iterator[Callable[[], RedisServer]]:
    """Factory of private redis-servers for tests that stop, kill or restart them.

    Each call starts a new server on its own free loopback port (never REDIS_URL's server); all of them
    are shut down when the test ends.
    """
    servers: list[RedisServer] = []

    def start() -> RedisServer:
        server = _start_private_server()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.cleanup()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session's S3 server (moto, on loopback); each test that uses it makes its own bucket."""
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3_tier(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://BUCKET/nkicache` in a new bucket of the session's server, with the AWS environment that reaches it
    set for this test and the commands it starts; a generous op_timeout, as the server shares the test's CPU."""
    for name, value in s3_server.environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("NKICACHE_OP_TIMEOUT", "10")
    return f"s3://{s3_server.new_bucket()}/nkicache"


@pytest.fixture(autouse=True)
def isolated_default_tier(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default tier is an SQLite file under $XDG_CACHE_HOME: give every test its own, so tests never
    share cache entries (a remote hit from another test would change its counts) or touch ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    for name in ("NKICACHE_TIER", "NKICACHE_TIER_MODE", "NKICACHE_CONFIG", "NKICACHE_HMAC_KEY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[str]:
    """URL (redis+cluster://...) of a real 3-master Redis Cluster on free loopback ports, shared by the session.

    Tests write under namespaces of their own. Fails instead of skipping under CI=true when it cannot start."""
    cluster = _start_cluster()
    try:
        yield cluster.url
    finally:
        cluster.cleanup()


@pytest.fixture
def private_redis_cluster() -> Iterator[object]:
    """A 3-master Redis Cluster of this test's own (a `redis_cluster.LocalCluster`), for tests that kill masters."""
    cluster = _start_cluster()
    try:
        yield cluster
    finally:
        cluster.cleanup()


def _start_cluster() -> object:
    from redis_cluster import start_cluster

    try:
        return start_cluster()
    except RuntimeError as exc:
        _unavailable(str(exc))
        raise AssertionError("unreachable") from exc


@pytest.fixture
def fleet(private_redis_server, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Makes `test_fleet.Fleet`s (worker processes on a private Redis), each closed after the test."""
    from test_fleet import Fleet

    made: list[Fleet] = []

    def make(**settings: object) -> Fleet:
        made.append(Fleet(private_redis_server().url, tmp_path, **settings))
        return made[-1]

    yield make
    for f in made:
        f.close()


@pytest.fixture
def ci(tmp_path: Path) -> Any:
    """A writer key named ci (the trusted writer of the trust tests)."""
    from cachestore.trust import write_writer_key

    return write_writer_key(tmp_path / "ci.key", "ci")


@pytest.fixture
def laptop(tmp_path: Path) -> Any:
    """A writer key named laptop (the untrusted writer of the trust tests)."""
    from cachestore.trust import write_writer_key

    return write_writer_key(tmp_path / "laptop.key", "laptop")
