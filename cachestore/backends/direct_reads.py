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

A read can also be sent ahead and its replies read later (`send_getranges`, `PendingReplies.receive`), so that
its round trip overlaps work the caller does meanwhile (a reader's first writer checkpoint chunk, while it
decompresses the entries that named it). Replies come back in the order the commands went out, so whatever is
read next on the connection, by anyone, reads the replies still owed first and keeps them for their sender: a
sender that never comes back for its replies (an exception in between) leaves nothing unread for the next read,
and a read of another thread, or of the sender itself (a reference's follow-up fetch), never takes another's
reply for its own.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Sequence
from typing import Any

import redis
from hiredis import pack_command
from redis.connection import Connection, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ResponseError

_PLAIN_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)


class PendingReplies:
    """The replies of commands `DirectReader.send_getranges` sent, still to be read (`receive`)."""

    __slots__ = ("_count", "_error", "_reader", "_replies", "_sent", "done")

    def __init__(self, reader: DirectReader, count: int, sent: Any):
        self._reader = reader
        self._count = count
        self._sent = sent  # the connection they were sent on: a reply owed on another one never comes
        self._replies: list[bytes] = []
        self._error: BaseException | None = None
        self.done = False  # every reply read (or lost with the connection: `_error` says so)

    def receive(self) -> list[bytes]:
        """The replies, as `DirectReader.getranges` returns them (waiting for them if they have not been read yet);
        raises what that would raise."""
        return self._reader._receive(self)


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
        self._owed: collections.deque[PendingReplies] = collections.deque()  # sent ahead, replies not read, in order
        self._lost = False  # `disconnect` was called: replies owed on the connection will never come

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
                while self._owed:  # replies others sent ahead for come first: read and kept for them
                    self._read_owed(connection)
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

    def send_getranges(self, keys: Sequence[str], start: int, end: int) -> PendingReplies:
        """`getranges`, sent now without waiting for the replies: `receive()` on what it returns reads them (or
        returns them at once, when a later read on the connection read them already). A connection error or
        timeout raises redis-py's error and drops the connection, here or at `receive`."""
        with self._lock:
            connection = self._connected()
            try:
                connection.send_packed_command([_packed(keys, start, end)], check_health=False)
            except BaseException:
                self._drop(connection)
                raise
            pending = PendingReplies(self, len(keys), connection)
            self._owed.append(pending)
        return pending

    def _receive(self, pending: PendingReplies) -> list[bytes]:
        with self._lock:
            if not pending.done:
                connection = self._connected()
                try:
                    while not pending.done:  # replies sent for before its own are read first, for their senders
                        self._read_owed(connection)
                except BaseException:
                    self._drop(connection)
                    raise
        if pending._error is not None:
            raise pending._error
        return pending._replies

    def _read_owed(self, connection: Any) -> None:
        """Read the replies of the oldest command sent ahead into it (under the lock). A reply owed on a
        connection since closed never comes: that read fails with a ConnectionError instead of waiting."""
        pending = self._owed[0]
        if pending._sent is not connection:
            raise redis.ConnectionError("the connection a read was sent on was closed before its reply came")
        pending._replies, refused = _read_replies(connection, pending._count)
        pending._error, pending.done = refused, True
        self._owed.popleft()

    def disconnect(self) -> None:
        connection = self._connection
        if connection is not None and self._pid == os.getpid():
            self._lost = True  # (an assignment: atomic, no lock taken from the watchdog's thread)
            connection.disconnect()  # a read blocked on it returns at once, with an error

    def _connected(self) -> Any:
        if self._connection is None or self._pid != os.getpid() or self._lost:
            # A forked child never uses its parent's socket; a disconnected one owes replies it will never get.
            self._fail_owed(redis.ConnectionError("the connection a read was sent on was closed"))
            if self._connection is not None and self._pid == os.getpid():
                self._connection.disconnect()
            self._connection, self._pid, self._lost = self._make(), os.getpid(), False
        return self._connection

    def _drop(self, connection: Any) -> None:
        connection.disconnect()
        self._fail_owed(redis.ConnectionError("the connection a read was sent on failed before its reply came"))
        if self._connection is connection:
            self._connection = None

    def _fail_owed(self, error: BaseException) -> None:
        while self._owed:
            pending = self._owed.popleft()
            pending._error, pending.done = error, True


def _packed(keys: Sequence[str], start: int, end: int) -> bytes:
    return b"".join([pack_command(("GETRANGE", key, start, end)) for key in keys])


def _read_replies(connection: Any, count: int) -> tuple[list[bytes], ResponseError | None]:
    """`count` replies; a command refused (WRONGTYPE) reads as b"" and its error is returned beside them, once
    every reply is read (the connection stays in step). (`getranges`, every remote hit's read, does the same
    inline.)"""
    replies: list[bytes] = []
    refused = None
    for _ in range(count):
        try:
            replies.append(connection.read_response())
        except ResponseError as exc:
            refused = refused or exc
            replies.append(b"")
    return replies, refused
