"""The embedded persistent tier: one SQLite file in WAL mode (`local:PATH`, the default). The compile
path and the reader side (reports, inspection) of it, and its schema, written once.

Several processes on one machine may share the file: writes take SQLite's write lock (BEGIN IMMEDIATE)
and readers never block writers in WAL mode. Each thread gets its own connection, since the mirror's
background flusher writes while the compiling thread reads. The reader side streams in keyset pages of
BATCH rows, so memory stays bounded by the page, not by the size of the cache.

A compile's file that SQLite reports as corrupt, or that is no tier at all, is moved aside as
`PATH.corrupt-<time>` (its -wal and -shm with it) and a fresh tier started in its place (`_replace`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bridge.identity import toolchain_id
from cachestore.api import (
    BATCH,
    READ_TIMEOUT,
    Backend,
    BatchRefused,
    KeyRecord,
    KeyUsage,
    MetricsBatch,
    RawEntry,
    Reader,
    StoreRequest,
    TierBusy,
    TierUnavailable,
    WriteItem,
    batch_problem,
    pass_time,
    stored_number,
)
from cachestore.entry import MAX_ENTRY_BYTES, TooLarge
from cachestore.value import retention_score

if TYPE_CHECKING:
    from cachestore.settings import Settings

logger = logging.getLogger(__name__)

# A `digests` table (older builds' content dedupe index) is never read or written here; it stays, so an older
# build sharing the file keeps working.
# 2: entries, digests and leases are partitioned by toolchain. Version 1's entries carry no toolchain, so
# no compiler could ever take them again: upgrading drops those three tables and keeps the fleet metrics.
# 3: entries record when they were last used (`used`, for trimming to max_size), and the file vacuums
# incrementally. Version 2's entries are of entry schema 2, which no compiler of this build takes: dropped too.
# 4: entries record their compile seconds and key usage the passes that used each key, which the max_size trim
# ranks entries by (cachestore.value); a version 3 file keeps its entries (compile seconds and passes 0: they
# rank as the cheapest until rewritten and used again).
SCHEMA_VERSION = 4
# The `toolchain` column of entries and leases holds the partition (cachestore.keys.partition: a toolchain's id,
# and the scope if untrusted); the column keeps the name of the schema that files on disk have.
UPGRADABLE = {"1": ("entries", "digests", "leases"), "2": ("entries", "digests", "leases")}
COLUMNS_ADDED = {
    "3": (
        "ALTER TABLE entries ADD COLUMN compile_seconds REAL NOT NULL DEFAULT 0",
        "ALTER TABLE key_usage ADD COLUMN passes INTEGER NOT NULL DEFAULT 0",
    )
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    toolchain TEXT NOT NULL, cache_key TEXT NOT NULL, data BLOB NOT NULL, digest TEXT NOT NULL,
    expires REAL NOT NULL, used REAL NOT NULL, compile_seconds REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (toolchain, cache_key));
CREATE INDEX IF NOT EXISTS entries_by_use ON entries (used);
CREATE TABLE IF NOT EXISTS leases (
    toolchain TEXT NOT NULL, cache_key TEXT NOT NULL, owner TEXT NOT NULL, expires REAL NOT NULL,
    PRIMARY KEY (toolchain, cache_key));
CREATE TABLE IF NOT EXISTS applied_batches (batch_id TEXT PRIMARY KEY, applied REAL NOT NULL);
CREATE TABLE IF NOT EXISTS totals (name TEXT PRIMARY KEY, value REAL NOT NULL);
CREATE TABLE IF NOT EXISTS worker_totals (
    host TEXT NOT NULL, worker TEXT NOT NULL, name TEXT NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (host, worker, name));
CREATE TABLE IF NOT EXISTS kernels (
    kernel_name TEXT PRIMARY KEY, call_count INTEGER NOT NULL, variants INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS key_usage (
    cache_key TEXT PRIMARY KEY, kernel_name TEXT NOT NULL, usage INTEGER NOT NULL,
    first_use REAL NOT NULL, last_use REAL NOT NULL, passes INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS key_hosts (cache_key TEXT NOT NULL, host TEXT NOT NULL, PRIMARY KEY (cache_key, host));
CREATE TABLE IF NOT EXISTS pass_log (id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS variant_index (
    kernel_name TEXT NOT NULL, field TEXT NOT NULL, value TEXT NOT NULL, expires REAL NOT NULL,
    PRIMARY KEY (kernel_name, field));
CREATE TABLE IF NOT EXISTS toolchain_totals (
    toolchain TEXT NOT NULL, name TEXT NOT NULL, value REAL NOT NULL, PRIMARY KEY (toolchain, name));
"""


DEFAULT_WRITE_TIMEOUT = 2.0  # seconds a background write waits for the lock (settings: final_flush_timeout)
TTL_REFRESH_FRACTION = 0.9  # refresh an entry's expiry on use once less than 90% of its TTL is left
# An entry's last use is written when it is read this many seconds after the last one written: least recently
# used within a minute, and reads of a warm pass stay reads.
USE_GRANULARITY = 60.0
TRIM_TO = 0.9  # past max_size, entries are deleted until the file would be 90% of it: not a trim per write
ROW_OVERHEAD = 256  # bytes a row takes beyond its data (keys, index entries, page slack), for the trim's sums
# SQLite's primary result codes of a file that is damaged or no database at all: such a file is replaced.
CORRUPT_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}
FULL_DISK_BYTES = 1 << 20  # less room than this on the tier's file system, and an I/O error is a full disk
SETUP_ATTEMPTS = 5  # a connection's set-up answered "locked" without waiting is tried this often, 50 ms more each time
SETUP_RETRY_SECONDS = 0.05


class NotATier(TierUnavailable):
    """The file is an SQLite database, but not a tier: it has tables and none of them says our schema."""


class _FileState:
    """Shared by a backend and its `in_partition` copies: bumped each time this process sees the file replaced,
    so every thread's connection to the old file is reopened on the new one."""

    generation = 0


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path` now, None when there is none: which file a connection opened."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


def _full_disk(path: Path, exc: sqlite3.Error) -> str:
    """For an I/O error or a full database: the file system holding `path` when it has no room left, named by
    its mount point (SQLite says only "disk I/O error" when it cannot grow its write-ahead log); else ""."""
    if (getattr(exc, "sqlite_errorcode", 0) & 0xFF) not in (sqlite3.SQLITE_IOERR, sqlite3.SQLITE_FULL):
        return ""
    folder = path.absolute().parent
    try:
        disk = os.statvfs(folder)
    except OSError:
        return ""
    free = disk.f_bavail * disk.f_frsize
    if free > FULL_DISK_BYTES:
        return ""
    mount = folder
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return f" (the disk is full: the file system mounted at {mount} has {free} bytes free)"


class SqliteBackend(Backend, Reader):
    """A tier in one SQLite file: the compile path and the reader side."""

    keeps_expired = True  # nothing deletes an expired row but `purge_expired` (inspect gc)
    splits_scans = False  # scanned in one process (cachestore.scan_split)

    def __init__(
        self,
        path: str | Path,
        timeout: float = 1.0,
        *,
        create: bool = True,
        partition: str | None = None,
        write_timeout: float = DEFAULT_WRITE_TIMEOUT,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        max_size: int | None = None,
        writable: bool = True,
    ) -> None:
        """`timeout`: seconds a compiling thread waits for SQLite's lock (a lease, a TTL refresh) and for a
        read. `write_timeout`: seconds the background writes (entries, lease releases, metrics) and admin
        writes wait for it: several processes of one machine take turns, and a write that waits a little
        longer delays no compile. `create=False` (reports, inspection): a missing file is an error, not a
        new empty tier. `partition`: the partition of entries and leases this backend works in (default:
        this compiler's). `max_entry_bytes`: larger entries are never read, only their size (TooLarge).
        `max_size`: bytes the file may hold; writes past it delete the least valuable entries (cachestore.value)
        and give the space back to the file system (None: no cap). `writable=False` (a read-only client): the file is
        opened read-only (SQLite may still add its -wal and -shm files beside it), never created, upgraded or
        refreshed, and a missing file is an empty tier."""
        self.path = Path(path).expanduser()
        self.description = f"local:{self.path}"
        self.timeout = timeout
        self.write_timeout = max(timeout, write_timeout)
        self.partition = partition or toolchain_id()
        self.max_entry_bytes = max_entry_bytes
        self.max_size = max_size
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._file = _FileState()
        # Only a compile's backend replaces a broken file: reports and inspection say what they found.
        self._heals = create and writable
        self.writable = writable
        if create and writable:
            self._create()
        elif not self.path.is_file():
            if writable:
                raise TierUnavailable(f"no local tier at {self.path}")
            # Read-only: nothing to read yet. A writer may make the file later; fetch looks for it each time.
        else:
            self._check_schema()  # another SQLite file, or not one at all: say so now

    def _create(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierUnavailable(f"local tier {self.path}: cannot create its folder: {exc.strerror}") from None
        try:
            self._create_tables()
        except NotATier as exc:
            if not self._heals:
                raise
            self._replace(str(exc))
        except _Replaced:
            pass  # the broken file is replaced, and the fresh one has its tables
        self._vacuum_incrementally()

    def _create_tables(self) -> None:
        with self._write() as db:  # one transaction: a second process creating or upgrading at once waits
            tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            row = db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone() if "meta" in tables else None
            if row is None and tables - {"meta", "sqlite_sequence"}:
                raise NotATier(f"an SQLite database without the tier's schema (tables {', '.join(sorted(tables))})")
            if row is not None and row[0] in UPGRADABLE:
                for table in UPGRADABLE[row[0]]:
                    db.execute(f"DROP TABLE IF EXISTS {table}")
            elif row is not None and row[0] in COLUMNS_ADDED:
                for statement in COLUMNS_ADDED[row[0]]:
                    db.execute(statement)
            elif row is not None and row[0] != str(SCHEMA_VERSION):
                raise TierUnavailable(f"local tier {self.path} has schema v{row[0]}; this build uses v{SCHEMA_VERSION}")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute("INSERT OR REPLACE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))

    def _vacuum_incrementally(self) -> None:
        """A file made before schema 3 never gives space back: switching it to incremental vacuum takes one
        VACUUM (a rewrite of the file, once). Another process using the file makes it wait for a later open."""
        db = self._db()
        try:
            if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
                db.execute("PRAGMA auto_vacuum = INCREMENTAL")
                db.execute("VACUUM")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise TierUnavailable(f"local tier {self.path}: {exc}") from None

    def _check_schema(self) -> None:
        rows = self._read("SELECT value FROM meta WHERE name = 'schema'")
        if not rows or rows[0][0] != str(SCHEMA_VERSION):
            found = f"schema v{rows[0][0]}" if rows else "no schema"
            raise TierUnavailable(
                f"local tier {self.path} has {found}; this build uses v{SCHEMA_VERSION} "
                "(a compile with this build upgrades it)"
            )

    def __repr__(self) -> str:
        return f"SqliteBackend({str(self.path)!r}, partition {self.partition})"

    def entry_partitions(self) -> list[str]:
        return [
            name
            for (name,) in self._read(
                "SELECT DISTINCT toolchain FROM entries WHERE expires > ? ORDER BY 1", (time.time(),)
            )
        ]

    def entry_keys(self) -> Iterator[tuple[str, str]]:
        now, last = time.time(), ("", "")
        while True:  # in pages, so that no read holds the file for the whole scan
            rows = self._read(
                "SELECT toolchain, cache_key FROM entries WHERE (toolchain, cache_key) > (?, ?) "
                "AND expires > ? ORDER BY 1, 2 LIMIT ?",
                (*last, now, BATCH),
            )
            yield from rows
            if len(rows) < BATCH:
                return
            last = rows[-1]

    # -- connections ------------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is not None and self._local.generation != self._file.generation:
            self._drop_connection()  # the file was replaced since this thread opened it
            db = None
        if db is None:
            # Taken before opening: a file replaced in between makes the identity older than the connection's
            # file, never newer, so `_replace` cannot mistake a fresh file for the broken one.
            identity = self._local.identity = _identity(self.path)
            self._local.generation = self._file.generation
            try:
                if self.writable:
                    db = self._writable_connection()
                else:  # mode=ro: SQLite itself refuses every write, whatever a caller asks
                    db = sqlite3.connect(
                        f"{self.path.absolute().as_uri()}?mode=ro",
                        timeout=self.timeout,
                        isolation_level=None,
                        check_same_thread=False,
                        uri=True,
                    )
            except sqlite3.Error as exc:
                if db is not None:
                    db.close()
                raise self._failure(exc) from None
            if identity is None:  # no file before: this connection made the one at the path (or found it just
                self._local.identity = _identity(self.path)  # made), not one that replaced its own
            self._local.db = db
            with self._lock:
                self._connections.append(db)
        return db

    def _writable_connection(self) -> sqlite3.Connection:
        """A connection set up for writing, waiting as long as a write may: processes that open a new file at once
        queue on its lock here, and the switch to WAL is only needed (and only taken) by the first of them. SQLite
        answers "database is locked" at once, without waiting, where waiting could deadlock (a reader of the file
        while another process switches it to WAL, as when many open a file one of them just replaced): the set-up
        is then tried again, a few times, before it is a failure."""
        for attempt in range(SETUP_ATTEMPTS):
            db = sqlite3.connect(self.path, timeout=self.write_timeout, isolation_level=None, check_same_thread=False)
            try:
                db.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes effect in a new file (before any table)
                if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                if self.max_size is not None:
                    self._bound_wal(db, self.max_size)
                db.execute(f"PRAGMA busy_timeout = {int(1000 * self.timeout)}")
                return db
            except sqlite3.OperationalError as exc:
                db.close()
                if (exc.sqlite_errorcode & 0xFF) != sqlite3.SQLITE_BUSY or attempt == SETUP_ATTEMPTS - 1:
                    raise
                time.sleep(SETUP_RETRY_SECONDS * (attempt + 1))
            except BaseException:
                db.close()
                raise
        raise AssertionError("unreachable")

    @staticmethod
    def _bound_wal(db: sqlite3.Connection, max_size: int) -> None:
        """The write-ahead log counts against max_size too: it is checkpointed once it holds the trim's slack
        (1 - TRIM_TO of the cap, at most SQLite's default 1000 pages) and then truncated back to that size."""
        limit = int(max_size * (1 - TRIM_TO))
        pages = max(1, min(1000, limit // db.execute("PRAGMA page_size").fetchone()[0]))
        db.execute(f"PRAGMA journal_size_limit = {limit}")
        db.execute(f"PRAGMA wal_autocheckpoint = {pages}")

    def _drop_connection(self) -> None:
        db = getattr(self._local, "db", None)
        self._local.db = None
        if db is None:
            return
        with self._lock:
            if db in self._connections:
                self._connections.remove(db)
        with contextlib.suppress(sqlite3.Error):
            db.close()

    def _failure(self, exc: sqlite3.Error) -> TierUnavailable:
        """The error to raise for `exc`: _Replaced when the broken file is replaced now (the caller may try again
        once), TierUnavailable otherwise."""
        if self._recovered(exc):
            return _Replaced(f"local tier {self.path}: {exc}; replaced by a fresh tier")
        return TierUnavailable(f"local tier {self.path}: {exc}{_full_disk(self.path, exc)}")

    def _recovered(self, exc: sqlite3.Error) -> bool:
        """After `exc` from this thread's connection: True when the operation may be tried again on a fresh file,
        because the file was corrupt (and is now replaced) or another process already replaced it."""
        if not self._heals or getattr(self._local, "replacing", False):
            return False  # a fresh file that fails at once is reported, not replaced again
        corrupt = isinstance(exc, sqlite3.DatabaseError) and (exc.sqlite_errorcode & 0xFF) in CORRUPT_CODES
        if not corrupt and _identity(self.path) == self._local.identity:
            return False  # a failure of the same, sound file (locked, full, read-only): not ours to fix
        self._replace(str(exc))
        return True

    def _replace(self, reason: str) -> None:
        """Move the broken file this thread's connection opened aside and start over on a fresh one. Under a lock
        file, and only while the file at the path is still that one: of several processes (or threads) that
        find one broken file at once, one moves it, and the others reopen on the fresh file it leaves."""
        lock_path = self.path.with_name(self.path.name + ".replace-lock")
        with self._lock:
            try:
                with open(lock_path, "a") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                    if self._local.identity is not None and _identity(self.path) == self._local.identity:
                        self._move_aside(reason)
            except OSError as exc:
                raise TierUnavailable(
                    f"local tier {self.path} is no usable tier ({reason}) and could not be "
                    f"moved aside: {exc.strerror}: {exc.filename}"
                ) from None
            self._file.generation += 1
        self._drop_connection()
        self._local.replacing = True
        try:
            self._create_tables()  # on the fresh file, or on the one another process started
        finally:
            self._local.replacing = False

    def _move_aside(self, reason: str) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while aside.exists():  # two replacements within a second keep both files
            n += 1
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
        # The -wal and -shm go with it: SQLite would otherwise apply the old log to the fresh file.
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{self.path}{suffix}", f"{aside}{suffix}")
        logger.warning(
            "local tier %s is no usable tier (%s): moved it to %s and started a fresh tier", self.path, reason, aside
        )

    @contextlib.contextmanager
    def _write(self, wait: float | None = None) -> Iterator[sqlite3.Connection]:
        """One write transaction, taking SQLite's write lock within `wait` seconds (default: write_timeout);
        SQLite's busy handler retries the lock until then. A broken file is replaced (_Replaced): the write is
        lost, as its body cannot be run again, and the next one lands in the fresh file. A file deleted or replaced
        by another process since this thread opened it is let go first: the write goes to the file at the path."""
        if self._file_gone():
            logger.warning("local tier %s was deleted or replaced by another process; writing to a new file", self.path)
            self._drop_connection()
            self._local.replacing = True
            try:
                self._create_tables()  # (its own write opens the file at the path, made if missing)
            finally:
                self._local.replacing = False
        db = self._db()
        try:
            db.execute(f"PRAGMA busy_timeout = {int(1000 * (self.write_timeout if wait is None else wait))}")
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise TierBusy(f"local tier {self.path}: {exc}") from None
            raise self._failure(exc) from None
        except sqlite3.Error as exc:
            raise self._failure(exc) from None

    def _file_gone(self) -> bool:
        """Whether this thread's connection writes to a file that is no longer the one at the path (deleted, or
        another file put there): what it wrote would be lost with it."""
        if getattr(self._local, "db", None) is None or getattr(self._local, "replacing", False):
            return False
        return _identity(self.path) != self._local.identity

    def _read(self, sql: str, params: Sequence = ()) -> list[tuple]:
        try:
            return self._query(sql, params)
        except _Replaced:
            return self._query(sql, params)  # once, on the fresh file

    def _query(self, sql: str, params: Sequence) -> list[tuple]:
        db = self._db()
        try:
            return db.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise self._failure(exc) from None

    # -- entries ----------------------------------------------------------------------------------
    # The stored size, and the data only when it is within max_entry_bytes (the first parameter): SQLite
    # answers length() of a blob from its header, without reading the blob's pages.
    _SIZE_AND_DATA = "length(data), CASE WHEN length(data) <= ? THEN data END"

    def _value(self, size: int, data: bytes | None) -> bytes | TooLarge:
        return TooLarge(size, self.max_entry_bytes) if data is None else bytes(data)

    def fetch(self, cache_keys: Sequence[str], ttl: int | None) -> dict[str, bytes | TooLarge]:
        if not self.writable and not self.path.is_file():
            return {}  # a read-only client's tier that no writer has made yet: empty, and not created
        now = time.time()
        found: dict[str, bytes | TooLarge] = {}
        stale: list[str] = []
        for start in range(0, len(cache_keys), 500):
            chunk = list(cache_keys[start : start + 500])
            marks = ",".join("?" * len(chunk))
            rows = self._read(
                f"SELECT cache_key, {self._SIZE_AND_DATA}, expires, used FROM entries WHERE toolchain = ? "
                f"AND cache_key IN ({marks}) AND expires > ?",
                (self.max_entry_bytes, self.partition, *chunk, now),
            )
            for key, size, data, expires, used in rows:
                found[key] = self._value(size, data)
                # A read-only client (ttl None) refreshes nothing. An entry too large to read is not kept alive by
                # being asked for; refreshing it would also cost SQLite rewriting its whole row, blob included.
                if ttl is None or data is None:
                    continue
                if expires < now + ttl * TTL_REFRESH_FRACTION or used < now - USE_GRANULARITY:
                    stale.append(key)
        if stale and ttl is not None:  # (stale stays empty when ttl is None)
            # Refreshing takes SQLite's write lock, so it is done only once an entry has used up a tenth of its
            # TTL: reads by several processes stay reads. It waits no longer than a read, and when another
            # process holds the lock it is left to a later read: the entries were read all the same.
            with contextlib.suppress(TierBusy), self._write(self.timeout) as db:
                db.executemany(
                    "UPDATE entries SET expires = ?, used = ? WHERE toolchain = ? AND cache_key = ?",
                    [(now + ttl, now, self.partition, k) for k in stale],
                )
        return found

    def store(self, requests: Sequence[StoreRequest], ttl: int) -> None:
        now = time.time()
        with self._write() as db:
            self._store(db, requests, ttl, now)
            trimmed = self._trim(db)
        if trimmed:
            self._give_back_space()

    def _store(self, db: sqlite3.Connection, requests: Sequence[StoreRequest], ttl: int, now: float) -> None:
        for request in requests:
            db.execute(
                f"INSERT OR REPLACE INTO entries {_ENTRY_COLUMNS}",
                (
                    self.partition,
                    request.cache_key,
                    request.full,
                    request.digest,
                    now + (request.ttl or ttl),
                    now,
                    request.compile_seconds,
                ),
            )
            db.executemany(
                "INSERT OR REPLACE INTO variant_index VALUES (?, ?, ?, ?)",
                [(request.kernel_name, name, value, now + ttl) for name, value in request.index_fields.items()],
            )

    def read_variant_index(self, queries: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[bytes | None] | None]:
        if not self.writable and not self.path.is_file():
            return [[None] * len(fields) for _, fields in queries]  # no writer made the tier yet: nothing indexed
        now = time.time()
        answers: list[list[bytes | None] | None] = []
        for kernel_name, fields in queries:
            marks = ", ".join("?" * len(fields))
            rows = self._read(
                f"SELECT field, value FROM variant_index WHERE kernel_name = ? AND field IN ({marks}) AND expires > ?",
                (kernel_name, *fields, now),
            )
            values = dict(rows)
            answers.append([values.get(name) for name in fields])
        return answers

    # -- single flight ----------------------------------------------------------------------------
    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        now = time.time()
        with self._write(self.timeout) as db:  # on the compiling thread: it waits no longer than a read
            db.execute(
                "DELETE FROM leases WHERE toolchain = ? AND cache_key = ? AND expires <= ?",
                (self.partition, cache_key, now),
            )
            cursor = db.execute(
                "INSERT OR IGNORE INTO leases VALUES (?, ?, ?, ?)", (self.partition, cache_key, owner, now + ttl)
            )
            return cursor.rowcount == 1

    def release_lease(self, cache_key: str, owner: str) -> None:
        self.release_leases([(cache_key, owner)])

    def refresh_ttls(self, items: Sequence[tuple[str, int]]) -> None:
        now = time.time()
        with self._write() as db:
            db.executemany(
                "UPDATE entries SET expires = ? WHERE toolchain = ? AND cache_key = ?",
                [(now + ttl, self.partition, key) for key, ttl in items],
            )

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> None:
        with self._write() as db:
            db.executemany(
                "DELETE FROM leases WHERE toolchain = ? AND cache_key = ? AND owner = ?",
                [(self.partition, cache_key, owner) for cache_key, owner in leases],
            )

    def renew_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        now = time.time()
        with self._write() as db:  # from the lease keeper's thread: it may wait like a background write
            cursor = db.execute(
                "UPDATE leases SET expires = ? WHERE toolchain = ? AND cache_key = ? AND owner = ? AND expires > ?",
                (now + ttl, self.partition, cache_key, owner, now),
            )
            return cursor.rowcount == 1

    def lease_holder(self, cache_key: str) -> str | None:
        rows = self._read(
            "SELECT owner FROM leases WHERE toolchain = ? AND cache_key = ? AND expires > ?",
            (self.partition, cache_key, time.time()),
        )
        return rows[0][0] if rows else None

    # -- metrics ----------------------------------------------------------------------------------
    def apply_metrics(self, batch: MetricsBatch) -> bool:
        # Checked before the transaction starts: SQLite would store an infinity and turn a NaN into a NULL that
        # fails half-way (rolled back, but then the batch would look like a tier that is down, retried forever).
        problem = batch_problem(batch)
        if problem is not None:
            raise BatchRefused(f"local tier {self.path}: metrics batch {batch.batch_id!r} refused: {problem}")
        with self._write() as db:
            if (
                db.execute(
                    "INSERT OR IGNORE INTO applied_batches VALUES (?, ?)", (batch.batch_id, time.time())
                ).rowcount
                == 0
            ):
                return False
            for name, value in batch.totals.items():
                db.execute(
                    "INSERT INTO totals VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                    (name, value),
                )
                db.execute(
                    "INSERT INTO worker_totals VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(host, worker, name) DO UPDATE SET value = value + excluded.value",
                    (batch.host, batch.worker, name, value),
                )
                if batch.toolchain:
                    db.execute(
                        "INSERT INTO toolchain_totals VALUES (?, ?, ?) "
                        "ON CONFLICT(toolchain, name) DO UPDATE SET value = value + excluded.value",
                        (batch.toolchain, name, value),
                    )
            for key, usage in batch.keys.items():
                self._apply_key(db, batch.host, key, usage)
            for kernel_name, calls in batch.kernel_calls.items():
                db.execute(
                    "INSERT INTO kernels VALUES (?, ?, 0) "
                    "ON CONFLICT(kernel_name) DO UPDATE SET call_count = call_count + excluded.call_count",
                    (kernel_name, calls),
                )
            if batch.pass_record is not None:
                db.execute(
                    "INSERT INTO pass_log (ts, record) VALUES (?, ?)",
                    (time.time(), json.dumps(batch.pass_record, sort_keys=True)),
                )
        return True

    @staticmethod
    def _apply_key(db: sqlite3.Connection, host: str, key: str, usage: KeyUsage) -> None:
        new = db.execute(
            "INSERT OR IGNORE INTO key_usage VALUES (?, ?, 0, ?, ?, 0)",
            (key, usage.kernel_name, usage.first_use, usage.last_use),
        ).rowcount
        db.execute(
            # passes: the passes that used the key, each of which its entry saves a trace (cachestore.value)
            "UPDATE key_usage SET usage = usage + ?, first_use = min(first_use, ?), last_use = max(last_use, ?), "
            "passes = passes + 1 WHERE cache_key = ?",
            (usage.usage, usage.first_use, usage.last_use, key),
        )
        db.execute("INSERT OR IGNORE INTO key_hosts VALUES (?, ?)", (key, host))
        if new:
            db.execute(
                "INSERT INTO kernels VALUES (?, 0, 1) ON CONFLICT(kernel_name) DO UPDATE SET variants = variants + 1",
                (usage.kernel_name,),
            )

    # -- fleet metrics ------------------------------------------------------------------------------
    def totals(self) -> dict[str, float]:
        return {name: stored_number(value) for name, value in self._read("SELECT name, value FROM totals")}

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        current: tuple[str, str] | None = None
        values: dict[str, float] = {}
        for host, worker, name, value in self._read(
            "SELECT host, worker, name, value FROM worker_totals ORDER BY host, worker"
        ):
            if (host, worker) != current:
                if current is not None:
                    yield *current, values
                current, values = (host, worker), {}
            values[name] = stored_number(value)
        if current is not None:
            yield *current, values

    def toolchains(self) -> dict[str, dict[str, float]]:
        # A file last opened for writing by an older build lacks the table (opening one for a compile adds it):
        # until then no batch named a toolchain, which is nothing to report, not an error.
        if not self._read("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'toolchain_totals'"):
            return {}
        found: dict[str, dict[str, float]] = {}
        for toolchain, name, value in self._read(
            "SELECT toolchain, name, value FROM toolchain_totals ORDER BY toolchain, name"
        ):
            found.setdefault(toolchain, {})[name] = stored_number(value)
        return found

    def kernels(self) -> dict[str, dict[str, int]]:
        rows = self._read("SELECT kernel_name, call_count, variants FROM kernels ORDER BY kernel_name")
        return {
            name: {"call_count": int(stored_number(calls)), "variants": int(stored_number(variants))}
            for name, calls, variants in rows
        }

    def key_usage(self) -> Iterator[tuple[str, int]]:
        last = ""
        while True:
            rows = self._read(
                "SELECT cache_key, usage FROM key_usage WHERE cache_key > ? ORDER BY cache_key LIMIT ?", (last, BATCH)
            )
            yield from ((key, int(stored_number(usage))) for key, usage in rows)
            if len(rows) < BATCH:
                return
            last = rows[-1][0]

    def key_count(self) -> int:
        return int(self._read("SELECT count(*) FROM key_usage")[0][0])

    def key_records(self, cache_keys: Sequence[str]) -> dict[str, KeyRecord]:
        found: dict[str, KeyRecord] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            rows = self._read(
                "SELECT cache_key, kernel_name, usage, first_use, last_use FROM key_usage "
                f"WHERE cache_key IN ({','.join('?' * len(chunk))})",
                chunk,
            )
            found.update(
                (
                    row[0],
                    KeyRecord(row[0], row[1], int(stored_number(row[2])), stored_number(row[3]), stored_number(row[4])),
                )
                for row in rows
            )
        return found

    def key_hosts(self, cache_keys: Sequence[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            rows = self._read(
                f"SELECT cache_key, host FROM key_hosts WHERE cache_key IN ({','.join('?' * len(chunk))}) "
                "ORDER BY cache_key, host",
                chunk,
            )
            for key, host in rows:
                found.setdefault(key, []).append(host)
        return found

    def pass_log_span(self, since: float | None) -> tuple[float, float] | None:
        first = self.pass_log(since)
        try:
            start = next(first)[0]
        except StopIteration:
            return None
        first.close()
        (last_record,) = self._read("SELECT ts, record FROM pass_log ORDER BY id DESC LIMIT 1")
        return start, _local_record_time(*last_record)[0]

    def pass_log(self, since: float | None) -> Generator[tuple[float, dict], None, None]:
        last_id = 0
        while True:
            rows = self._read(
                "SELECT id, ts, record FROM pass_log WHERE id > ? AND ts >= ? ORDER BY id LIMIT 1000",
                (last_id, since if since is not None else float("-inf")),
            )
            for _, ts, raw in rows:
                when, record = _local_record_time(ts, raw)
                if record is not None:
                    yield when, record
            if len(rows) < 1000:
                return
            last_id = rows[-1][0]

    def zero_counters(self, record: dict) -> None:
        """Zero the fleet counters (totals, per worker, per toolchain) and append `record` to the pass log, in one
        transaction; entries, key usage, per-kernel counts and the pass log are kept."""
        with self._write() as db:
            for table in ("totals", "worker_totals", "toolchain_totals"):
                db.execute(f"DELETE FROM {table}")
            db.execute(
                "INSERT INTO pass_log (ts, record) VALUES (?, ?)", (time.time(), json.dumps(record, sort_keys=True))
            )

    # -- entries ------------------------------------------------------------------------------------
    def scan_entries(self, with_ttl: bool = True) -> Iterator[RawEntry]:
        last = ""
        while True:
            now = time.time()
            rows = self._read(
                f"SELECT cache_key, {self._SIZE_AND_DATA}, expires FROM entries WHERE toolchain = ? "
                "AND cache_key > ? AND expires > ? ORDER BY cache_key LIMIT ?",
                (self.max_entry_bytes, self.partition, last, now, BATCH),
            )
            for key, size, data, expires in rows:
                yield RawEntry(key, self._value(size, data), expires - now, self.partition)
            if len(rows) < BATCH:
                return
            last = rows[-1][0]

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        found: dict[str, bytes | TooLarge] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            rows = self._read(
                f"SELECT cache_key, {self._SIZE_AND_DATA} FROM entries WHERE toolchain = ? "
                f"AND cache_key IN ({','.join('?' * len(chunk))}) AND expires > ?",
                (self.max_entry_bytes, self.partition, *chunk, time.time()),
            )
            found.update((key, self._value(size, data)) for key, size, data in rows)
        return found

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        rows = self._read(
            "SELECT cache_key FROM entries WHERE toolchain = ? AND substr(cache_key, 1, ?) = ? AND expires > ? "
            "ORDER BY cache_key LIMIT ?",
            (self.partition, len(prefix), prefix, time.time(), limit),
        )
        return [key for (key,) in rows]

    def expired_count(self) -> tuple[int, int]:
        """(entries past their expiry that are still stored, their bytes), of every partition: the local tier
        never purges them by itself."""
        (row,) = self._read(
            "SELECT count(*), coalesce(sum(length(data)), 0) FROM entries WHERE expires <= ?", (time.time(),)
        )
        return int(row[0]), int(row[1])

    def purge_expired(self) -> None:
        """Delete every partition's expired entries."""
        now = time.time()
        with self._write() as db:
            db.execute("DELETE FROM entries WHERE expires <= ?", (now,))
            db.execute("DELETE FROM variant_index WHERE expires <= ?", (now,))
        self._give_back_space()

    def put_entries(self, items: Sequence[WriteItem]) -> None:
        if not items:
            return
        now = time.time()
        with self._write() as db:
            for item in items:
                row = (
                    self.partition,
                    item.cache_key,
                    item.data,
                    item.digest or "",
                    now + item.ttl,
                    now,
                    item.compile_seconds,
                )
                db.execute(f"INSERT OR REPLACE INTO entries {_ENTRY_COLUMNS}", row)
            trimmed = self._trim(db)
        if trimmed:
            self._give_back_space()

    def delete_entries(self, cache_keys: Sequence[str]) -> None:
        if not cache_keys:
            return
        with self._write() as db:
            db.executemany(
                "DELETE FROM entries WHERE toolchain = ? AND cache_key = ?",
                [(self.partition, key) for key in cache_keys],
            )
        self._give_back_space()

    # -- size -----------------------------------------------------------------------------------------
    @staticmethod
    def _bytes_in_use(db: sqlite3.Connection) -> int:
        """Bytes of the file's pages in use (its size once free pages are given back), from its header."""
        pages = db.execute("PRAGMA page_count").fetchone()[0] - db.execute("PRAGMA freelist_count").fetchone()[0]
        return pages * db.execute("PRAGMA page_size").fetchone()[0]

    def _trim(self, db: sqlite3.Connection) -> bool:
        """Within a write: past max_size, delete the entries of lowest retention score (cachestore.value: compile
        seconds saved per stored byte, by the passes this file's metrics saw use it (at least one), halved for
        every week unused; equal scores
        least recently used first), of every partition (the cap is the file's), until about TRIM_TO of it would
        be left. True when it deleted any."""
        if self.max_size is None:
            return False
        excess = self._bytes_in_use(db) - self.max_size
        if excess <= 0:
            return False
        excess += int(self.max_size * (1 - TRIM_TO))
        # SQLite sorts (spilling to its temporary files for a large file); only the victims reach Python.
        db.create_function("retention_score", 4, retention_score, deterministic=True)
        cursor = db.execute(
            "SELECT e.toolchain, e.cache_key, length(e.data) FROM entries e "
            "LEFT JOIN key_usage u ON u.cache_key = e.cache_key "
            "ORDER BY retention_score(e.compile_seconds, COALESCE(u.passes, 1), length(e.data) + ?, ? - e.used), "
            "e.used",
            (ROW_OVERHEAD, time.time()),
        )
        victims: list[tuple[str, str]] = []
        while excess > 0:
            rows = cursor.fetchmany(256)
            if not rows:
                break
            for partition, key, size in rows:
                victims.append((partition, key))
                excess -= size + ROW_OVERHEAD
                if excess <= 0:
                    break
        cursor.close()
        db.executemany("DELETE FROM entries WHERE toolchain = ? AND cache_key = ?", victims)
        return bool(victims)

    def _give_back_space(self) -> None:
        """Free pages go back to the file system: incremental vacuum moves pages off the file's end and truncates
        it, and a checkpoint writes that to the file itself (in WAL mode it lands there only then). Both are
        left to a later write when another process holds the lock. (The vacuum is run through executescript:
        stepped once by execute(), it frees one page.)"""
        db = self._db()
        with contextlib.suppress(sqlite3.OperationalError):
            db.execute(f"PRAGMA busy_timeout = {int(1000 * self.write_timeout)}")
            db.executescript("PRAGMA incremental_vacuum;")
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def capacity(self) -> dict[str, int | None]:
        """The file's size on disk (its write-ahead log included) against max_size."""
        size = sum(
            path.stat().st_size for path in (self.path, self.path.with_name(self.path.name + "-wal")) if path.is_file()
        )
        return {"file_bytes": size, "max_size": self.max_size}

    def close(self) -> None:
        with self._lock:
            for db in self._connections:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
            self._connections.clear()
        self._local = threading.local()


class _Replaced(TierUnavailable):
    """A write failed because the file was broken or replaced; it is now replaced, and the write was not done."""


_ENTRY_COLUMNS = "(toolchain, cache_key, data, digest, expires, used, compile_seconds) VALUES (?, ?, ?, ?, ?, ?, ?)"


def _local_record_time(ts: float, raw: str) -> tuple[float, dict | None]:
    try:
        record = json.loads(raw)
    except ValueError:
        return ts, None
    if not isinstance(record, dict):
        return ts, None
    return pass_time(record.get("finished"), ts), record


def open_store(settings: Settings, path: str, *, reading: bool, partition: str | None, writable: bool) -> SqliteBackend:
    """The local tier `local:PATH` names (cachestore.stores): reading (reports, inspection) waits longer for
    the lock and never creates the file; a compile's writes may wait as long as a closing client waits."""
    timeout = max(settings.op_timeout, READ_TIMEOUT) if reading else settings.op_timeout
    return SqliteBackend(
        path,
        timeout=timeout,
        create=not reading and writable,
        writable=writable,
        partition=partition,
        write_timeout=max(settings.final_flush_timeout, settings.op_timeout),
        max_entry_bytes=settings.max_entry_bytes,
        max_size=settings.max_size,
    )
