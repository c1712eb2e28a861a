"""The compile path's value reads on a connection of their own (cachestore/backends/direct_reads.py): the same
replies as redis-py's commands, kept in step after a refused command, a killed connection or a fork, and used
only where a client is a plain redis-py client."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
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


def test_read_ranges_reads_each_its_own_range_and_hands_a_refusal_over_as_its_reply(
    reader: DirectReader, redis_client: redis.Redis, redis_namespace: str
) -> None:
    """What a first read with the writers' latest checkpoint chunks sends: entries' heads and chunks, each with its
    own range, in one round trip; another type under one of the names is that one's reply, not the read's error."""
    keys = [f"{redis_namespace}{n}" for n in range(3)]
    redis_client.set(keys[0], b"0123456789")
    redis_client.set(keys[1], b"abcdefghij")
    redis_client.hset(keys[2], "a", "hash")
    replies = reader.read_ranges([(keys[0], 0, 3), (keys[1], 2, -1), (keys[2], 0, 9), (keys[0], 5, 5)])
    assert replies[:2] == [b"0123", b"cdefghij"] and replies[3] == b"5"
    assert isinstance(replies[2], redis.ResponseError) and "WRONGTYPE" in str(replies[2])
    assert reader.getranges([keys[1]], 0, 0) == [b"a"]  # in step


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


# -- getrange: one key, its reply read by hiredis straight from the socket (a remote hit's read) --------------
def test_getrange_reads_what_redis_py_reads(
    reader: DirectReader, redis_client: redis.Redis, redis_namespace: str
) -> None:
    """Values shorter and much longer than the parser's 64 KiB buffer (a reply read in many pieces), an empty
    value, a missing key and a range inside a value: the bytes redis-py's GETRANGE returns."""
    sizes = (0, 1, 1300, 70_000, 300_000)
    keys = [f"{redis_namespace}{size}" for size in sizes]
    for key, size in zip(keys, sizes, strict=True):
        redis_client.set(key, os.urandom(size))
    for key in [*keys, f"{redis_namespace}missing"]:
        assert reader.getrange(key, 0, -1) == redis_client.getrange(key, 0, -1)
        assert reader.getrange(key, 10, 99_999) == redis_client.getrange(key, 10, 99_999)
    assert reader.getranges(keys, 0, 9) == [redis_client.getrange(key, 0, 9) for key in keys]  # still in step


def test_getrange_reads_no_reply_through_redis_py(
    reader: DirectReader, redis_client: redis.Redis, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once connected, a getrange sends and reads on the socket itself: redis-py's send_packed_command and
    read_response (host string, protocol and health bookkeeping around each reply) are not called."""
    key = f"{redis_namespace}k"
    redis_client.set(key, b"value")
    assert reader.getrange(key, 0, -1) == b"value"  # connects (through getranges)
    connection = reader._connection
    calls = []
    for name in ("send_packed_command", "read_response"):
        original = getattr(connection, name)
        monkeypatch.setattr(connection, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    assert [reader.getrange(key, 0, -1) for _ in range(3)] == [b"value"] * 3
    assert calls == []


def test_a_refused_getrange_raises_and_the_next_read_is_in_step(
    reader: DirectReader, redis_client: redis.Redis, redis_namespace: str
) -> None:
    plain, other = f"{redis_namespace}plain", f"{redis_namespace}hash"
    redis_client.set(plain, b"value")
    redis_client.hset(other, "a", "hash")
    assert reader.getrange(plain, 0, -1) == b"value"
    connection = reader._connection
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        reader.getrange(other, 0, -1)
    assert reader._connection is connection  # the one reply was read: the connection stays
    assert reader.getrange(plain, 0, 2) == b"val" and reader.getranges([plain], 0, -1) == [b"value"]


def test_a_getrange_on_a_connection_the_server_killed_fails_and_the_next_connects_again(
    reader: DirectReader, redis_client: redis.Redis, redis_namespace: str
) -> None:
    key = f"{redis_namespace}k"
    redis_client.set(key, b"v")
    assert reader.getrange(key, 0, 9) == b"v"
    redis_client.client_kill_filter(_id=_direct_client_id(reader))
    results = []
    for _ in range(2):  # the first read may fail on the dead socket; it never returns another read's bytes
        try:
            results.append(reader.getrange(key, 0, 9))
        except redis.ConnectionError:
            results.append("failed")
    assert results[-1] == b"v" and all(result in ("failed", b"v") for result in results)


class FakeServer:
    """A server on loopback that answers the connection's handshake commands with +OK, and a GETRANGE with
    `reply`: `chunk` bytes every `interval` seconds (None: never)."""

    def __init__(self, reply: bytes | None, chunk: int = 10, interval: float = 0.0) -> None:
        self.reply, self.chunk, self.interval = reply, chunk, interval
        self.listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve, daemon=True).start()

    def client(self, socket_timeout: float = 30) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.listener.getsockname()[1], socket_timeout=socket_timeout,
                           protocol=2)  # fmt: skip

    def _serve(self) -> None:
        peer = self.listener.accept()[0]
        with contextlib.suppress(OSError):
            while data := peer.recv(65536):
                if b"GETRANGE" not in data:
                    peer.sendall(b"+OK\r\n" * len(re.findall(rb"(?:^|\r\n)\*\d+\r\n\$", data)))
                    continue
                for at in range(0, len(self.reply or b""), self.chunk):
                    time.sleep(self.interval)
                    peer.sendall(self.reply[at : at + self.chunk])  # type: ignore[index]
        peer.close()

    def close(self) -> None:
        self.listener.close()


def connected(client: redis.Redis) -> DirectReader:
    direct = DirectReader(client)
    direct._connected().connect()
    return direct


def test_getrange_within_says_none_until_the_connection_is_made(redis_client: redis.Redis) -> None:
    """A first read connects, under the caller's own bound (the backend's watchdog): not bounded here."""
    direct = DirectReader(redis_client)
    assert direct.getrange_within("any", 0, 9, 1.0) is None
    assert direct.getrange("any", 0, 9) == b"" and direct.getrange_within("any", 0, 9, 1.0) == b""
    direct.disconnect()


def test_a_reply_trickled_past_the_deadline_is_given_up_on_and_its_connection_dropped() -> None:
    """Ten bytes every 0.1 s, each socket read well within the socket timeout: only the bound on the whole read
    ends it, at its deadline, with redis-py's TimeoutError; the half-read connection is dropped."""
    value = os.urandom(300)
    server = FakeServer(b"$300\r\n" + value + b"\r\n", chunk=10, interval=0.1)
    direct = connected(server.client(socket_timeout=5))
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError, match="operation timeout"):
        direct.getrange_within("k", 0, -1, 0.5)
    assert 0.4 < time.monotonic() - started < 1.5 and direct._connection is None
    server.close()


def test_a_reply_in_many_pieces_within_the_deadline_is_read_and_the_socket_timeout_set_back() -> None:
    value = os.urandom(300)
    server = FakeServer(b"$300\r\n" + value + b"\r\n", chunk=50, interval=0.01)
    direct = connected(server.client(socket_timeout=7))
    assert direct.getrange_within("k", 0, -1, 5.0) == value
    assert direct._connection._sock.gettimeout() == 7
    direct.disconnect()
    server.close()


def test_a_getrange_blocked_on_a_silent_server_fails_at_once_when_disconnected() -> None:
    """The backend's watchdog aborts a read by disconnecting the reader from another thread: the read blocked in
    the socket fails (a redis-py ConnectionError), and the reader's connection is dropped."""
    server = FakeServer(None)
    direct = connected(server.client())
    threading.Timer(0.3, direct.disconnect).start()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        direct.getrange("k", 0, -1)
    assert time.monotonic() - started < 5 and direct._connection is None
    server.close()


def test_a_connection_parsed_without_hiredis_is_read_by_getranges(
    redis_url: str, redis_client: redis.Redis, redis_namespace: str
) -> None:
    from redis._parsers import _RESP2Parser

    key = f"{redis_namespace}k"
    redis_client.set(key, b"value")
    client = redis.Redis.from_url(redis_url, parser_class=_RESP2Parser, protocol=2)
    direct = DirectReader(client)
    assert [direct.getrange(key, 0, -1) for _ in range(2)] == [b"value"] * 2
    assert not isinstance(direct._connection._parser, type(reader_parser(redis_client)))
    direct.disconnect()
    client.close()


def reader_parser(client: redis.Redis) -> object:
    direct = DirectReader(client)
    direct.getranges(["any"], 0, 0)
    parser = direct._connection._parser
    direct.disconnect()
    return parser


class CountingSocket:
    """A connection's socket, its settimeout calls counted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.timeouts = sock, []

    def settimeout(self, value: float | None) -> None:
        self.timeouts.append(value)
        self.sock.settimeout(value)

    def __getattr__(self, name: str) -> object:
        return getattr(self.sock, name)


def test_a_read_bounded_by_its_socket_timeout_already_leaves_the_timeout_alone(
    redis_url: str, redis_client: redis.Redis, redis_namespace: str
) -> None:
    """A hit's bound is the operation timeout, which is its connection's socket timeout too: its one socket read
    is bounded already, and the socket's timeout is not set (twice) for it. A shorter bound is set, and set back."""
    key = f"{redis_namespace}k"
    redis_client.set(key, b"value")
    client = redis.Redis.from_url(redis_url, socket_timeout=1.0)
    direct = DirectReader(client)
    assert direct.getrange(key, 0, -1) == b"value"
    counting = CountingSocket(direct._connection._sock)
    direct._connection._sock = counting
    assert [direct.getrange_within(key, 0, -1, 1.0) for _ in range(3)] == [b"value"] * 3
    assert counting.timeouts == []
    assert direct.getrange_within(key, 0, -1, 0.5) == b"value"
    assert counting.timeouts[0] <= 0.5 and counting.timeouts[1:] == [1.0]
    direct._connection._sock = counting.sock
    direct.disconnect()
    client.close()


def test_a_push_notification_before_the_reply_is_handed_to_the_parser_and_the_reply_read_after_it(
    redis_url: str, redis_client: redis.Redis, redis_namespace: str
) -> None:
    """On RESP3 the server may send a push (here a client-tracking invalidation) ahead of a reply: getrange hands
    it to redis-py's parser, as redis-py's own read does, and returns the reply that follows, in step."""
    key = f"{redis_namespace}k"
    redis_client.set(key, b"v1")
    client = redis.Redis.from_url(redis_url, protocol=3)
    direct = DirectReader(client)
    assert direct.getrange(key, 0, -1) == b"v1"  # connects
    connection = direct._connection
    connection.send_command("CLIENT", "TRACKING", "ON")
    assert connection.read_response() in (b"OK", "OK")
    pushed: list = []
    connection._parser.invalidation_push_handler_func = pushed.append
    assert direct.getrange(key, 0, -1) == b"v1"  # the key is tracked for this connection now
    redis_client.set(key, b"v2")  # the server pushes an invalidation to it
    time.sleep(0.1)
    assert direct.getrange(key, 0, -1) == b"v2" and direct.getrange(key, 0, 0) == b"v"
    assert len(pushed) == 1 and direct._connection is connection
    direct.disconnect()
    client.close()
