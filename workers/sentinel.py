"""The determinism sentinel (issue 22): trace again, off the compile path, a sample of the entries the fleet
is being served, and quarantine any whose binary is not what this compiler produces.

A signature says who wrote an entry, not that its binary is right: a compile that is not deterministic, or a
compiler bug on one host, stores a wrong binary that every signature check passes. `nkicache sentinel` reads
the trusted scope of this compiler's toolchain, picks each entry used within `--since` (by the fleet metrics'
last use) with probability `sentinel_rate`, rebuilds its kernel call from its key components, traces it and
compares the binary (and its input and output names) with the stored one.

A mismatch quarantines the entry: its bytes move to the `quarantine` scope of its toolchain (no client reads
it: `scope` may not name it), so it is never served again and is kept for `nkicache inspect`; the next compile
that needs the variant traces it anew. Each quarantine is counted in the fleet metrics (`quarantined`, and
`quarantined_writer:KEYID` naming its writer, in the totals of its toolchain too), which `report` and the
Prometheus endpoint show; `nkicache trust distrust` then removes the writer from a trust policy.
"""

from __future__ import annotations

import random
import time
import uuid

import msgspec

from cachestore.api import MetricsBatch, Reader, Store, WriteItem, batched
from cachestore.entry import Entry, SignaturePolicy
from cachestore.inspect import decode_or_reason
from cachestore.keys import QUARANTINE_SCOPE, partition, split_partition
from workers.verify import _recompile_problem

MISMATCH_PREFIXES = ("recompiled binary differs", "recompiled binary names other")


class SentinelReport(msgspec.Struct):
    toolchain: str
    rate: float
    entries: int = 0  # entries of the trusted scope looked at
    sampled: int = 0  # picked and traced again
    matched: int = 0
    quarantined: list[dict] = msgspec.field(default_factory=list)  # [{key, writer, toolchain, reason}]
    failed: list[dict] = msgspec.field(default_factory=list)  # [{key, reason}]: could not be traced again
    rejected: int = 0  # entries the policy rejects: never served, nothing to check
    seconds: float = 0.0
    read_only: bool = False  # tier_mode read-only: `quarantined` lists what it would quarantine; nothing moved

    def as_json(self) -> dict:
        return msgspec.structs.asdict(self)


def run_sentinel(
    reader: Store,
    policy: SignaturePolicy,
    *,
    rate: float,
    since: float | None = None,
    host: str = "",
    quarantine_ttl: float = 30 * 24 * 3600,
    rng: random.Random | None = None,
    now: float | None = None,
    read_only: bool = False,
) -> SentinelReport:
    """One sweep over `reader`'s partition (a toolchain's trusted scope): sample, trace again, quarantine.
    `read_only` (tier_mode read-only, e.g. the reader ACL user): the same sweep sending no write, neither a
    quarantine nor a metrics count; the report lists what it would have quarantined."""
    rng = rng or random.Random()
    started = time.perf_counter()
    cutoff = None if since is None else (time.time() if now is None else now) - since
    toolchain = split_partition(reader.partition)[0]  # its trusted scope's partition is named by its id alone
    report = SentinelReport(toolchain, rate, read_only=read_only)
    for batch in batched(reader.scan_entries(with_ttl=False)):
        usage = reader.key_records([raw.cache_key for raw in batch]) if cutoff is not None else {}
        for raw in batch:
            report.entries += 1
            if cutoff is not None and (raw.cache_key not in usage or usage[raw.cache_key].last_use < cutoff):
                continue
            if rng.random() >= rate:
                continue
            entry = decode_or_reason(raw.data, policy, cache_key=raw.cache_key)
            if isinstance(entry, str):
                report.rejected += 1
                continue
            report.sampled += 1
            _check(reader, raw.cache_key, raw.data, entry, report, host, quarantine_ttl)
    if report.sampled and not read_only:
        _count(reader, host, toolchain, {"sentinel_checked": report.sampled})
    report.seconds = time.perf_counter() - started
    return report


def _check(reader: Store, key: str, data: bytes, entry: Entry, report: SentinelReport, host: str, ttl: float) -> None:
    problem = _recompile_problem(key, entry)
    if problem is None:
        report.matched += 1
        return
    if not problem.startswith(MISMATCH_PREFIXES):
        report.failed.append({"key": key, "reason": problem})
        return
    report.quarantined.append({"key": key, "writer": entry.writer, "toolchain": entry.toolchain, "reason": problem})
    if report.read_only:
        return
    quarantine(reader, key, data, entry, ttl)
    _count(reader, host, entry.toolchain, {"quarantined": 1, f"quarantined_writer:{entry.writer or 'none'}": 1})


def quarantine(reader: Reader, key: str, data: bytes, entry: Entry, ttl: float) -> None:
    """Move an entry's bytes to its toolchain's quarantine scope (first, so it is never lost), then delete it
    where clients read it."""
    quarantined = partition(split_partition(reader.partition)[0], QUARANTINE_SCOPE)
    reader.in_partition(quarantined).put_entries([WriteItem(key, data, None, ttl)])
    reader.delete_entries([key])


def _count(reader: Store, host: str, toolchain: str, totals: dict[str, float]) -> None:
    """Sentinel counts into the fleet metrics, summed per toolchain too (`report`, Prometheus)."""
    batch = MetricsBatch(uuid.uuid4().hex, host or "sentinel", "sentinel", dict(totals), toolchain=toolchain)
    reader.apply_metrics(batch)
