"""Shared fixtures: a real Redis for the whole session, per-test key namespaces, private servers.

Tests never flush a database: the Redis at REDIS_URL may be shared (CI points it at the machine's server
on 6379), so each test writes under its own key prefix and the prefix is cleaned with SCAN afterwards.
Tests that stop, kill or restart a server use `private_redis_server`, which never touches REDIS_URL's.

When no Redis can be had, Redis tests are skipped locally and fail under CI=true.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

REDIS_FIXTURES = {"redis_url", "redis_client", "redis_namespace", "private_redis_server"}
REDIS_FIXTURES |= {"redis_cluster", "private_redis_cluster"}
START_TIMEOUT_SECONDS = 10.0


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: Redis tests must not be skipped)", pytrace=False)
    pytest.skip(reason)


def _answers_ping(url: str, timeout: float = 1.0) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A redis-server process of our own on a loopback port, without persistence.

    `stop()` shuts it down gracefully, `kill()` sends SIGKILL, `start()` (re)starts it on the same port.
    """

    def __init__(self, port: int | None = None) -> None:
        self.port = port or _free_loopback_port()
        self.dir = tempfile.mkdtemp(prefix="nkicache-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> RedisServer:
        if self.running:
            return self
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.process.returncode}")
            if _answers_ping(self.url, timeout=0.2):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {START_TIMEOUT_SECONDS} s")

    def stop(self) -> None:
        if self.running:
            self.process.terminate()
            try:
                self.process.wait(timeout=START_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.running:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def _start_private_server(attempts: int = 3) -> RedisServer:
    """Start a server on a free port; retry when another process grabs the port before redis binds it."""
    if shutil.which("redis-server") is None:
        _unavailable("redis-server is not installed and REDIS_URL is not set")
    last_error: Exception | None = None
    for _ in range(attempts):
        server = RedisServer()
        try:
            return server.start()
        except RuntimeError as exc:
            server.cleanup()
            last_error = exc
    _unavailable(f"could not start a private redis-server: {last_error}")
    raise AssertionError("unreachable")


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
        if not _answers_ping(url):
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
