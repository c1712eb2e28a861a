"""Reads of entry values (a hit, a pass's prefetch, a checkpoint chunk, a scan's pages) on a connection of their
own, without redis-py's per-command layers.

redis-py 8 runs every command through a connection-pool checkout and release, event dispatch and
observability hooks: a GET of a 1.2 KB value costs 122 µs through `Redis.get` and 47 µs as the same bytes sent
and read on one of its connections directly (hiredis parsing the reply either way; bench/RESULTS.md, issue
16). A remote hit is one GETRANGE, so that layer was most of the difference between a hit and a raw GET.

`DirectReader` keeps one connection, made from the client's own connection settings (address, TLS, AUTH,
database, socket timeouts), and sends GETRANGEs on it, one command or a batch written at once. It is used only
where those are all there is to a connection: a plain `redis.Redis` over TCP, TLS or a Unix socket; a cluster
client, fakeredis, or a client-side cache keep the client's own path.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import redis
from hiredis import pack_command
from redis import exceptions as rex
from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ResponseError

try:  # redis-py's hiredis parser, whose reader and buffer `getrange` reads with (None: it always uses getranges)
    from redis._parsers.hiredis import NOT_ENOUGH_DATA, _HiredisParser
except ImportError:  # pragma: no cover - another redis-py layout
    NOT_ENOUGH_DATA, _HiredisParser = None, None

_PLAIN_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)
# How late past its deadline a bounded read may give up (seconds): as late as a watchdog thread's wake-up may be.
DEADLINE_SLACK = 0.01


class DirectReader:
    """GETRANGEs on a connection of its own (made at first use, and again after a failure or in a forked child).
    Callers on several threads take turns (a lock); `disconnect` may be called from any thread, to abort a read
    blocked on the connection (the backend's op-timeout watchdog does)."""

    def __init__(self, client: redis.Redis):
        pool = client.connection_pool
        self._make = lambda: pool.connection_class(**pool.connection_kwargs)
        self._connection: Any = None
        self._pid = 0
        self._lock = threading.Lock()

    @staticmethod
    def usable(client: Any) -> bool:
        """Whether `client`'s connections are redis-py's plain socket connections, with nothing in between, and
        its replies bytes."""
        if type(client) is not redis.Redis:  # a cluster client, fakeredis, a subclass with its own behaviour
            return False
        pool = client.connection_pool
        plain = pool.connection_class in _PLAIN_CONNECTIONS and getattr(pool, "cache", None) is None
        return plain and not pool.connection_kwargs.get("decode_responses")  # values are bytes, never text

    def getranges(self, keys: Sequence[str], start: int, end: int) -> list[bytes]:
        """GETRANGE key start end of each key, in one write and one read of the replies. A command refused (a
        key of another type) raises its ResponseError once every reply is read, as a redis-py pipeline does; a
        connection error or timeout raises redis-py's error and drops the connection (a half-read reply is never
        left on it)."""
        replies = self.read_ranges([(key, start, end) for key in keys])
        for reply in replies:
            if isinstance(reply, ResponseError):
                raise reply
        return replies  # type: ignore[return-value]

    def read_ranges(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes | ResponseError]:
        """GETRANGE key start end of each (key, start, end), in one write and one read of the replies; a command
        refused (a key of another type) has its ResponseError for its reply. Errors otherwise as `getranges`."""
        with self._lock:
            connection = self._connected()
            try:
                # hiredis packs a command in 1 µs, redis-py's pack_commands around it in 7.
                packed = b"".join([pack_command(("GETRANGE", key, start, end)) for key, start, end in ranges])
                connection.send_packed_command([packed], check_health=False)
                replies: list[bytes | ResponseError] = []
                for _ in ranges:
                    try:
                        replies.append(connection.read_response())
                    except ResponseError as exc:  # the connection is still in step: read the rest
                        replies.append(exc)
            except BaseException:
                self._drop(connection)
                raise
        return replies

    def getrange(self, key: str, start: int, end: int) -> bytes:
        """GETRANGE key start end (a remote hit's one read): `getrange_within` with no bound on the whole read, and
        `getranges` of the one key where the connection is not made yet or not parsed by hiredis."""
        reply = self.getrange_within(key, start, end, None)
        return reply if reply is not None else self.getranges((key,), start, end)[0]

    def getrange_within(self, key: str, start: int, end: int, seconds: float | None) -> bytes | None:
        """GETRANGE key start end, its one reply read from the socket by the connection's own hiredis reader,
        without redis-py's layers around a reply (its host string, protocol and health bookkeeping: 15-20 µs of a
        50 µs read, spent right after the wait, bench/RESULTS.md), the whole read bounded by `seconds` (None: each
        socket read by the socket timeout alone). Past `seconds` it raises redis-py's TimeoutError and drops the
        connection, so a server that trickles its reply is given up on without a watchdog thread. None when the
        connection is not made yet or not parsed by hiredis: the caller reads with `getranges`, bounded its own
        way. Errors as `getranges`'s."""
        deadline = None if seconds is None else time.monotonic() + seconds
        with self._lock:
            connection = self._connected()
            parser = getattr(connection, "_parser", None)
            sock, reader = getattr(connection, "_sock", None), getattr(parser, "_reader", None)
            buffer = getattr(parser, "_buffer", None)  # (redis-py's parser internals: checked, never assumed)
            if sock is None or reader is None or buffer is None or not _is_hiredis(parser):
                return None
            try:
                packed = pack_command(("GETRANGE", key, start, end))
                reply = _read_reply(sock, parser, reader, buffer, packed, deadline, connection.socket_timeout)
            except BaseException:
                self._drop(connection)
                raise
        if isinstance(reply, ResponseError):  # the connection is in step: the one reply is read
            raise reply
        return reply

    def disconnect(self) -> None:
        connection = self._connection
        if connection is not None and self._pid == os.getpid():
            connection.disconnect()  # a read blocked on it returns at once, with an error

    def _connected(self) -> Any:
        if self._connection is None or self._pid != os.getpid():  # a forked child never uses its parent's socket
            self._connection, self._pid = self._make(), os.getpid()
        return self._connection

    def _drop(self, connection: Any) -> None:
        connection.disconnect()
        if self._connection is connection:
            self._connection = None


def _is_hiredis(parser: Any) -> bool:
    return _HiredisParser is not None and isinstance(parser, _HiredisParser)


def _read_reply(
    sock: socket.socket, parser: Any, reader: Any, buffer: bytearray, packed: bytes, deadline: float | None,
    timeout: float | None,
) -> bytes | ResponseError:  # fmt: skip
    """Send `packed` and read its one reply as redis-py's hiredis parser would (a push notification handed to the
    parser, the reply after it read), raising redis-py's errors for the socket's. Each socket read waits at most
    the socket's `timeout`, and at most until `deadline` (time.monotonic; DEADLINE_SLACK after it at worst) when
    there is one: the socket's timeout is shortened for that read, and set back after. A reply that is neither
    bytes nor a refusal is refused: the connection is out of step, and the caller drops it."""
    shortened = False
    try:
        sock.sendall(packed)
        push = getattr(parser, "_hiredis_PushNotificationType", None)
        while True:
            reply = reader.gets()
            while reply is NOT_ENOUGH_DATA:
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise rex.TimeoutError("direct-read connection: no whole reply within the operation timeout")
                    # (A socket timeout that ends within DEADLINE_SLACK of the deadline is left as it is: a hit's one
                    # socket read, its timeout the operation's, would otherwise set it twice, 8 µs of the hit.)
                    if timeout is None or remaining < timeout - DEADLINE_SLACK:
                        sock.settimeout(remaining)
                        shortened = True
                count = sock.recv_into(buffer)
                if not count:
                    raise rex.ConnectionError("Connection closed by server.")
                reader.feed(buffer, 0, count)
                reply = reader.gets()
            if push is None or not isinstance(reply, push):
                break
            parser.handle_push_response(reply)
    except TimeoutError:  # (socket.timeout)
        what = "no whole reply within the operation timeout" if shortened else "Timeout reading from the socket"
        raise rex.TimeoutError(f"direct-read connection: {what}") from None
    except OSError as exc:
        raise rex.ConnectionError(f"Error on the direct-read connection: {exc}") from None
    finally:
        if shortened:
            with contextlib.suppress(OSError):  # (closed under the read: the connection is dropped anyway)
                sock.settimeout(timeout)
    if type(reply) is bytes or isinstance(reply, ResponseError):
        return reply
    if isinstance(reply, BaseException):
        raise reply
    raise rex.ConnectionError(f"unexpected reply to GETRANGE: {type(reply).__name__}")
