"""The Redis fixtures themselves: a server that answers, namespaces, private servers that can die."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlparse

import pytest
import redis


def _port(url: str) -> int:
    return urlparse(url).port or 6379


def test_redis_url_answers_ping(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        assert client.ping() is True
    finally:
        client.close()


def test_namespace_is_unique_and_writable(redis_client: redis.Redis, redis_namespace: str) -> None:
    key = f"{redis_namespace}probe"
    redis_client.set(key, b"value")
    assert redis_client.get(key) == b"value"
    assert redis_namespace.startswith("nkicache-test:")


def test_private_server_is_distinct_and_can_be_stopped(redis_url: str, private_redis_server) -> None:
    server = private_redis_server()
    assert server.port != _port(redis_url)

    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    try:
        client.set("k", b"v")
        assert client.get("k") == b"v"

        server.stop()
        assert not server.running
        with pytest.raises(redis.ConnectionError):
            client.ping()

        # Restarted without persistence: the server answers again, with an empty keyspace.
        server.start()
        assert client.ping() is True
        assert client.get("k") is None
    finally:
        client.close()

    shared = redis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        assert shared.ping() is True, "stopping a private server must not touch REDIS_URL's server"
    finally:
        shared.close()


def test_private_server_can_be_killed(private_redis_server) -> None:
    first = private_redis_server()
    second = private_redis_server()
    assert first.port != second.port

    first.kill()
    assert not first.running
    assert second.running
    client = redis.Redis.from_url(second.url, socket_timeout=1)
    try:
        assert client.ping() is True
    finally:
        client.close()


KEEPER = """
import sys, time
from bench.dev_redis import start_private_server
server = start_private_server()
print(server.port, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "sigstopped"])
def test_a_private_server_dies_with_the_process_that_started_it(stopped: bool) -> None:
    """Issue 48: a test run killed with -9 left its private redis-servers running (some SIGSTOPped by the fault
    tests). Each one is started to die with its parent: killing the parent ends it within 10 s."""
    keeper = subprocess.Popen([sys.executable, "-c", KEEPER], stdout=subprocess.PIPE, text=True)
    port = int(keeper.stdout.readline())
    url = f"redis://127.0.0.1:{port}/0"
    server_pid = int(redis.Redis.from_url(url).info("server")["process_id"])
    if stopped:
        os.kill(server_pid, signal.SIGSTOP)
    keeper.kill()
    keeper.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(server_pid):
        time.sleep(0.05)
    assert not _alive(server_pid), f"redis-server {server_pid} outlived the process that started it"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, only not yet reaped by its new parent
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
