"""Fleet metrics folded from applied batches: for a store that keeps each batch as one record (a blob
tier, cachestore.blob.tier) instead of summing them into counters as it applies them.

A record is the JSON of one applied batch (`batch_record`) or of one `report --zero` (`zero_record`), each
with the time the store applied it. `fold` reads them in that order and gives what the Reader protocol
answers: the sums the SQLite tier keeps in its tables, computed the same way (a zero clears the fleet's, the
workers' and the toolchains' totals; key usage, per-kernel counts and the pass log are kept).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence

import msgspec

from cachestore.api import KeyRecord, MetricsBatch, pass_time, stored_number


def batch_record(batch: MetricsBatch, applied: float) -> bytes:
    """The record of `batch` applied at `applied` (checked by batch_problem before: its numbers are JSON's)."""
    keys = {key: [u.kernel_name, u.usage, u.first_use, u.last_use] for key, u in batch.keys.items()}
    return json.dumps(
        {
            "batch_id": batch.batch_id,
            "host": batch.host,
            "worker": batch.worker,
            "toolchain": batch.toolchain,
            "totals": batch.totals,
            "kernel_calls": batch.kernel_calls,
            "keys": keys,
            "pass_record": batch.pass_record,
            "applied": applied,
        },
        sort_keys=True,
        allow_nan=False,
    ).encode()


def zero_record(record: dict, applied: float) -> bytes:
    """The record of a `report --zero` logging `record`."""
    return json.dumps({"zero": True, "pass_record": record, "applied": applied}, sort_keys=True).encode()


def parse_record(data: bytes) -> dict | None:
    """A record's fields, or None for bytes that are no record (a foreign or damaged file: skipped)."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("applied"), int | float):
        return None
    return record


class Fold(msgspec.Struct):
    totals: dict[str, float] = msgspec.field(default_factory=dict)
    workers: dict[tuple[str, str], dict[str, float]] = msgspec.field(default_factory=dict)
    toolchains: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    kernels: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    keys: dict[str, KeyRecord] = msgspec.field(default_factory=dict)
    hosts: dict[str, set[str]] = msgspec.field(default_factory=dict)
    log: list[tuple[float, float, dict]] = msgspec.field(default_factory=list)  # (applied, pass ended, pass record)


def _add(into: dict[str, float], totals: object) -> None:
    if isinstance(totals, dict):
        for name, value in totals.items():
            into[str(name)] = into.get(str(name), 0.0) + stored_number(value)


def fold(records: Iterable[dict]) -> Fold:
    """The metrics of `records` (parse_record's), applied oldest first (ties by batch id)."""
    done = Fold()
    ordered = sorted(records, key=lambda r: (stored_number(r["applied"]), str(r.get("batch_id", ""))))
    for record in ordered:
        applied = stored_number(record["applied"])
        log = record.get("pass_record")
        if record.get("zero"):
            done.totals, done.workers, done.toolchains = {}, {}, {}
        else:
            _fold_batch(done, record)
        if isinstance(log, dict):
            done.log.append((applied, pass_time(log.get("finished"), applied), log))
    return done


def _fold_batch(done: Fold, record: dict) -> None:
    host, worker, toolchain = str(record.get("host", "")), str(record.get("worker", "")), record.get("toolchain")
    _add(done.totals, record.get("totals"))
    _add(done.workers.setdefault((host, worker), {}), record.get("totals"))
    if toolchain and isinstance(toolchain, str):
        _add(done.toolchains.setdefault(toolchain, {}), record.get("totals"))
    keys = record.get("keys")
    for key, usage in keys.items() if isinstance(keys, dict) else ():
        if not isinstance(usage, list) or len(usage) != 4:
            continue
        kernel, count, first, last = str(usage[0]), *map(stored_number, usage[1:])
        known = done.keys.get(key)
        if known is None:
            done.keys[key] = KeyRecord(key, kernel, int(count), first, last)
            done.kernels.setdefault(kernel, {"call_count": 0, "variants": 0})["variants"] += 1
        else:
            known.usage += int(count)
            known.first_use, known.last_use = min(known.first_use, first), max(known.last_use, last)
        done.hosts.setdefault(key, set()).add(host)
    calls = record.get("kernel_calls")
    for kernel, count in calls.items() if isinstance(calls, dict) else ():
        done.kernels.setdefault(str(kernel), {"call_count": 0, "variants": 0})["call_count"] += int(
            stored_number(count)
        )


class FoldedMetrics:
    """The Reader's fleet-metrics methods, answered by folding a store's records, one a name and never rewritten
    (so each is read and parsed once): the store gives their names (`_record_names`) and the bytes of those it
    still holds (`_records_bytes`, many at once: one round of requests, not one request each, on S3)."""

    _records: dict[str, dict | None]  # parsed records by name (None: no record)
    _folded: tuple[list[str], Fold] | None = None  # the last fold, and the names it folded

    def _record_names(self) -> list[str]:
        raise NotImplementedError

    def _records_bytes(self, names: list[str]) -> dict[str, bytes]:
        raise NotImplementedError

    def _fold(self) -> Fold:
        """The fold of the records there are now; folded again only when a record was added or removed."""
        names = self._record_names()
        if self._folded is not None and self._folded[0] == names:
            return self._folded[1]
        new = [name for name in names if name not in self._records]
        found = self._records_bytes(new) if new else {}
        for name in new:
            self._records[name] = parse_record(found[name]) if name in found else None
        self._folded = (names, fold(record for name in names if (record := self._records.get(name)) is not None))
        return self._folded[1]

    def totals(self) -> dict[str, float]:
        return self._fold().totals

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        for (host, worker), totals in sorted(self._fold().workers.items()):
            yield host, worker, totals

    def toolchains(self) -> dict[str, dict[str, float]]:
        return dict(sorted(self._fold().toolchains.items()))

    def kernels(self) -> dict[str, dict[str, int]]:
        return dict(sorted(self._fold().kernels.items()))

    def key_usage(self) -> Iterator[tuple[str, int]]:
        yield from sorted((key, record.usage) for key, record in self._fold().keys.items())

    def key_count(self) -> int:
        return len(self._fold().keys)

    def key_records(self, cache_keys: Sequence[str]) -> dict[str, KeyRecord]:
        keys = self._fold().keys
        return {key: keys[key] for key in cache_keys if key in keys}

    def key_hosts(self, cache_keys: Sequence[str]) -> dict[str, list[str]]:
        hosts = self._fold().hosts
        return {key: sorted(hosts[key]) for key in cache_keys if key in hosts}

    def pass_log(self, since: float | None) -> Iterator[tuple[float, dict]]:
        yield from ((when, r) for applied, when, r in self._fold().log if since is None or applied >= since)

    def pass_log_span(self, since: float | None) -> tuple[float, float] | None:
        log = self._fold().log
        first = next((when for applied, when, _ in log if since is None or applied >= since), None)
        return None if first is None else (first, log[-1][1])
