"""Snapshot files: a tier's raw entries (still encoded, signatures and all) and what the metrics know about
each key, for offline inspection (`nkicache inspect --snapshot FILE`) and for moving entries between tiers
(`inspect export` / `inspect import`).

A snapshot is a sequence of msgpack objects, written and read one at a time (memory stays bounded):

    header  {"nkicache_snapshot": 2, "schema": <entry schema>, "created": <unix time>, "source": <tier>}
    record  {"toolchain": <partition>, "key": <cache key>, "data": <encoded entry>,
             "ttl": <seconds left> | nil,
             "usage": {"kernel_name", "usage", "first_use", "last_use", "hosts"} | nil}   (one per entry)
    trailer {"nkicache_snapshot_end": <number of records>}

The trailer tells a complete file from a truncated one. Nothing here trusts an entry: `inspect import`
and `inspect verify` decode and check each one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import msgpack

from bridge.errors import NkiCacheError
from bridge.identity import toolchain_id
from cachestore.api import BATCH, KeyRecord, RawEntry, Reader, WriteItem, batched, stored_number
from cachestore.entry import MAX_ENTRY_BYTES, SCHEMA_VERSION, TooLarge

SNAPSHOT_VERSION = 2  # 2: records name their partition (under "toolchain")
HEADER_KEY = "nkicache_snapshot"
TRAILER_KEY = "nkicache_snapshot_end"
RECENT = 2 * BATCH  # records whose usage a reader keeps from its scan


class SnapshotError(NkiCacheError):
    """A snapshot file cannot be read or written; the message names the file."""


class SnapshotWriter:
    """Writes a snapshot atomically: to FILE.partial, renamed to FILE when closed without error."""

    def __init__(self, path: str | Path, source: str):
        self.path = Path(path)
        self._partial = self.path.with_name(self.path.name + ".partial")
        self.count = 0
        try:
            self._file: IO[bytes] = open(self._partial, "wb")  # noqa: SIM115 - closed in close()/abort()
        except OSError as exc:
            raise SnapshotError(f"{self.path}: cannot write: {exc.strerror or exc}") from None
        self._packer = msgpack.Packer(use_bin_type=True)
        self._put({HEADER_KEY: SNAPSHOT_VERSION, "schema": SCHEMA_VERSION, "created": time.time(), "source": source})

    def _put(self, obj: dict) -> None:
        try:
            self._file.write(self._packer.pack(obj))
        except OSError as exc:
            self.abort()
            raise SnapshotError(f"{self.path}: cannot write: {exc.strerror or exc}") from None

    def add(self, entry: RawEntry, usage: KeyRecord | None, hosts: Sequence[str] = ()) -> None:
        record: dict[str, Any] = {
            "toolchain": entry.partition,
            "key": entry.cache_key,
            "data": entry.data,
            "ttl": entry.ttl,
            "usage": None,
        }
        if usage is not None:
            record["usage"] = {
                "kernel_name": usage.kernel_name,
                "usage": usage.usage,
                "first_use": usage.first_use,
                "last_use": usage.last_use,
                "hosts": list(hosts),
            }
        self._put(record)
        self.count += 1

    def close(self) -> None:
        self._put({TRAILER_KEY: self.count})
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._partial, self.path)

    def abort(self) -> None:
        self._file.close()
        self._partial.unlink(missing_ok=True)


class SnapshotReader(Reader):
    """A snapshot file as a read-only `Reader`: entries and per-key usage; it holds no fleet totals,
    workers, kernel counts or pass log, so those read as empty. Entries are read in one partition, as
    from a tier."""

    keeps_expired = False  # a snapshot keeps what was live when it was written
    splits_scans = False  # scanned in one process (cachestore.scan_split)

    def __init__(self, path: str | Path, partition: str | None = None):
        self.path = Path(path)
        self.description = f"snapshot {self.path}"
        self.partition = partition or toolchain_id()
        self._index: dict[str, int] | None = None
        self._recent: dict[str, dict | None] = {}
        with self._open() as file:
            self.header = self._header(self._unpacker(file))

    def _open(self) -> IO[bytes]:
        try:
            return open(self.path, "rb")
        except OSError as exc:
            raise SnapshotError(f"{self.path}: cannot read snapshot: {exc.strerror or exc}") from None

    @staticmethod
    def _unpacker(file: IO[bytes]) -> msgpack.Unpacker:
        return msgpack.Unpacker(file, raw=False, max_buffer_size=2 * MAX_ENTRY_BYTES, strict_map_key=True)

    def _header(self, unpacker: msgpack.Unpacker) -> dict:
        header = self._next(unpacker)
        if isinstance(header, dict) and header.get(HEADER_KEY) == 1:
            raise SnapshotError(
                f"{self.path}: a version 1 snapshot, whose entries no toolchain takes; "
                "export the tier again with this build"
            )
        if not isinstance(header, dict) or header.get(HEADER_KEY) != SNAPSHOT_VERSION:
            raise SnapshotError(f"{self.path}: not an nkicache snapshot (version {SNAPSHOT_VERSION})")
        return header

    def _next(self, unpacker: msgpack.Unpacker) -> Any:
        try:
            return next(unpacker)
        except StopIteration:
            raise SnapshotError(f"{self.path}: snapshot is truncated (no end marker)") from None
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise SnapshotError(f"{self.path}: snapshot is corrupt: {type(exc).__name__}") from None

    def records(self) -> Iterator[tuple[int, dict]]:
        """(file offset, record) for every record; raises SnapshotError at the end of a truncated file."""
        with self._open() as file:
            unpacker = self._unpacker(file)
            self._header(unpacker)
            count = 0
            while True:
                offset = unpacker.tell()
                record = self._next(unpacker)
                if isinstance(record, dict) and TRAILER_KEY in record:
                    if record[TRAILER_KEY] != count:
                        raise SnapshotError(f"{self.path}: end marker says {record[TRAILER_KEY]} records, read {count}")
                    return
                if not _is_record(record):
                    raise SnapshotError(f"{self.path}: record {count} is malformed")
                if not _finite_ttl(record["ttl"]):
                    # An infinite TTL would never expire once imported (Redis refuses it with an OverflowError
                    # on the way), and no JSON output can hold it: the file was not written by `inspect export`.
                    raise SnapshotError(f"{self.path}: record {count} has ttl {record['ttl']!r}, not a finite number")
                count += 1
                yield offset, record

    def _record_at(self, offset: int) -> dict:
        with self._open() as file:
            file.seek(offset)
            return self._next(self._unpacker(file))

    def _offsets(self) -> dict[str, int]:
        if self._index is None:
            self._index = {record["key"]: offset for offset, record in self._own_records()}
        return self._index

    def _own_records(self) -> Iterator[tuple[int, dict]]:
        return ((offset, record) for offset, record in self.records() if record["toolchain"] == self.partition)

    def entry_partitions(self) -> list[str]:
        return sorted({record["toolchain"] for _, record in self.records()})

    def entry_keys(self) -> Iterator[tuple[str, str]]:
        return ((record["toolchain"], record["key"]) for _, record in self.records())

    def in_partition(self, partition: str) -> SnapshotReader:
        return SnapshotReader(self.path, partition)

    # -- Reader: fleet metrics (a snapshot keeps only per-key usage) --------------------------------
    def totals(self) -> dict[str, float]:
        return {}

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        return iter(())

    def toolchains(self) -> dict[str, dict[str, float]]:
        return {}

    def kernels(self) -> dict[str, dict[str, int]]:
        return {}

    def key_usage(self) -> Iterator[tuple[str, int]]:
        for _, record in self._own_records():
            if record.get("usage"):
                yield record["key"], int(stored_number(record["usage"]["usage"]))

    def key_count(self) -> int:
        return sum(1 for _ in self.key_usage())

    def pass_log_span(self, since: float | None) -> tuple[float, float] | None:
        return None

    def pass_log(self, since: float | None) -> Iterator[tuple[float, dict]]:
        return iter(())

    def zero_counters(self, record: dict) -> None:
        pass  # it holds no counters

    # -- Reader: entries ------------------------------------------------------------------------
    def scan_entries(self, with_ttl: bool = True) -> Iterator[RawEntry]:
        for _, record in self._own_records():
            # Callers ask for the usage of what they just scanned: keep the latest records' at hand.
            self._recent[record["key"]] = record.get("usage")
            if len(self._recent) > RECENT:
                del self._recent[next(iter(self._recent))]
            yield RawEntry(record["key"], record["data"], record.get("ttl"), record["toolchain"])

    def _usage(self, key: str) -> dict | None:
        if key in self._recent:
            return self._recent[key]
        offset = self._offsets().get(key)
        return self._record_at(offset).get("usage") if offset is not None else None

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        offsets = self._offsets()
        return {key: self._record_at(offsets[key])["data"] for key in cache_keys if key in offsets}

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        return sorted(key for key in self._offsets() if key.startswith(prefix))[:limit]

    def key_records(self, cache_keys: Sequence[str]) -> dict[str, KeyRecord]:
        found = {}
        for key in cache_keys:
            usage = self._usage(key)
            if usage:
                # Read as a tier's metrics are read: a number that is not one counts 0 (the file is not trusted).
                found[key] = KeyRecord(
                    key,
                    str(usage["kernel_name"]),
                    int(stored_number(usage["usage"])),
                    stored_number(usage["first_use"]),
                    stored_number(usage["last_use"]),
                )
        return found

    def key_hosts(self, cache_keys: Sequence[str]) -> dict[str, list[str]]:
        found = {}
        for key in cache_keys:
            usage = self._usage(key)
            if usage and isinstance(usage["hosts"], list) and usage["hosts"]:
                found[key] = [str(host) for host in usage["hosts"]]
        return found

    def put_entries(self, items: Sequence[WriteItem]) -> None:
        raise SnapshotError(f"{self.path}: a snapshot is read-only; import it into a tier instead")

    def delete_entries(self, cache_keys: Sequence[str]) -> None:
        raise SnapshotError(f"{self.path}: a snapshot is read-only")

    def expired_count(self) -> tuple[int, int]:
        return 0, 0

    def purge_expired(self) -> None:
        pass

    def close(self) -> None:
        pass


def _is_record(record: object) -> bool:
    return (
        isinstance(record, dict)
        and isinstance(record.get("toolchain"), str)
        and isinstance(record.get("key"), str)
        and isinstance(record.get("data"), bytes)
        and isinstance(record.get("ttl"), int | float | type(None))
        and (record.get("usage") is None or _is_usage(record["usage"]))
    )


def _finite_ttl(ttl: float | None) -> bool:
    return ttl is None or math.isfinite(ttl)


def _is_usage(usage: object) -> bool:
    return isinstance(usage, dict) and {"kernel_name", "usage", "first_use", "last_use", "hosts"} <= set(usage)


def write_snapshot(reader: Reader, path: str | Path) -> int:
    """Every entry of `reader`, of every partition, with its usage, into a snapshot file; returns the number
    of entries. An entry over the reader's max_entry_bytes is left out: it was not read, and no tier would
    take it back."""
    writer = SnapshotWriter(path, reader.description)
    try:
        for partition in reader.entry_partitions():
            for batch in batched(reader.in_partition(partition).scan_entries()):
                keys = [entry.cache_key for entry in batch]
                usage, hosts = reader.key_records(keys), reader.key_hosts(keys)
                for entry in batch:
                    if not isinstance(entry.data, TooLarge):
                        writer.add(entry, usage.get(entry.cache_key), hosts.get(entry.cache_key, ()))
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.count
