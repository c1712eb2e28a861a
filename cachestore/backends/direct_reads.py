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

import os
import threading
from collections.abc import Sequence
from typing import Any

import redis
from hiredis import pack_command
from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ResponseError

_PLAIN_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)


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
        with self._lock:
            connection = self._connected()
            try:
                # hiredis packs a command in 1 µs, redis-py's pack_commands around it in 7.
                packed = b"".join([pack_command(("GETRANGE", key, start, end)) for key in keys])
                connection.send_packed_command([packed], check_health=False)
                replies, refused = [], None
                for _ in keys:
                    try:
                        replies.append(connection.read_response())
                    except ResponseError as exc:  # the connection is still in step: read the rest
                        refused = refused or exc
                        replies.append(b"")
            except BaseException:
                self._drop(connection)
                raise
        if refused is not None:
            raise refused
        return replies

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
