"""The fleet report: what every pass on every machine told the tier, read back and summed.

Totals and the per-worker counters are the fleet metrics' sums (`cachestore.client` applies one batch
per pass, exactly once). The two hit rates (bridge.port) are computed from summed counts, never averaged from
rates: the shared cache's, remote_hits / tier_lookups, and the in-pass one, cache_hits / kernels.
Per kernel name, `call_count` and `variants` are what the specification's
`_export_new_nki_fe_metrics` records, fleet-wide. The top variants carry their operand and result shapes
from the stored entries, like the specification's statistics report. The timeline buckets the pass log.

Memory: the per-key usage is streamed and only the top N kept; the timeline holds one row per bucket.
"""

from __future__ import annotations

import heapq
import math
import re
import time
from datetime import datetime
from typing import Any

import msgspec

from bridge.miss_causes import MISS_CAUSES
from bridge.port import SECONDS_COUNTERS, hit_rates
from cachestore.api import TOTAL_COUNTERS, Reader
from cachestore.keys import split_partition

TIMELINE_COUNTERS = ("passes", "kernels", "cache_hits", "cache_misses", "tier_lookups", "remote_hits", "traces")
# Bucket widths the timeline chooses from: the smallest giving at most MAX_BUCKETS buckets.
BUCKET_WIDTHS = (60, 300, 900, 3600, 6 * 3600, 86400, 7 * 86400, 30 * 86400)
MAX_BUCKETS = 48
TOP_VARIANTS = 10
# Every total counter, and the two hit rates (None: nothing asked), as `counters` makes them.
Counters = dict[str, float | None]


def counters(values: dict[str, float]) -> Counters:
    """Every total counter (0 when absent), integers as int, seconds as float, and the two hit rates (the
    shared cache's None when nothing asked the tier)."""
    out: dict[str, float] = {}
    for name in TOTAL_COUNTERS:
        value = _number(values.get(name, 0))
        out[name] = round(value, 6) if name in SECONDS_COUNTERS else round(value)
    return out | hit_rates(out)


class Variant(msgspec.Struct):
    key: str
    kernel_name: str
    usage: int
    first_use: float | None = None
    last_use: float | None = None
    hosts: list[str] = msgspec.field(default_factory=list)
    operand_shapes: list | None = None  # None when the entry is no longer stored
    operand_dtypes: list | None = None
    result_shapes: list | None = None
    result_dtypes: list | None = None
    attrs: dict | None = None
    target: str | None = None


class Bucket(msgspec.Struct):
    start: float
    end: float
    counts: dict[str, float] = msgspec.field(default_factory=lambda: dict.fromkeys(TIMELINE_COUNTERS, 0))
    # tier misses by cause
    misses: dict[str, float] = msgspec.field(default_factory=lambda: dict.fromkeys(MISS_CAUSES, 0))

    def as_json(self) -> dict:
        return {
            "start": self.start,
            "end": self.end,
            **self.counts,
            **hit_rates(self.counts),
            "misses": {cause: round(count) for cause, count in self.misses.items()},
        }


class Coverage(msgspec.Struct):
    """How warm one toolchain is for another's workload: of the variants the other holds, how many this one
    holds too, counted and weighted by their fleet usage (an upgrade's operators switch traffic when the
    new compiler covers nearly all of the old one's usage)."""

    variants: int  # the other toolchain's stored variants
    covered_variants: int  # of those, the ones this toolchain holds as well
    usage: int  # their summed fleet usage
    covered_usage: int
    share: float  # covered_usage / usage, or covered_variants / variants when none has any usage yet


class FleetReport(msgspec.Struct):
    tier: str
    generated: float
    since: float | None
    totals: Counters
    per_host: dict[str, dict]  # host -> {"totals": {...}, "workers": {worker: {...}}}
    per_toolchain: dict[str, Counters]  # toolchain id -> its totals (as `totals`)
    per_kernel: dict[str, dict[str, int]]  # kernel name -> {"call_count", "variants"}
    variants: int  # distinct cache keys the fleet used (the statistics report's "unique cached variants")
    top_variants: list[Variant] = msgspec.field(default_factory=list)
    bucket_seconds: int = 0
    timeline: list[Bucket] = msgspec.field(default_factory=list)
    window: Counters = msgspec.field(default_factory=dict)  # the pass log summed over the timeline's span
    # {toolchain: {other toolchain: Coverage}}: how much of each other toolchain's stored variants (weighted
    # by fleet usage) this one holds too. Empty when the tier holds one toolchain's entries (or none).
    coverage: dict[str, dict[str, Coverage]] = msgspec.field(default_factory=dict)
    # `report --zero` records in the pass log: {when, host, worker}
    zeroed: list[dict] = msgspec.field(default_factory=list)
    # {kernel: {cause: tier misses}} over the timeline's passes (the pass log keeps each pass's, by kernel).
    kernel_misses: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)
    # `trust_summary`: per writer, and the sentinel's counts
    trust: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def misses(self) -> dict[str, int]:
        """The fleet's tier misses by cause (every pass, from the totals)."""
        return {cause: int(self.totals.get(f"misses_{cause}") or 0) for cause in MISS_CAUSES}

    def as_json(self) -> dict[str, Any]:
        return {
            "tier": self.tier,
            "generated": self.generated,
            "since": self.since,
            "totals": self.totals,
            "per_host": self.per_host,
            "per_toolchain": self.per_toolchain,
            "per_kernel": self.per_kernel,
            "variants": self.variants,
            "kernel_types": len(self.per_kernel),
            "top_variants": [msgspec.structs.asdict(v) for v in self.top_variants],
            "bucket_seconds": self.bucket_seconds,
            "timeline": [b.as_json() for b in self.timeline],
            "window": self.window,
            "coverage": {
                tc: {other: msgspec.structs.asdict(c) for other, c in of.items()} for tc, of in self.coverage.items()
            },
            "zeroed": self.zeroed,
            "misses": self.misses,
            "kernel_misses": self.kernel_misses,
            "trust": self.trust,
        }


def build_report(
    reader: Reader,
    *,
    since: float | None = None,
    top: int = TOP_VARIANTS,
    bucket_seconds: int | None = None,
    timeline: bool = True,
    coverage: bool = True,
    now: float | None = None,
) -> FleetReport:
    """Read the fleet metrics (and, for the top variants, their entries) into a report. `coverage` scans the
    entry keys (no values) when the metrics know more than one toolchain (`nkicache warm` names its own);
    a Prometheus scrape leaves it out to stay cheap at any cache size."""
    raw_totals, raw_toolchains = reader.totals(), reader.toolchains()
    report = FleetReport(
        tier=reader.description,
        generated=time.time() if now is None else now,
        since=since,
        totals=counters(raw_totals),
        per_host=per_host(reader),
        per_toolchain={toolchain: counters(values) for toolchain, values in sorted(raw_toolchains.items())},
        trust=trust_summary(raw_totals, raw_toolchains),
        per_kernel=dict(sorted(reader.kernels().items(), key=lambda kv: (-kv[1]["call_count"], kv[0]))),
        variants=reader.key_count(),
    )
    if coverage and len(report.per_toolchain) > 1:  # else no upgrade is under way: spare the scan of every key
        report.coverage = toolchain_coverage(reader)
    if top > 0:
        report.top_variants = top_variants(reader, top)
    if timeline:
        report.bucket_seconds, report.timeline, report.window = pass_timeline(
            reader, since, bucket_seconds, report.zeroed, report.kernel_misses
        )
    return report


# Per-writer fields of the fleet totals, NAME:KEYID: entries a writer's passes stored, entries readers were served
# (cachestore.client), and entries of its that the sentinel quarantined (workers.sentinel).
WRITER_COUNTERS = {"writer_stored": "stored", "writer_served": "served", "quarantined_writer": "quarantined"}


def trust_summary(totals: dict[str, float], toolchains: dict[str, dict[str, float]]) -> dict[str, Any]:
    """{writers: {key id: {stored, served, quarantined}}, sentinel_checked, quarantined, quarantined_by_toolchain}
    from the raw totals the report reads anyway: no extra round trip."""
    writers: dict[str, dict[str, int]] = {}
    for name, value in totals.items():
        kind, _, writer = name.partition(":")
        if kind in WRITER_COUNTERS and writer:
            row = writers.setdefault(writer, dict.fromkeys(WRITER_COUNTERS.values(), 0))
            row[WRITER_COUNTERS[kind]] += round(_number(value))
    by_toolchain = {
        tc: round(_number(values["quarantined"]))
        for tc, values in sorted(toolchains.items())
        if values.get("quarantined")
    }
    return {
        "writers": dict(sorted(writers.items())),
        "sentinel_checked": round(_number(totals.get("sentinel_checked", 0))),
        "quarantined": round(_number(totals.get("quarantined", 0))),
        "quarantined_by_toolchain": by_toolchain,
    }


def per_host(reader: Reader) -> dict[str, dict]:
    hosts: dict[str, dict] = {}
    for host, worker, values in reader.workers():
        hosts.setdefault(host, {"workers": {}})["workers"][worker] = counters(values)
    for info in hosts.values():
        summed: dict[str, float] = {}
        for values in info["workers"].values():
            for name in TOTAL_COUNTERS:
                summed[name] = summed.get(name, 0) + values[name]
        info["totals"] = counters(summed)
        info["workers"] = dict(sorted(info["workers"].items()))
    return {host: {"totals": info["totals"], "workers": info["workers"]} for host, info in sorted(hosts.items())}


def top_variants(reader: Reader, top: int) -> list[Variant]:
    """The `top` most used cache keys, with their shapes from the stored entries."""
    from cachestore.inspect import LOOKING, components_problem, decode_or_reason, describe_components

    best = heapq.nlargest(top, reader.key_usage(), key=lambda item: (item[1], item[0]))
    keys = [key for key, _ in best]
    records = reader.key_records(keys)
    hosts = reader.key_hosts(keys)
    entries = reader.get_entries(keys)
    variants = []
    for key, usage in best:
        record = records.get(key)
        variant = Variant(
            key,
            record.kernel_name if record else "",
            usage,
            record.first_use if record else None,
            record.last_use if record else None,
            hosts.get(key, []),
        )
        entry = decode_or_reason(entries[key], LOOKING) if key in entries else None
        # An entry that cannot be read, or whose components are malformed, shows as one that is not stored.
        if entry is not None and not isinstance(entry, str) and components_problem(entry.key_components) is None:
            info = describe_components(entry.key_components)
            variant.kernel_name = variant.kernel_name or info["kernel_name"]
            for name in ("operand_shapes", "operand_dtypes", "result_shapes", "result_dtypes", "attrs", "target"):
                setattr(variant, name, info[name])
        variants.append(variant)
    return variants


def toolchain_coverage(reader: Reader) -> dict[str, dict[str, Coverage]]:
    """Every toolchain's coverage of every other one's stored variants (one scan of the entry keys; the usage
    is read only when more than one toolchain holds entries, which is when an upgrade is under way)."""
    held: dict[str, set[str]] = {}
    for partition, cache_key in reader.entry_keys():
        toolchain, scope = split_partition(partition)
        if not scope:  # the trusted scopes: what the fleet is served
            held.setdefault(toolchain, set()).add(cache_key)
    if len(held) < 2:
        return {}
    every_key = set().union(*held.values())
    usage = {key: count for key, count in reader.key_usage() if key in every_key}
    coverage: dict[str, dict[str, Coverage]] = {}
    for toolchain, keys in sorted(held.items()):
        for other, other_keys in sorted(held.items()):
            if other != toolchain:
                coverage.setdefault(toolchain, {})[other] = _coverage(keys, other_keys, usage)
    return coverage


def _coverage(keys: set[str], other_keys: set[str], usage: dict[str, int]) -> Coverage:
    covered = keys & other_keys
    total_usage = sum(usage.get(key, 0) for key in other_keys)
    covered_usage = sum(usage.get(key, 0) for key in covered)
    share = covered_usage / total_usage if total_usage else len(covered) / len(other_keys)
    return Coverage(len(other_keys), len(covered), total_usage, covered_usage, round(share, 6))


def choose_bucket(span: float) -> int:
    for width in BUCKET_WIDTHS:
        if span / width < MAX_BUCKETS:
            return width
    return BUCKET_WIDTHS[-1]


ZEROED_EVENT = "zeroed"  # the pass-log record `report --zero` leaves: {"event": "zeroed", "finished", "host", ...}


def zero_record(host: str, worker: str, previous: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """What the pass log keeps of a `report --zero`: when, by whom, and the counters it zeroed."""
    return {
        "event": ZEROED_EVENT,
        "finished": time.time() if now is None else now,
        "host": host,
        "worker": worker,
        "previous": previous,
    }


def pass_timeline(
    reader: Reader,
    since: float | None,
    bucket_seconds: int | None = None,
    zeroed: list[dict] | None = None,
    kernel_misses: dict[str, dict[str, int]] | None = None,
) -> tuple[int, list[Bucket], Counters]:
    """(bucket width, buckets from the first to the last pass, the window's summed counts): passes are
    placed by when they finished; empty buckets are kept, so the time axis is even. The `report --zero`
    records found on the way are appended to `zeroed` (they count nothing), and each pass's tier misses by
    kernel and cause are added to `kernel_misses`."""
    span = reader.pass_log_span(since)
    if span is None:
        return bucket_seconds or 0, [], counters({})
    first, last = span
    if since is not None:  # the log is ordered by when passes were recorded; a record can tell an older time
        first = max(first, since)
        last = max(last, first)
    width = bucket_seconds or choose_bucket(last - first)
    origin = (first // width) * width
    count = min(int((last - origin) // width) + 1, 100_000)
    buckets = [Bucket(origin + i * width, origin + (i + 1) * width) for i in range(count)]
    window: dict[str, float] = {}
    for when, record in reader.pass_log(since):
        if since is not None and when < since:
            continue
        if record.get("event") == ZEROED_EVENT:
            if zeroed is not None:
                zeroed.append(
                    {"when": when, "host": str(record.get("host", "")), "worker": str(record.get("worker", ""))}
                )
            continue
        index = min(max(int((when - origin) // width), 0), count - 1)
        for name in TIMELINE_COUNTERS:
            buckets[index].counts[name] += _number(record.get(name))
        for cause in MISS_CAUSES:
            buckets[index].misses[cause] += _number(record.get(f"misses_{cause}"))
        if kernel_misses is not None:
            _add_kernel_misses(kernel_misses, record.get("kernel_misses"))
        for name in TOTAL_COUNTERS:
            window[name] = window.get(name, 0) + _number(record.get(name))
    return width, buckets, counters(window)


def _add_kernel_misses(into: dict[str, dict[str, int]], recorded: Any) -> None:
    """Add one pass-log record's {kernel: {cause: count}}, skipping anything else (a hand-written record)."""
    if not isinstance(recorded, dict):
        return
    for kernel, causes in recorded.items():
        if isinstance(kernel, str) and isinstance(causes, dict):
            for cause, count in causes.items():
                if cause in MISS_CAUSES:
                    mine = into.setdefault(kernel, {})
                    mine[cause] = mine.get(cause, 0) + int(_number(count))


def _number(value: Any) -> float:
    """A stored count as a float; anything else, NaN and infinities included, counts as 0. Batches are checked
    before they are applied, but a tier written before that (or by hand) may hold them, and one would make
    every sum it enters, and the report's JSON, invalid."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) else 0.0


# -- times and sizes on the command line --------------------------------------------------------------
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZES = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_duration(text: str) -> float:
    """'90' (seconds), '90s', '30m', '12h', '7d', '2w' -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text.lower())
    if not match:
        raise ValueError(f"{text!r} is not a duration (like 90s, 30m, 12h, 7d)")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if not math.isfinite(seconds):  # 400 digits read as infinity, which no bucket width or cutoff can be
        raise ValueError(f"{text!r} is too long a duration")
    return seconds


def parse_since(text: str, now: float | None = None) -> float:
    """A point in time: a duration ago ('2h', '7d'), Unix seconds, or an ISO 8601 date/time (local time
    unless it names a zone)."""
    now = time.time() if now is None else now
    stripped = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?[smhdw]", stripped.lower()):
        when = now - parse_duration(stripped)
    elif re.fullmatch(r"\d{9,}(\.\d+)?", stripped):
        when = float(stripped)
    else:
        try:
            return datetime.fromisoformat(stripped).timestamp()
        except (ValueError, OverflowError, OSError):
            raise ValueError(f"{text!r} is not a time: use 2h / 7d (ago), Unix seconds, or 2024-05-01T12:00") from None
    try:
        datetime.fromtimestamp(when)  # the report prints it as a date: one this platform can show
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"{text!r} is out of the range of dates") from None
    return when


def parse_size(text: str) -> int:
    """'1000', '512k', '64MiB', '2G' -> bytes (k/M/G are powers of 1000, KiB/MiB/GiB of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", text.lower())
    if not match or match.group(2) not in _SIZES:
        raise ValueError(f"{text!r} is not a size (like 500M, 64MiB, 2G)")
    size = float(match.group(1)) * _SIZES[match.group(2)]
    if not math.isfinite(size):  # 400 digits read as infinity, which is no number of bytes
        raise ValueError(f"{text!r} is too large a size")
    return int(size)
