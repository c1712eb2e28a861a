"""The Redis fixtures themselves: a server that answers, namespaces, private servers that can die."""

from __future__ import annotations

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
