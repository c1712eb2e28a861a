"""Offline inspection of a tier (or a snapshot of one): what is in it, why did a kernel miss, how big is
it, and cleaning it up. Read-only except `import_snapshot` and `collect_garbage`, which write entries and
never touch the fleet metrics. Nothing here needs the compiler; verification that recompiles or executes
entries is `workers.verify`.

Every function streams the entries in batches (`cachestore.api.Reader`); what it keeps across batches is
small and said in its docstring.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec

from bridge.errors import NkiCacheError
from bridge.graph import nesting
from bridge.ir import freeze_key_components
from cachestore.api import RawEntry, Reader, WriteItem, batched
from cachestore.entry import (
    FAILED,
    MAX_ENTRY_BYTES,
    Entry,
    EntryRejected,
    SignaturePolicy,
    TooLarge,
    binary_digest,
    decode_entry,
    is_signed,
    writer_of,
)
from cachestore.keys import split_partition
from cachestore.scan_split import scan_split
from cachestore.value import entry_value

# For looking (ls, show, du, explain): decode and check the digest, never reject on signatures;
# `verify` is where the configured policy is applied.
LOOKING = SignaturePolicy(hmac_key=None, require_signed=False, reject_unverifiable=False)


class InspectError(NkiCacheError):
    """An inspection request cannot be answered (unknown key, bad components, ...)."""


# -- key components ---------------------------------------------------------------------------------
# The key rule is the codegen loop's own (bridge.codegen), which this package does not import: functions
# that check an entry against its key take the loop's key function, `KeyOf`, from their caller.
KeyOf = Callable[[Mapping[str, Any]], str]


def key_problem(cache_key: str, entry: Entry, key_of: KeyOf) -> str | None:
    """Why `entry` does not belong under `cache_key` (its key components hash elsewhere), or None."""
    try:
        actual = key_of(entry.key_components)
    except (TypeError, ValueError, KeyError, AttributeError):
        return "key components are malformed"
    if actual != cache_key:
        return f"key components hash to {actual[:16]}..., not to the key the entry is stored under"
    return None


def _json_value(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return repr(value)  # msgpack's only type JSON has not: a stored entry's components may hold anything
    return value


MAX_COMPONENTS_NESTING = 32  # levels of maps and lists; the loop's components need about 5


def components_problem(components: Mapping[str, Any]) -> str | None:
    """Why stored key components do not have the shape the codegen loop gives them, or None. An entry's
    digest and signature say it is intact, not that its components are well formed (any msgpack map
    decodes): listings, reports and explain read these fields, and must not fail on one bad entry."""
    if nesting(components, MAX_COMPONENTS_NESTING) > MAX_COMPONENTS_NESTING:
        return f"nested deeper than {MAX_COMPONENTS_NESTING} levels"
    for name in ("kernel_name", "target"):
        if not isinstance(components.get(name, ""), str):
            return f"{name} is {type(components[name]).__name__}, not a string"
    cores = components.get("num_neuroncores")
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int)):
        return f"num_neuroncores is {type(cores).__name__}, not an integer"
    for name in ("operands", "results"):
        part = components.get(name) or {}
        if not isinstance(part, Mapping):
            return f"{name} is {type(part).__name__}, not a map"
        for field, items in part.items():
            if not isinstance(items, list | tuple):
                return f"{name}.{field} is {type(items).__name__}, not a list"
        shapes, dtypes = part.get("shapes", []), part.get("dtypes", [])
        if not all(isinstance(shape, list | tuple) and all(_is_int(d) for d in shape) for shape in shapes):
            return f"{name}.shapes is not a list of shapes (lists of integers)"
        if not all(isinstance(dtype, str) for dtype in dtypes):
            return f"{name}.dtypes is not a list of strings"
    if not isinstance(components.get("attrs") or {}, Mapping):
        return f"attrs is {type(components['attrs']).__name__}, not a map"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def describe_components(components: Mapping[str, Any]) -> dict[str, Any]:
    """The fields reports and listings show, JSON-ready; InspectError when the components are malformed
    (`components_problem`)."""
    problem = components_problem(components)
    if problem is not None:
        raise InspectError(f"key components are malformed: {problem}")
    operands = components.get("operands") or {}
    results = components.get("results") or {}
    return {
        "kernel_name": components.get("kernel_name", ""),
        "target": components.get("target", ""),
        "num_neuroncores": components.get("num_neuroncores"),
        "operand_shapes": _json_value(operands.get("shapes", [])),
        "operand_dtypes": _json_value(operands.get("dtypes", [])),
        "result_shapes": _json_value(results.get("shapes", [])),
        "result_dtypes": _json_value(results.get("dtypes", [])),
        "attrs": _json_value(components.get("attrs", {})),
    }


def decode_or_reason(
    data: bytes | TooLarge,
    policy: SignaturePolicy = LOOKING,
    max_bytes: int = MAX_ENTRY_BYTES,
    cache_key: str | None = None,
) -> Entry | str:
    """The entry, or the reason it cannot be read (a store's TooLarge: its size). `cache_key`, the key it is
    stored under, lets a policy with a trust policy check its writer's signature."""
    try:
        return decode_entry(data, policy, max_bytes, cache_key)
    except EntryRejected as exc:
        return exc.reason


def _has_signature(data: bytes | TooLarge) -> bool:
    if isinstance(data, TooLarge):
        return False  # not read: its size is the problem shown
    return is_signed(data)  # the header alone: `show` of a hostile entry costs what decoding it does


def toolchain_problem(raw: RawEntry, entry: Entry) -> str | None:
    """Why `entry` does not belong in the partition it is stored in (another toolchain's, in any scope), or
    None."""
    if entry.toolchain != split_partition(raw.partition)[0]:
        return f"traced by toolchain {entry.toolchain!r} but stored in toolchain {raw.partition}'s partition"
    return None


def binary_problem(entry: Entry) -> str | None:
    """Why the binary of an entry is not the one its digest names, or None. A hit trusts the digest over the
    stored bytes and never hashes the binary; verify does."""
    if binary_digest(entry.binary) != entry.digest:
        return "binary does not match its digest"
    return None


def partition_readers(reader: Reader) -> Iterator[Reader]:
    """The reader in each partition that holds entries (every toolchain's, in every scope)."""
    for partition in reader.entry_partitions():
        yield reader.in_partition(partition)


# -- ls ---------------------------------------------------------------------------------------------
def list_entries(
    reader: Reader, kernel: str | None = None, target: str | None = None, failed: bool = False
) -> Iterator[dict]:
    """One row per entry of every partition (streamed), with what the metrics know about its use. An entry
    that cannot be decoded is listed with its `error` unless a filter is given. `failed`: only the negative
    entries (kernels that failed to compile), each with its `failure`."""
    for store in partition_readers(reader):
        rows = _list_partition(store, kernel, target)
        yield from (row for row in rows if row.get("failure") is not None) if failed else rows


def _list_partition(reader: Reader, kernel: str | None, target: str | None) -> Iterator[dict]:
    for batch in batched(reader.scan_entries()):
        usage = reader.key_records([raw.cache_key for raw in batch])
        for raw in batch:
            entry = decode_or_reason(raw.data)
            error = entry if isinstance(entry, str) else None
            if not isinstance(entry, str):
                try:
                    info = describe_components(entry.key_components)
                except InspectError as exc:  # listed with its error like an entry that cannot be decoded
                    error = str(exc)
            if isinstance(entry, str) or error is not None:
                if kernel is None and target is None:
                    yield {
                        "key": raw.cache_key,
                        "toolchain": raw.partition,
                        "kernel_name": None,
                        "bytes": len(raw.data),
                        "writer": writer_of(raw.data),
                        "error": error,
                    }
                continue
            if kernel not in (None, info["kernel_name"]) or target not in (None, info["target"]):
                continue
            record = usage.get(raw.cache_key)
            yield {
                "key": raw.cache_key,
                "toolchain": raw.partition,
                **info,
                "format": entry.format,
                "bytes": len(raw.data),
                "binary_bytes": len(entry.binary),
                "usage": record.usage if record else 0,
                "last_use": record.last_use if record else None,
                "producer": f"{entry.producer_host}:{entry.producer_worker}",
                "writer": writer_of(raw.data),  # the key id its header names (checked by verify, not here)
                "created": entry.created,
                "ttl": raw.ttl,
                "failure": entry.binary.decode(errors="replace") if entry.format == FAILED else None,
                "error": None,
            }


# -- show -------------------------------------------------------------------------------------------
def resolve_key(reader: Reader, key_or_prefix: str) -> str:
    """The one cache key that is, or starts with, `key_or_prefix`."""
    prefix = key_or_prefix.strip().lower()
    if not prefix or any(c not in "0123456789abcdef" for c in prefix):
        raise InspectError(f"{key_or_prefix!r} is not a cache key (hex SHA-256) or a prefix of one")
    where = f"{reader.description} (toolchain {reader.partition})"
    if len(prefix) == 64:
        if reader.get_entries([prefix]):
            return prefix
        raise InspectError(f"no entry {prefix} in {where}{_elsewhere(reader, prefix)}")
    found = reader.find_keys(prefix, limit=5)
    if not found:
        raise InspectError(f"no entry starts with {prefix} in {where}{_elsewhere(reader, prefix)}")
    if len(found) > 1:
        raise InspectError(f"{prefix} is ambiguous: {', '.join(k[:16] + '...' for k in found)}")
    return found[0]


def _elsewhere(reader: Reader, prefix: str) -> str:
    others = [
        store.partition
        for store in partition_readers(reader)
        if store.partition != reader.partition and store.find_keys(prefix, 1)
    ]
    return f"; toolchain {', '.join(others)} {'has' if len(others) == 1 else 'have'} it (--toolchain)" if others else ""


def show_entry(reader: Reader, key_or_prefix: str, policy: SignaturePolicy) -> dict:
    """Everything about one entry: key components, sizes, producer, usage, hosts, first and last use."""
    cache_key = resolve_key(reader, key_or_prefix)
    data = reader.get_entries([cache_key]).get(cache_key)
    if data is None:
        raise InspectError(f"entry {cache_key} disappeared while reading it")
    verified = decode_or_reason(data, policy, cache_key=cache_key)
    entry = decode_or_reason(data)
    record = reader.key_records([cache_key]).get(cache_key)
    shown: dict[str, Any] = {
        "key": cache_key,
        "toolchain": reader.partition,
        "bytes": len(data),
        "signature": "present" if _has_signature(data) else "none",
        "writer": writer_of(data),
        "verified": not isinstance(verified, str),
        "problem": verified if isinstance(verified, str) else None,
        "usage": record.usage if record else 0,
        "first_use": record.first_use if record else None,
        "last_use": record.last_use if record else None,
        "hosts": reader.key_hosts([cache_key]).get(cache_key, []),
    }
    if isinstance(entry, str):
        return {**shown, "problem": entry}
    shown.update(
        key_components=_json_value(entry.key_components),
        format=entry.format,
        version_identifier=entry.version_identifier,
        input_names=entry.input_names,
        output_names=entry.output_names,
        binary_bytes=len(entry.binary),
        digest=entry.digest,
        producer_host=entry.producer_host,
        producer_worker=entry.producer_worker,
        created=entry.created,
        compile_seconds=entry.compile_seconds,
        traced_by=entry.toolchain,
    )
    if entry.toolchain != reader.partition:
        shown["problem"] = shown["problem"] or f"traced by toolchain {entry.toolchain!r}, stored in this one's"
    return shown


# -- du ---------------------------------------------------------------------------------------------
def disk_usage(reader: Reader, processes: int | None = None) -> dict:
    """Storage by kernel, by partition (under "toolchains") and by writer: entries, bytes stored and binary bytes
    held. The entries are read by up to `processes` processes (cachestore.scan_split; None: one a CPU), each
    counting its share (`_Usage`); the shares are summed here."""
    shares = scan_split(reader, lambda _: _Usage(), processes=processes, every_partition=True)
    return _usage_report(shares, reader.capacity())


class _Usage:
    """du's counts over the entries one process reads: what `_usage_report` sums."""

    def __init__(self) -> None:
        self.kernels: dict[str, Counter] = defaultdict(Counter)
        self.partitions: dict[str, Counter] = defaultdict(Counter)
        self.writers: dict[str, Counter] = defaultdict(Counter)  # key id ("" for no writer signature) -> counts
        self.unreadable: Counter = Counter()

    def add(self, batch: list[RawEntry]) -> None:
        for raw in batch:
            self._count(raw)

    def _count(self, raw: RawEntry) -> None:
        size = len(raw.data)
        partition = self.partitions[raw.partition]
        partition["entries"] += 1
        partition["bytes"] += size
        entry = decode_or_reason(raw.data)
        # A decoded entry names its writer (the header read once); one that cannot be decoded, by its header alone.
        writer = self.writers[writer_of(raw.data) if isinstance(entry, str) else entry.writer]
        writer["entries"] += 1
        writer["bytes"] += size
        if isinstance(entry, str):
            self.unreadable["entries"] += 1
            self.unreadable["bytes"] += size
            return
        row = self.kernels[str(entry.key_components.get("kernel_name", ""))]
        row["entries"] += 1
        row["bytes"] += size
        row["binary_bytes"] += len(entry.binary)

    def result(self) -> dict:
        """The counts as msgpack takes them (lists of pairs: names from entries need not be valid map keys)."""
        return {
            "kernels": [(name, dict(row)) for name, row in self.kernels.items()],
            "partitions": [(name, dict(row)) for name, row in self.partitions.items()],
            "writers": [(name, dict(row)) for name, row in self.writers.items()],
            "unreadable": dict(self.unreadable),
        }


def _summed(shares: list[dict], part: str) -> dict[str, Counter]:
    summed: dict[str, Counter] = defaultdict(Counter)
    for share in shares:
        for name, counts in share[part]:
            summed[name].update(counts)
    return summed


def _usage_report(shares: list[dict], capacity: dict | None) -> dict:
    kernels, partitions, writers = (_summed(shares, part) for part in ("kernels", "partitions", "writers"))
    unreadable = sum((Counter(share["unreadable"]) for share in shares), Counter())
    fields = ("entries", "bytes", "binary_bytes")
    rows = {name: {f: int(row[f]) for f in fields} for name, row in sorted(kernels.items())}
    total = {f: sum(row[f] for row in rows.values()) for f in fields}
    return {
        "kernels": rows,
        "toolchains": {name: {"entries": c["entries"], "bytes": c["bytes"]} for name, c in sorted(partitions.items())},
        "writers": {name: {"entries": c["entries"], "bytes": c["bytes"]} for name, c in sorted(writers.items())},
        "total": total,
        "unreadable": {"entries": unreadable["entries"], "bytes": unreadable["bytes"]},
        # The local tier's file against its max_size; None for a store without one (Redis, a snapshot).
        "capacity": capacity,
    }


# -- explain ----------------------------------------------------------------------------------------
WEIGHTS = {"kernel_name": 100, "target": 10, "num_neuroncores": 10}


def _flatten(components: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in components.items():
        if name in ("operands", "results", "attrs") and isinstance(value, Mapping):
            flat.update((f"{name}.{part}", _json_value(v)) for part, v in value.items())
        else:
            flat[name] = _json_value(value)
    return flat


def differences(wanted: Mapping[str, Any], existing: Mapping[str, Any]) -> list[dict]:
    a, b = _flatten(wanted), _flatten(existing)
    return [
        {"component": name, "wanted": a.get(name), "existing": b.get(name)}
        for name in sorted(set(a) | set(b))
        if a.get(name) != b.get(name)
    ]


def explain(reader: Reader, components: Mapping[str, Any], key_of: KeyOf, top: int = 5) -> dict:
    """Is this variant in the tier, and if not, the `top` nearest variants and the components that differ
    (a differing kernel name weighs 100, target or neuroncores 10, any other component 1). Keeps `top`."""
    wanted = freeze_key_components(components)
    cache_key = key_of(wanted)
    nearest: list[tuple[int, str, list[dict]]] = []  # a max-heap on distance, by negated values
    present = False
    for raw in reader.scan_entries(with_ttl=False):
        entry = decode_or_reason(raw.data)
        if isinstance(entry, str) or components_problem(entry.key_components):
            continue  # nothing to compare with: what cannot be read is not a variant a lookup could find
        if raw.cache_key == cache_key:
            present = True
        diff = differences(wanted, freeze_key_components(entry.key_components))
        distance = sum(WEIGHTS.get(d["component"], 1) for d in diff)
        item = (-distance, raw.cache_key, diff)
        if len(nearest) < top:
            heapq.heappush(nearest, item)
        elif item > nearest[0]:
            heapq.heapreplace(nearest, item)
    ranked = sorted(nearest, key=lambda item: (-item[0], item[1]))
    usage = reader.key_records([key for _, key, _ in ranked])
    return {
        "key": cache_key,
        "toolchain": reader.partition,
        "present": present,
        "components": _json_value(wanted),
        "nearest": [
            {"key": key, "distance": -neg, "usage": usage[key].usage if key in usage else 0, "differs": diff}
            for neg, key, diff in ranked
        ],
    }


# -- export / import --------------------------------------------------------------------------------
def import_snapshot(
    snapshot: Reader,
    tier: Reader,
    policy: SignaturePolicy,
    key_of: KeyOf,
    *,
    default_ttl: float,
    max_bytes: int = MAX_ENTRY_BYTES,
) -> dict:
    """Write a snapshot's entries into a tier, each into its partition and verified first
    (decoded with the policy, traced by that toolchain, key components hashing to its key), each with the time
    it had left (at most `default_ttl`). Metrics are not imported.
    Returns {imported, rejected: [{key, reason}]}."""
    result: dict = {"imported": 0, "rejected": []}
    for source in partition_readers(snapshot):
        _import_partition(source, tier.in_partition(source.partition), policy, key_of, default_ttl, max_bytes, result)
    return result


def _import_partition(
    snapshot: Reader,
    tier: Reader,
    policy: SignaturePolicy,
    key_of: KeyOf,
    default_ttl: float,
    max_bytes: int,
    result: dict,
) -> None:
    rejected: list[dict] = result["rejected"]

    def ttl_of(raw: RawEntry) -> float:
        # At most the tier's own entry TTL, the longest it keeps an unused entry: a snapshot's TTL is only as
        # trustworthy as the file, and Redis refuses an expiry beyond its range.
        return min(raw.ttl, default_ttl) if raw.ttl is not None and raw.ttl > 0 else default_ttl

    def problem_of(raw: RawEntry, entry: Entry) -> str | None:
        return toolchain_problem(raw, entry) or key_problem(raw.cache_key, entry, key_of)

    for batch in batched(snapshot.scan_entries()):
        items = []
        for raw in batch:
            entry = decode_or_reason(raw.data, policy, max_bytes, raw.cache_key)
            if isinstance(entry, str):
                rejected.append({"key": raw.cache_key, "reason": entry})
            elif problem := problem_of(raw, entry):
                rejected.append({"key": raw.cache_key, "reason": problem})
            else:
                items.append(WriteItem(raw.cache_key, raw.data, entry.digest, ttl_of(raw), entry.compile_seconds))
        tier.put_entries(items)
        result["imported"] += len(items)


# -- gc ---------------------------------------------------------------------------------------------
class _Candidate(msgspec.Struct):
    key: str
    bytes: int
    usage: int
    compile_seconds: float
    last_use: float
    reason: str | None = None  # why it is evicted
    partition: str = ""  # the partition it is stored in
    writer: str = ""  # the key id its header names ("" for none)

    @property
    def id(self) -> tuple[str, str]:
        return self.partition, self.key

    @property
    def value(self) -> float:
        """Compile seconds its reuse saves per stored byte (cachestore.value): keep the entries that save the most."""
        return entry_value(self.compile_seconds, self.usage, self.bytes)


def collect_garbage(
    reader: Reader,
    policy: SignaturePolicy,
    *,
    max_bytes: int | None = None,
    unused_for: float | None = None,
    dry_run: bool = False,
    now: float | None = None,
    only_toolchain: str | None = None,
    writer: str | None = None,
) -> dict:
    """Evict entries (never metrics), of every partition: unreadable entries always; with `only_toolchain`,
    every other toolchain's entries; with `unused_for`, entries not used for that many seconds; with
    `max_bytes`, the least valuable entries (lowest compile seconds saved per stored byte: usage x compile
    time / size) until the rest fits. With `writer` (a key id), every entry whose header names that writer, in
    every toolchain and scope (a compromised or distrusted writer's). Keeps one small record per entry."""
    now = time.time() if now is None else now
    candidates: dict[tuple[str, str], _Candidate] = {}
    for store in partition_readers(reader):
        for c in _candidates(store, policy):
            candidates[c.id] = c

    def evict(c: _Candidate, reason: str) -> None:
        if c.reason is None:
            c.reason = reason

    if writer is not None:
        for c in candidates.values():
            if c.writer == writer.lower():
                evict(c, f"writer {c.writer}")
    if only_toolchain is not None:
        for c in candidates.values():
            if split_partition(c.partition)[0] != only_toolchain:
                evict(c, "other toolchain")
    if unused_for is not None:
        cutoff = now - unused_for
        for c in candidates.values():
            if c.last_use < cutoff:
                evict(c, "unused")
    if max_bytes is not None:
        _evict_over_budget(candidates, max_bytes, evict)

    evicted = [c for c in candidates.values() if c.reason]
    if not dry_run:
        for partition in sorted({c.partition for c in evicted}):
            store = reader.in_partition(partition)
            for chunk in batched(c for c in evicted if c.partition == partition):
                store.delete_entries([c.key for c in chunk])
    expired = reader.expired_count() if reader.keeps_expired else (0, 0)
    if not dry_run and expired[0]:
        reader.purge_expired()
    reasons = Counter(c.reason for c in evicted)
    return {
        "dry_run": dry_run,
        "entries": len(candidates),
        "bytes": sum(c.bytes for c in candidates.values()),
        "evicted": len(evicted),
        "evicted_bytes": sum(c.bytes for c in evicted),
        "reasons": dict(sorted(reasons.items())),
        "kept": len(candidates) - len(evicted),
        "kept_bytes": sum(c.bytes for c in candidates.values() if not c.reason),
        "expired_purged": expired[0],
        "keys": sorted(c.key for c in evicted),
        # One item an entry, so that a dry run says which entries would go and why, not only how many.
        "evictions": [
            {"key": c.key, "toolchain": c.partition, "bytes": c.bytes, "reason": c.reason}
            for c in sorted(evicted, key=lambda c: (c.key, c.partition))
        ],
        "evicted_by_toolchain": dict(sorted(Counter(c.partition for c in evicted).items())),
    }


def _candidates(reader: Reader, policy: SignaturePolicy) -> Iterator[_Candidate]:
    """One partition's entries as gc candidates, with what the metrics know of their use."""
    for batch in batched(reader.scan_entries(with_ttl=False)):
        usage = reader.key_records([raw.cache_key for raw in batch])
        for raw in batch:
            entry = decode_or_reason(raw.data, policy, cache_key=raw.cache_key)
            record = usage.get(raw.cache_key)
            writer = writer_of(raw.data)
            if isinstance(entry, str):
                yield _Candidate(raw.cache_key, len(raw.data), 0, 0.0, 0.0, "unreadable", raw.partition, writer)
                continue
            last = max(record.last_use if record else 0.0, entry.created)
            yield _Candidate(
                raw.cache_key,
                len(raw.data),
                record.usage if record else 0,
                entry.compile_seconds,
                last,
                partition=raw.partition,
                writer=writer,
            )


def _evict_over_budget(candidates: dict[tuple[str, str], _Candidate], max_bytes: int, evict: Any) -> None:
    kept = sum(c.bytes for c in candidates.values() if not c.reason)
    order = sorted((c for c in candidates.values() if not c.reason), key=lambda c: (c.value, c.last_use, c.id))
    for c in order:
        if kept <= max_bytes:
            return
        evict(c, "over budget")
        kept -= c.bytes
