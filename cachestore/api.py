"""The storage contract, whole: what a tier backend does, what it raises, the data it moves, and the one
way every command opens one.

A backend moves encoded entries, leases and metrics batches. It raises `TierUnavailable` or `TierTimeout`
when the store cannot answer, and never decides whether an entry is trustworthy: that is
`cachestore.entry`'s job, done by the client (compile path) and by inspection (read path) alike. It does
bound what it reads, since others can write to the store: an entry larger than its `max_entry_bytes` (the
setting) is never downloaded, and is handed over as a `cachestore.entry.TooLarge` naming its size.

Two protocols, implemented by one class per backend (`cachestore/backends/`):

- `Backend`: the compile path, used by `cachestore.client.TierClient` (batched reads that refresh TTLs,
  deduplicating writes, single-flight leases, metrics batches applied exactly once);
- `Reader`: reports, inspection and administration (streamed scans of entries and fleet metrics, plain
  reads that never refresh a TTL, and the few writes `inspect import` and `inspect gc` make).

Optional abilities are declared as class attributes (`read_only`, `keeps_expired`, `splits_scans`), never
probed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

from bridge.errors import NkiCacheError
from bridge.port import PASS_COUNTERS
from cachestore.entry import TooLarge

if TYPE_CHECKING:
    from cachestore.settings import Settings

TOTAL_COUNTERS = PASS_COUNTERS  # what the fleet metrics sum, per fleet and per worker
BATCH = 500  # keys per pipeline / page when streaming
READ_TIMEOUT = 30.0  # seconds for one batch of a report or an inspection: they are not on the compile path
READ_CONNECT_TIMEOUT = 2.0
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
PATH_SCHEMES = ("local:", "dir:")  # a tier named by a path: local:PATH (an SQLite file), dir:PATH (a shared folder)
TIER_SCHEMES_TEXT = "off, local:PATH, dir:PATH, redis://, rediss://, unix:// or redis+cluster://"


# -- errors ---------------------------------------------------------------------------------------------
class TierError(NkiCacheError):
    """The tier could not do what was asked."""


class TierUnavailable(TierError):
    """The tier is down, unreachable, refusing, or out of memory."""


class BatchRefused(TierError):
    """The tier is up, but refused a metrics batch as invalid (`batch_problem`) and wrote nothing of it.
    Unlike the tier being down, sending the same batch again cannot succeed."""


class TierTimeout(TierError):
    """The tier did not answer within the operation timeout."""


class ConnectionsDropped(TierError):
    """A call failed because another call's operation timeout closed the connections it was using: not a fault
    of its own (that call counts the timeout), so it is retried like any write, without counting."""


class TierBusy(TierTimeout):
    """Another process held the store's lock for the whole wait (the embedded tier): contention between the
    processes of one machine, not an outage, so it never turns the tier off."""


# -- what moves through a backend ----------------------------------------------------------------------
@dataclass(frozen=True)
class StoreRequest:
    cache_key: str
    digest: str
    full: bytes  # the encoded entry holding the binary
    # The same entry encoded as a reference to the cache key (the argument) whose entry already holds this
    # digest: only the backend learns which key that is, and only the client can sign the encoding.
    reference: Callable[[str], bytes]
    kernel_name: str
    compile_seconds: float = 0.0  # what tracing it cost: the local tier ranks what it keeps by it
    ttl: int | None = None  # its own TTL (cachestore.value: grows with its value); None: the call's
    # Fields of the kernel's variant index (cachestore.variant_index) this store sets: how misses get a cause.
    index_fields: dict[bytes, bytes] = field(default_factory=dict)


@dataclass
class KeyUsage:
    kernel_name: str
    usage: int
    first_use: float
    last_use: float


@dataclass
class MetricsBatch:
    """Counts from one pass (or part of one), applied to the fleet metrics exactly once by `batch_id`."""

    batch_id: str
    host: str
    worker: str
    totals: dict[str, float] = field(default_factory=dict)
    kernel_calls: dict[str, int] = field(default_factory=dict)
    keys: dict[str, KeyUsage] = field(default_factory=dict)
    pass_record: dict[str, object] | None = None  # appended to the pass log when the pass ends
    # The id of the compiler that ran the pass (bridge.identity): its totals are also summed per toolchain.
    # Empty: a batch that names none, counted in the fleet's and the worker's totals only.
    toolchain: str = ""


# Counts and times a batch may carry: a double holds every integer up to 2**53 exactly, and sums of numbers
# this size cannot overflow to infinity (which Redis's HINCRBYFLOAT refuses half-way through a script).
MAX_BATCH_NUMBER = 2**53


def batch_problem(batch: MetricsBatch) -> str | None:
    """Why no tier may apply `batch`, or None. Every number must be finite and at most MAX_BATCH_NUMBER in
    size, and the ones summed with integer arithmetic (kernel calls, key usage) whole: one NaN would poison
    the fleet totals for good, and a backend that took it half-way could not apply the batch wholly or not
    at all. The Redis metrics script checks the same before it writes anything."""
    for name in ("batch_id", "host", "worker", "toolchain"):
        if not isinstance(getattr(batch, name), str):
            return f"{name} is {getattr(batch, name)!r}, not a string"
    for name in ("totals", "kernel_calls", "keys"):
        mapping = getattr(batch, name)
        if not isinstance(mapping, dict) or not all(isinstance(key, str) for key in mapping):
            return f"{name} is {mapping!r}, not a dict with string keys"
    # Checked in the compiling thread at every pass's end: where a number is, is spelled out only for a bad one.
    for name, value in batch.totals.items():
        if problem := number_problem(value):
            return f"totals[{name!r}] is {value!r}: {problem}"
    for name, value in batch.kernel_calls.items():
        if problem := number_problem(value, whole=True):
            return f"kernel_calls[{name!r}] is {value!r}: {problem}"
    for key, usage in batch.keys.items():
        if not isinstance(usage, KeyUsage) or not isinstance(usage.kernel_name, str):
            return f"keys[{key!r}] is {usage!r}, not a KeyUsage naming its kernel"
        for part, value, whole in (("usage", usage.usage, True), ("first_use", usage.first_use, False),
                                    ("last_use", usage.last_use, False)):  # fmt: skip
            if problem := number_problem(value, whole=whole):
                return f"keys[{key!r}].{part} is {value!r}: {problem}"
    if batch.pass_record is not None:
        if not isinstance(batch.pass_record, dict):
            return f"pass_record is {batch.pass_record!r}, not a dict"
        try:  # stored as JSON text, which has no NaN or infinity (json.dumps would write them all the same)
            json.dumps(batch.pass_record, allow_nan=False)
        except (TypeError, ValueError) as exc:
            return f"pass_record is not JSON of finite numbers: {exc}"
    return None


def number_problem(value: object, *, whole: bool = False) -> str | None:
    """Why `value` is no number a batch may carry, or None. A bool is not one: JSON tells them apart, and the
    Redis script would refuse it."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "not a number"
    if isinstance(value, float) and not math.isfinite(value):
        return "not finite"
    if abs(value) > MAX_BATCH_NUMBER:
        return f"larger than {MAX_BATCH_NUMBER}"
    if whole and value != int(value):
        return "not a whole number"
    return None


def stored_number(value: object) -> float:
    """A number of the fleet metrics as a tier gives it back (bytes or text from Redis, any value SQLite
    holds) as a finite float; anything else, a word, NaN and the infinities included, counts as 0. Batches are
    checked before they are applied, but a tier written by an older build or by hand may hold such a value,
    and one must not fail every report of the fleet, nor every scrape of serve-metrics."""
    if isinstance(value, bytes | str):
        try:
            value = float(value)
        except ValueError:
            return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value) if math.isfinite(value) else 0.0


CLOCK_SKEW_SECONDS = 86400.0  # how far ahead of the tier's clock a host's clock may run, generously


def pass_time(finished: object, appended: float) -> float:
    """When a pass-log record's pass ended: its `finished` when that is a time the pass can have ended at (a
    finite number from 1970 on, not after the record was appended, give or take a day of clock skew between
    hosts), else `appended`, when the tier appended the record. A NaN would misplace the whole timeline, and
    a time centuries away would stretch it past any date the report can print."""
    usable = isinstance(finished, int | float) and not isinstance(finished, bool) and math.isfinite(finished)
    if usable and 0 <= finished <= appended + CLOCK_SKEW_SECONDS:
        return float(finished)
    return appended


@dataclass
class RawEntry:
    """An entry as stored, still encoded."""

    cache_key: str
    data: bytes | TooLarge  # TooLarge: larger than the reader's max_entry_bytes, so not read
    ttl: float | None  # seconds left, None when the store keeps no expiry
    toolchain: str = ""  # the partition it is stored in (bridge.identity)


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
    """An encoded entry for `Reader.put_entries`, written in the reader's toolchain partition."""

    cache_key: str
    data: bytes
    digest: str | None  # set for an entry holding its binary: the digest index points at it
    ttl: float
    compile_seconds: float = 0.0  # from the entry: the local tier ranks what it keeps by it


# -- the protocols ----------------------------------------------------------------------------------------
class Backend(Protocol):
    """The compile path, in one toolchain's partition (`toolchain`): entries, leases and the digest index of
    another compiler are never read, replaced or deduplicated against."""

    description: str
    toolchain: str

    def fetch(self, cache_keys: Sequence[str], ttl: int | None) -> dict[str, bytes | TooLarge]:
        """Encoded entries for the keys that have one (refreshing their TTL to `ttl`; None: reading only, as a
        read-only client does, which may not write); references are not followed. An
        entry over the backend's max_entry_bytes is not read: its TooLarge stands for it. On the compile path,
        so the call as a whole returns or raises TierTimeout within the operation timeout."""

    def store(self, requests: Sequence[StoreRequest], ttl: int) -> None:
        """Write entries; a binary already stored under another key is written as a reference to it."""

    def apply_metrics(self, batch: MetricsBatch) -> bool:
        """Apply a batch unless one with its id was applied already; True when applied now."""

    def read_variant_index(self, queries: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[bytes | None] | None]:
        """The values of each (kernel name, fields) in the variant index (cachestore.variant_index), None for a
        field not set, and None for a query the store could not answer (another type of key under the kernel's
        name); in one round trip, bounded by the operation timeout like fetch."""

    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        """On the compile path, like fetch: bounded as a whole by the operation timeout."""

    def release_lease(self, cache_key: str, owner: str) -> None: ...

    def refresh_ttls(self, items: Sequence[tuple[str, int]]) -> None:
        """Set each (cache key, TTL) entry's TTL, if it is still stored: the value-ranked TTL of an entry read
        (cachestore.value), sent in the background after the read's own refresh to entry_ttl."""

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> None:
        """release_lease for each (cache key, owner), in one round trip (per master on a cluster)."""

    def renew_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        """Extend the lease by `ttl` from now if `owner` still holds it; True when it did."""

    def lease_holder(self, cache_key: str) -> str | None:
        """On the compile path, like fetch: bounded as a whole by the operation timeout."""

    def close(self) -> None: ...


class Reader(Protocol):
    """Reports, inspection and administration. Entries are read and written in one toolchain's partition,
    `toolchain` (this compiler's unless opened for another); `in_toolchain` gives a reader of another."""

    description: str
    toolchain: str
    read_only: bool  # True: put_entries and delete_entries raise (a snapshot file)
    keeps_expired: bool  # True: entries past their expiry stay stored until purge_expired (SQLite)
    # True: `entry_pages(every_toolchain, size)` yields pages of entry names and `read_entry_page(names, with_ttl)`
    # reads one, in this process or a forked one (Redis; cachestore.scan_split)
    splits_scans: bool

    def entry_toolchains(self) -> list[str]:
        """The toolchains that hold entries, sorted."""

    def in_toolchain(self, toolchain: str) -> Reader:
        """The same store, in `toolchain`'s partition."""

    def entry_keys(self) -> Iterator[tuple[str, str]]:
        """(toolchain, cache key) of every live entry of every toolchain, streamed; no value is read."""

    # fleet metrics
    def totals(self) -> dict[str, float]: ...

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        """(host, worker, that worker's totals) for every worker that ever applied a batch."""

    def toolchains(self) -> dict[str, dict[str, float]]:
        """{toolchain id: its totals} for every toolchain whose passes applied a batch naming it."""

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
        """(time the pass ended, pass record), oldest first, streamed."""

    def zero_counters(self, record: dict) -> None:
        """Zero the fleet counters (totals, per worker, per toolchain) and log `record` (`report --zero`)."""

    # entries
    def scan_entries(self, with_ttl: bool = True) -> Iterator[RawEntry]:
        """Every live entry, streamed; `with_ttl=False` when the caller has no use for the time left."""

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        """Encoded entries, read without refreshing their TTL (looking does not keep an entry alive); one over
        the reader's max_entry_bytes as its TooLarge."""

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        """Cache keys that start with `prefix` (at most `limit`)."""

    def put_entries(self, items: Sequence[WriteItem]) -> None: ...

    def delete_entries(self, items: Sequence[tuple[str, str | None]]) -> None:
        """Delete (cache key, digest) entries; the digest index entry goes too when it points at the key."""

    def expired_count(self) -> tuple[int, int]:
        """(entries past their expiry still stored, their bytes); (0, 0) unless `keeps_expired`."""

    def purge_expired(self) -> None: ...

    def close(self) -> None: ...


# -- opening one ------------------------------------------------------------------------------------------
def open_backend(
    settings: Settings, *, reading: bool = False, toolchain: str | None = None, writable: bool = True
) -> Backend | Reader:
    """The backend the settings' tier URL names, in `toolchain`'s partition (default: this compiler's).
    `reading` opens it for reports and inspection: longer timeouts, and an embedded tier that does not exist
    yet is an error instead of a new file. `writable=False` (a read-only client's compile path): an embedded
    tier is opened read-only, neither created nor upgraded, and one that does not exist reads as empty; a
    Redis tier is only sent reads by such a client anyway."""
    from cachestore.settings import SettingsError

    url = shared_level(settings.tier)  # a stack of levels: the shared one holds the fleet's entries and metrics
    if url != settings.tier:
        settings = settings.replace(tier=url)
    if url.startswith("local:"):
        from cachestore.backends.sqlite import SqliteBackend

        timeout = max(settings.op_timeout, READ_TIMEOUT) if reading else settings.op_timeout
        # Background writes may wait for the lock as long as a closing client waits for them to land.
        return SqliteBackend(url[len("local:") :], timeout=timeout, create=not reading and writable,
                             writable=writable, toolchain=toolchain,
                             write_timeout=max(settings.final_flush_timeout, settings.op_timeout),
                             max_entry_bytes=settings.max_entry_bytes, max_size=settings.max_size)  # fmt: skip
    if url.startswith("dir:"):
        from cachestore.backends.directory import DirectoryBackend

        return DirectoryBackend(url[len("dir:") :], create=not reading and writable, writable=writable,
                                toolchain=toolchain, max_entry_bytes=settings.max_entry_bytes)  # fmt: skip
    if url.startswith(REDIS_SCHEMES):
        from cachestore.backends.redis import RedisBackend

        return RedisBackend.open(settings, reading=reading, toolchain=toolchain)
    raise SettingsError(f"unknown tier {redact_url(url)!r}; use {TIER_SCHEMES_TEXT}")


# A level of a stacked tier starts after whitespace with a scheme, so a local path may still hold spaces.
_LEVEL_START = re.compile(
    r"\s+(?=off(?:\s|$)|local:|dir:|redis://|rediss://|unix://|redis\+cluster://|rediss\+cluster://)"
)


def tier_levels(tier: str) -> list[str]:
    """The levels of a tier setting, nearest first: `local:PATH redis://HOST` is a local level in front of
    Redis (`--tier` repeated, a list in the config file, a space-separated NKICACHE_TIER)."""
    return [level for level in _LEVEL_START.split(tier.strip()) if level] or [tier]


def shared_level(tier: str) -> str:
    """The farthest level of a tier setting: the one machines share, holding the leases and the fleet metrics.
    Commands that read or administer one store (report, inspect, warm, the fleet queue) use it."""
    return tier_levels(tier)[-1]


SECRET_QUERY_PARAMETERS = ("password", "ssl_password")  # redis-py takes both from a URL's query


def redact_url(url: str) -> str:
    """The URL without its secrets, for every output (logs, errors, JSON, reports): the password of the
    user-info part (`redis://user:SECRET@host`) and secret query parameters (`?password=SECRET`), read as
    redis-py reads a URL (urlsplit), so what it would send is what is hidden."""
    levels = tier_levels(url)
    if len(levels) > 1:
        return " ".join(map(redact_url, levels))
    if "://" not in url:
        return url  # off, local:PATH, dir:PATH
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL (redis://[::1): shown to say so, without what could be user-info or a query
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{rest.partition('?')[0].rpartition('@')[2]}"
    netloc = parts.netloc
    if "@" in netloc:
        user_info, _, hosts = netloc.rpartition("@")
        user = user_info.partition(":")[0]
        netloc = f"{user}@{hosts}" if user else hosts
    query = "&".join(item for item in parts.query.split("&") if item and not _is_secret(item))
    return f"{parts.scheme}://{netloc}{parts.path}{'?' + query if query else ''}"


def _is_secret(query_item: str) -> bool:
    return unquote(query_item.partition("=")[0]).lower() in SECRET_QUERY_PARAMETERS


# Query parameters a tier URL may carry: what redis-py parses (it passes unknown ones on to the client, which
# then fails every connection), minus what would override nkicache's own timeouts and retries.
URL_TEXT_PARAMETERS = ("username", "password", "client_name", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile",
                       "ssl_keyfile", "ssl_password", "ssl_cert_reqs")  # fmt: skip
URL_SETTINGS_PARAMETERS = {  # set by nkicache's settings instead
    "socket_timeout": "op_timeout", "timeout": "op_timeout", "socket_connect_timeout": "connect_timeout",
    "retry_on_timeout": "op_timeout", "retry_on_error": "op_timeout",
}  # fmt: skip
SSL_CERT_REQS = ("none", "optional", "required")


def tier_url_problem(url: str) -> str | None:
    """What is wrong with a tier URL (or a stack of them), or None: checked when settings are read, so that a
    bad URL is one error before anything runs instead of a failure in every compile."""
    levels = tier_levels(url)
    if len(levels) > 1:
        return _stack_problem(levels)
    scheme = next((s for s in PATH_SCHEMES if url.startswith(s)), None)
    if url == "off" or (scheme and url[len(scheme) :].strip()):
        return None
    if scheme:
        return f"{scheme} needs a path ({scheme}PATH)"
    if not url.startswith(REDIS_SCHEMES):
        return f"is not a tier; use {TIER_SCHEMES_TEXT}"
    if any(character.isspace() for character in url):
        return "holds a space; each level of a stack starts with off, local:, dir:, redis://, rediss://, unix:// or redis+cluster://"
    try:
        parts = urlsplit(url)
        return _address_problem(parts) or _query_problem(parts.query)
    except ValueError as exc:
        return f"is not a valid URL: {exc}"


def _stack_problem(levels: list[str]) -> str | None:
    if "off" in levels:
        return "off cannot be a level of a stack; leave the other levels out instead"
    if len(set(levels)) < len(levels):
        return "names one level twice"
    for level in levels:
        problem = tier_url_problem(level)
        if problem:
            return f"level {redact_url(level)!r} {problem}"
    return None


def _address_problem(parts: SplitResult) -> str | None:
    if parts.scheme == "unix":
        return None if parts.path else "unix:// needs the socket's path (unix:///path/to/redis.sock)"
    if parts.scheme.endswith("+cluster"):
        hosts = parts.netloc.rpartition("@")[2].split(",")
        bad = [h for h in hosts if not h.rpartition(":")[0] or not h.rpartition(":")[2].isdigit()]
        return f"cluster node {bad[0]!r} is not host:port" if bad else None
    if not parts.hostname:
        return f"{parts.scheme}:// needs a host ({parts.scheme}://HOST:PORT)"
    parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
    return None


def _query_problem(query: str) -> str | None:
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS

    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name in URL_SETTINGS_PARAMETERS:
            return f"query parameter {name!r} is set by nkicache; use the {URL_SETTINGS_PARAMETERS[name]} setting"
        parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
        if parser is None and name not in URL_TEXT_PARAMETERS:
            return f"unknown query parameter {name!r}"
        try:
            if parser is not None:
                parser(values[0])
        except (TypeError, ValueError):
            return f"query parameter {name!r} has an invalid value"
        if name == "ssl_cert_reqs" and values[0].lower() not in SSL_CERT_REQS:
            return f"ssl_cert_reqs must be one of {', '.join(SSL_CERT_REQS)}"
    return None


def batched(items: Iterable, size: int = BATCH) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
