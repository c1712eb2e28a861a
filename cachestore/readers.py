"""Read-side access to a tier's storage, for reports and inspection (and the few writes `inspect import`
and `inspect gc` make): the fleet metrics and the raw, still-encoded entries, whatever stores them.

Everything streams: entries and per-key metrics come in batches (SCAN/HSCAN and pipelines on Redis, keyset
pages on SQLite), so memory stays bounded by the batch size, not by the size of the cache. Reading an entry
here never refreshes its TTL (plain GET, not the compile path's GETEX): looking does not keep it alive.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cachestore.tier import TierTimeout, TierUnavailable

BATCH = 500  # keys per pipeline / page


@dataclass
class RawEntry:
    cache_key: str
    data: bytes
    ttl: float | None  # seconds left, None when the store keeps no expiry


@dataclass
class KeyRecord:
    """What the fleet metrics know about one cache key."""

    cache_key: str
    kernel_name: str
    usage: int
    first_use: float
    last_use: float


@dataclass
class WriteItem:
    cache_key: str
    data: bytes
    digest: str | None  # set for an entry holding its binary: the digest index points at it
    ttl: float


class TierReader(Protocol):
    description: str

    # -- fleet metrics ------------------------------------------------------------------------------
    def totals(self) -> dict[str, float]: ...

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        """(host, worker, that worker's totals) for every worker that ever applied a batch."""

    def kernels(self) -> dict[str, dict[str, int]]:
        """{kernel name: {"call_count", "variants"}}, as `_export_new_nki_fe_metrics`, fleet-wide."""

    def key_usage(self) -> Iterator[tuple[str, int]]:
        """(cache key, usage) for every key the metrics know, streamed."""

    def key_count(self) -> int: ...

    def key_records(self, cache_keys: Sequence[str]) -> dict[str, KeyRecord]: ...

    def key_hosts(self, cache_keys: Sequence[str]) -> dict[str, list[str]]:
        """The hosts that used each key (keys no host used are left out)."""

    def pass_log_span(self, since: float | None) -> tuple[float, float] | None:
        """Timestamps of the first and last pass-log record at or after `since`."""

    def pass_log(self, since: float | None) -> Iterator[tuple[float, dict]]:
        """(time appended, pass record), oldest first, streamed."""

    # -- entries ------------------------------------------------------------------------------------
    def scan_entries(self, with_ttl: bool = True) -> Iterator[RawEntry]:
        """Every entry, streamed; `with_ttl=False` when the caller has no use for the time left."""

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes]: ...

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        """Cache keys that start with `prefix` (at most `limit`)."""

    def put_entries(self, items: Sequence[WriteItem]) -> None: ...

    def delete_entries(self, items: Sequence[tuple[str, str | None]]) -> None:
        """Delete (cache key, digest) entries; the digest index entry goes too when it points at the key."""

    def close(self) -> None: ...


# -- Redis ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _redis_errors(description: str) -> Iterator[None]:
    import redis.exceptions as rex

    try:
        yield
    except rex.TimeoutError as exc:
        raise TierTimeout(f"{description}: timed out: {exc}") from None
    except (rex.RedisError, OSError) as exc:
        raise TierUnavailable(f"{description}: {type(exc).__name__}: {exc}") from None


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def batched(items: Iterator, size: int = BATCH) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class RedisReader:
    """Over a redis-py client (Redis, RedisCluster or fakeredis); key names come from `KeySpace`."""

    def __init__(self, client: Any, keys: Any, description: str = "redis"):
        self.client = client
        self.keys = keys
        self.description = description

    def _pipeline(self, fill: Any) -> list:
        with _redis_errors(self.description):
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()

    def _stream(self, iterator_factory: Any) -> Iterator:
        """Items of a redis-py scan iterator, with errors translated at every step."""
        with _redis_errors(self.description):
            iterator = iterator_factory()
        while True:
            with _redis_errors(self.description):
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item

    # -- fleet metrics ------------------------------------------------------------------------------
    def _float_hash(self, name: str) -> dict[str, float]:
        return {_text(k): float(v) for k, v in self._stream(lambda: self.client.hscan_iter(name, count=1000))}

    def totals(self) -> dict[str, float]:
        return self._float_hash(self.keys.totals)

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        members = self._stream(lambda: self.client.sscan_iter(self.keys.workers, count=1000))
        for batch in batched(_text(m) for m in members):
            pairs = [member.partition(":")[::2] for member in batch]
            hashes = self._pipeline(lambda pipe, p=pairs: [pipe.hgetall(self.keys.worker_metrics(h, w)) for h, w in p])
            for (host, worker), values in zip(pairs, hashes, strict=True):
                yield host, worker, {_text(k): float(v) for k, v in values.items()}

    def kernels(self) -> dict[str, dict[str, int]]:
        calls = self._float_hash(self.keys.kernel_calls)
        variants = self._float_hash(self.keys.kernel_variants)
        return {
            name: {"call_count": int(calls.get(name, 0)), "variants": int(variants.get(name, 0))}
            for name in sorted(set(calls) | set(variants))
        }

    def key_usage(self) -> Iterator[tuple[str, int]]:
        for key, usage in self._stream(lambda: self.client.hscan_iter(self.keys.key_usage, count=1000)):
            yield _text(key), int(usage)

    def key_count(self) -> int:
        with _redis_errors(self.description):
            return int(self.client.hlen(self.keys.key_usage))

    def key_records(self, cache_keys: Sequence[str]) -> dict[str, KeyRecord]:
        found: dict[str, KeyRecord] = {}
        k = self.keys
        hashes = (k.key_usage, k.key_kernel, k.key_first, k.key_last)
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            usage, kernel, first, last = self._pipeline(lambda pipe, c=chunk: [pipe.hmget(h, c) for h in hashes])
            for i, key in enumerate(chunk):
                if usage[i] is not None:
                    found[key] = KeyRecord(key, _text(kernel[i]) or "", int(usage[i]), float(first[i] or 0),
                                           float(last[i] or 0))  # fmt: skip
        return found

    def key_hosts(self, cache_keys: Sequence[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            members = self._pipeline(lambda pipe, c=chunk: [pipe.smembers(self.keys.key_hosts(key)) for key in c])
            for key, hosts in zip(chunk, members, strict=True):
                if hosts:
                    found[key] = sorted(_text(h) for h in hosts)
        return found

    @staticmethod
    def _stream_id(since: float | None) -> str:
        return "-" if since is None else str(max(0, int(since * 1000)))

    def pass_log_span(self, since: float | None) -> tuple[float, float] | None:
        with _redis_errors(self.description):
            first = self.client.xrange(self.keys.pass_log, min=self._stream_id(since), count=1)
            last = self.client.xrevrange(self.keys.pass_log, count=1)
        if not first or not last:
            return None
        return _record_time(*first[0]), _record_time(*last[0])

    def pass_log(self, since: float | None) -> Iterator[tuple[float, dict]]:
        start = self._stream_id(since)
        while True:
            with _redis_errors(self.description):
                page = self.client.xrange(self.keys.pass_log, min=start, count=1000)
            for stream_id, fields in page:
                record = _pass_record(fields)
                if record is not None:
                    yield _record_time(stream_id, fields), record
            if len(page) < 1000:
                return
            start = "(" + _text(page[-1][0])

    # -- entries ------------------------------------------------------------------------------------
    def scan_entries(self, with_ttl: bool = True) -> Iterator[RawEntry]:
        redis_keys = self._stream(lambda: self.client.scan_iter(match=self.keys.entry_pattern(), count=1000))
        step = 2 if with_ttl else 1
        for batch in batched(_text(key) for key in redis_keys):
            values = self._pipeline(
                lambda pipe, b=batch: [(pipe.get(key), pipe.pttl(key)) if with_ttl else pipe.get(key) for key in b]
            )
            for i, redis_key in enumerate(batch):
                data, ttl_ms = values[step * i], values[step * i + 1] if with_ttl else None
                if data is not None:
                    ttl = ttl_ms / 1000 if ttl_ms is not None and ttl_ms >= 0 else None
                    yield RawEntry(self.keys.cache_key_of_entry(redis_key), data, ttl)

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            values = self._pipeline(lambda pipe, c=chunk: [pipe.get(self.keys.entry(key)) for key in c])
            found.update((key, value) for key, value in zip(chunk, values, strict=True) if value is not None)
        return found

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        pattern = self.keys.entry(prefix.replace("*", "")).removesuffix("}") + "*"
        found: list[str] = []
        for redis_key in self._stream(lambda: self.client.scan_iter(match=pattern, count=1000)):
            found.append(self.keys.cache_key_of_entry(_text(redis_key)))
            if len(found) >= limit:
                break
        return sorted(found)

    def put_entries(self, items: Sequence[WriteItem]) -> None:
        def fill(pipe: Any) -> None:
            for item in items:
                ttl_ms = max(1, int(item.ttl * 1000))
                pipe.set(self.keys.entry(item.cache_key), item.data, px=ttl_ms)
                if item.digest:
                    pipe.set(self.keys.digest(item.digest), item.cache_key, px=ttl_ms)

        if items:
            self._pipeline(fill)

    def delete_entries(self, items: Sequence[tuple[str, str | None]]) -> None:
        if not items:
            return
        self._pipeline(lambda pipe: [pipe.delete(self.keys.entry(key)) for key, _ in items])
        indexed = [(key, digest) for key, digest in items if digest]
        if not indexed:
            return
        holders = self._pipeline(lambda pipe: [pipe.get(self.keys.digest(digest)) for _, digest in indexed])
        # Only index entries still naming a deleted key. One stored again in between loses its index entry,
        # which costs that binary its deduplication once, never correctness (stores check the holder exists).
        stale = [digest for (key, digest), holder in zip(indexed, holders, strict=True) if _text(holder) == key]
        if stale:
            self._pipeline(lambda pipe: [pipe.delete(self.keys.digest(digest)) for digest in stale])

    def close(self) -> None:
        with _redis_errors(self.description):
            self.client.close()


def _pass_record(fields: dict) -> dict | None:
    raw = fields.get(b"pass", fields.get("pass"))
    try:
        record = json.loads(raw)
    except (TypeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _record_time(stream_id: bytes | str, fields: dict) -> float:
    """When the pass ended (its record's `finished`), else when it was appended (the stream id)."""
    record = _pass_record(fields) or {}
    finished = record.get("finished")
    if isinstance(finished, int | float):
        return float(finished)
    return int(_text(stream_id).partition("-")[0]) / 1000


# -- SQLite (the local tier) --------------------------------------------------------------------------
class LocalReader:
    """Over the local tier's SQLite file (see `cachestore.local_tier` for the tables)."""

    def __init__(self, path: str | Path, timeout: float = 5.0):
        self.path = Path(path).expanduser()
        self.description = f"local:{self.path}"
        if not self.path.is_file():
            raise TierUnavailable(f"no local tier at {self.path}")
        try:
            self.db = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
            self.db.execute("SELECT 1 FROM entries LIMIT 1")
        except sqlite3.Error as exc:
            raise TierUnavailable(f"local tier {self.path}: {exc}") from None

    def _rows(self, sql: str, params: Sequence = ()) -> list[tuple]:
        try:
            return self.db.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            raise TierUnavailable(f"local tier {self.path}: {exc}") from None

    def _write(self, statements: Sequence[tuple[str, Sequence]]) -> None:
        try:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    self.db.execute(sql, params)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
        except sqlite3.Error as exc:
            raise TierUnavailable(f"local tier {self.path}: {exc}") from None

    # -- fleet metrics ------------------------------------------------------------------------------
    def totals(self) -> dict[str, float]:
        return dict(self._rows("SELECT name, value FROM totals"))

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        current: tuple[str, str] | None = None
        values: dict[str, float] = {}
        for host, worker, name, value in self._rows(
            "SELECT host, worker, name, value FROM worker_totals ORDER BY host, worker"
        ):
            if (host, worker) != current:
                if current is not None:
                    yield *current, values
                current, values = (host, worker), {}
            values[name] = value
        if current is not None:
            yield *current, values

    def kernels(self) -> dict[str, dict[str, int]]:
        rows = self._rows("SELECT kernel_name, call_count, variants FROM kernels ORDER BY kernel_name")
        return {name: {"call_count": int(calls), "variants": int(variants)} for name, calls, variants in rows}

    def key_usage(self) -> Iterator[tuple[str, int]]:
        last = ""
        while True:
            rows = self._rows(
                "SELECT cache_key, usage FROM key_usage WHERE cache_key > ? ORDER BY cache_key LIMIT ?", (last, BATCH)
            )
            yield from ((key, int(usage)) for key, usage in rows)
            if len(rows) < BATCH:
                return
            last = rows[-1][0]

    def key_count(self) -> int:
        return int(self._rows("SELECT count(*) FROM key_usage")[0][0])

    def key_records(self, cache_keys: Sequence[str]) -> dict[str, KeyRecord]:
        found: dict[str, KeyRecord] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            rows = self._rows(
                "SELECT cache_key, kernel_name, usage, first_use, last_use FROM key_usage "
                f"WHERE cache_key IN ({','.join('?' * len(chunk))})",
                chunk,
            )
            found.update((row[0], KeyRecord(row[0], row[1], int(row[2]), row[3], row[4])) for row in rows)
        return found

    def key_hosts(self, cache_keys: Sequence[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            rows = self._rows(
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
        (last_record,) = self._rows("SELECT ts, record FROM pass_log ORDER BY id DESC LIMIT 1")
        return start, _local_record_time(*last_record)[0]

    def pass_log(self, since: float | None) -> Iterator[tuple[float, dict]]:
        last_id = 0
        while True:
            rows = self._rows(
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

    # -- entries ------------------------------------------------------------------------------------
    def scan_entries(self, with_ttl: bool = True) -> Iterator[RawEntry]:
        last = ""
        while True:
            now = time.time()
            rows = self._rows(
                "SELECT cache_key, data, expires FROM entries WHERE cache_key > ? AND expires > ? "
                "ORDER BY cache_key LIMIT ?",
                (last, now, BATCH),
            )
            for key, data, expires in rows:
                yield RawEntry(key, bytes(data), expires - now)
            if len(rows) < BATCH:
                return
            last = rows[-1][0]

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            rows = self._rows(
                f"SELECT cache_key, data FROM entries WHERE cache_key IN ({','.join('?' * len(chunk))}) "
                "AND expires > ?",
                (*chunk, time.time()),
            )
            found.update((key, bytes(data)) for key, data in rows)
        return found

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        rows = self._rows(
            "SELECT cache_key FROM entries WHERE substr(cache_key, 1, ?) = ? AND expires > ? ORDER BY cache_key "
            "LIMIT ?",
            (len(prefix), prefix, time.time(), limit),
        )
        return [key for (key,) in rows]

    def expired_count(self) -> tuple[int, int]:
        """(entries past their expiry that are still stored, their bytes): the local tier never purges them."""
        (row,) = self._rows("SELECT count(*), coalesce(sum(length(data)), 0) FROM entries WHERE expires <= ?",
                            (time.time(),))  # fmt: skip
        return int(row[0]), int(row[1])

    def purge_expired(self) -> None:
        now = time.time()
        self._write([
            ("DELETE FROM digests WHERE cache_key IN (SELECT cache_key FROM entries WHERE expires <= ?)", (now,)),
            ("DELETE FROM entries WHERE expires <= ?", (now,)),
        ])  # fmt: skip

    def put_entries(self, items: Sequence[WriteItem]) -> None:
        now = time.time()
        statements: list[tuple[str, Sequence]] = []
        for item in items:
            statements.append(
                ("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?)",
                 (item.cache_key, item.data, item.digest or "", now + item.ttl))
            )  # fmt: skip
            if item.digest:
                statements.append(("INSERT OR REPLACE INTO digests VALUES (?, ?)", (item.digest, item.cache_key)))
        if statements:
            self._write(statements)

    def delete_entries(self, items: Sequence[tuple[str, str | None]]) -> None:
        statements: list[tuple[str, Sequence]] = []
        for key, digest in items:
            statements.append(("DELETE FROM entries WHERE cache_key = ?", (key,)))
            if digest:
                statements.append(("DELETE FROM digests WHERE digest = ? AND cache_key = ?", (digest, key)))
            else:  # an unreadable entry: its digest is unknown (a scan, but such entries are rare)
                statements.append(("DELETE FROM digests WHERE cache_key = ?", (key,)))
        if statements:
            self._write(statements)

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.db.close()


def _local_record_time(ts: float, raw: str) -> tuple[float, dict | None]:
    try:
        record = json.loads(raw)
    except ValueError:
        return ts, None
    if not isinstance(record, dict):
        return ts, None
    finished = record.get("finished")
    return (float(finished) if isinstance(finished, int | float) else ts), record


# -- opening one ------------------------------------------------------------------------------------
READ_TIMEOUT = 30.0  # seconds for one batch: reports are not on the compile path


def open_reader(settings: Any) -> TierReader:
    """A reader on the tier the settings name (`off` is an error: there is nothing to read)."""
    from cachestore.settings import SettingsError
    from cachestore.urls import REDIS_SCHEMES, describe

    url = settings.tier
    if url.startswith("local:"):
        return LocalReader(url[len("local:") :], timeout=max(settings.op_timeout, READ_TIMEOUT))
    if url.startswith(REDIS_SCHEMES):
        from cachestore.keys import KeySpace
        from cachestore.redis_tier import connect

        client = connect(
            url, connect_timeout=max(settings.connect_timeout, 2.0), op_timeout=max(settings.op_timeout, READ_TIMEOUT),
            password=settings.redis_password,
        )  # fmt: skip
        return RedisReader(client, KeySpace(settings.namespace), describe(url))
    raise SettingsError(f"cannot read tier {url!r}; use local:PATH, redis://, rediss://, unix:// or redis+cluster://")
