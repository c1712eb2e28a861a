"""The compile path's value reads on a connection of their own (cachestore/backends/direct_reads.py): the same
replies as redis-py's commands, kept in step after a refused command, a killed connection or a fork, and used
only where a client is a plain redis-py client."""

from __future__ import annotations

import os
from collections.abc import Iterator

import fakeredis
import pytest
import redis
from redis.cache import CacheConfig

from cachestore.backends.direct_reads import DirectReader
from cachestore.backends.redis import RedisBackend
from cachestore.keys import KeySpace


@pytest.fixture
def reader(redis_client: redis.Redis) -> Iterator[DirectReader]:
    direct = DirectReader(redis_client)
    yield direct
    direct.disconnect()


def test_only_a_plain_redis_py_client_is_read_directly(redis_url: str) -> None:
    plain = redis.Redis.from_url(redis_url)
    assert DirectReader.usable(plain) and RedisBackend(plain, KeySpace("nkidirect"))._direct is not None
    fake = fakeredis.FakeRedis()
    assert not DirectReader.usable(fake) and RedisBackend(fake, KeySpace("nkidirect"))._direct is None
    texts = redis.Redis.from_url(redis_url, decode_responses=True)  # would hand entries over as text
    assert not DirectReader.usable(texts)
    texts.close()
    cached = redis.Redis.from_url(redis_url, protocol=3, cache_config=CacheConfig())  # client-side caching
    assert not DirectReader.usable(cached)
    cached.close()
    plain.close()


def test_getranges_read_what_redis_py_reads(
    reader: DirectReader, redis_client: redis.Redis, redis_namespace: str
) -> None:
    keys = [f"{redis_namespace}{n}" for n in range(5)]
    values = [os.urandom(n * 700) for n in range(5)]  # the first is empty: an empty value reads as b""
    for key, value in zip(keys, values, strict=True):
        redis_client.set(key, value)
    missing = f"{redis_namespace}missing"
    asked = [*keys, missing]
    assert reader.getranges(asked, 0, 999) == [redis_client.getrange(key, 0, 999) for key in asked]
    assert reader.getranges([keys[4]], 0, 1 << 20) == [values[4]]
    assert reader.getranges([keys[3]], 100, 199) == [values[3][100:200]]


def test_a_refused_command_raises_after_every_reply_is_read_and_the_next_read_is_in_step(
    reader: DirectReader, redis_client: redis.Redis, redis_namespace: str
) -> None:
    """Another tool's hash under one of the keys: GETRANGE is refused (WRONGTYPE). The replies after it are
    read too, so the next call's replies are its own, not the tail of this one's."""
    keys = [f"{redis_namespace}{n}" for n in range(4)]
    for n, key in enumerate(keys):
        redis_client.set(key, b"value %d" % n)
    redis_client.delete(keys[1])
    redis_client.hset(keys[1], "a", "hash")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        reader.getranges(keys, 0, 99)
    assert reader.getranges([keys[3], keys[0]], 0, 99) == [b"value 3", b"value 0"]


def test_a_connection_the_server_killed_is_made_again(
    reader: DirectReader, redis_client: redis.Redis, redis_namespace: str
) -> None:
    key = f"{redis_namespace}k"
    redis_client.set(key, b"v")
    assert reader.getranges([key], 0, 9) == [b"v"]
    redis_client.client_setname("nkicache-direct-test-admin")
    for client in redis_client.client_list():
        if client["name"] != "nkicache-direct-test-admin" and int(client["id"]) == _direct_client_id(reader):
            redis_client.client_kill_filter(_id=client["id"])
    results = []
    for _ in range(2):  # the first read may fail on the dead socket; it never returns another read's bytes
        try:
            results.append(reader.getranges([key], 0, 9))
        except redis.ConnectionError:
            results.append("failed")
    assert results[-1] == [b"v"] and all(result in ("failed", [b"v"]) for result in results)


def _direct_client_id(reader: DirectReader) -> int:
    connection = reader._connection
    connection.send_command("CLIENT", "ID")
    return int(connection.read_response())


def test_a_forked_child_reads_on_its_own_connection(
    reader: DirectReader, redis_client: redis.Redis, redis_namespace: str
) -> None:
    """A worker pool forks from a parent that already read: the child must not talk on the parent's socket
    (two processes' replies would interleave), and the parent's connection still works after the child."""
    key = f"{redis_namespace}k"
    redis_client.set(key, b"shared")
    assert reader.getranges([key], 0, 9) == [b"shared"]
    parent_id = _direct_client_id(reader)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            ok = reader.getranges([key], 0, 9) == [b"shared"] and _direct_client_id(reader) != parent_id
            os.write(write, b"ok" if ok else b"shared the parent's connection")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 100) == b"ok"
    os.close(read)
    assert reader.getranges([key], 0, 9) == [b"shared"] and _direct_client_id(reader) == parent_id
