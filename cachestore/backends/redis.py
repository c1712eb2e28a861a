"""The Redis backend: a single server (redis://, rediss://, unix://) or a Redis Cluster (redis+cluster://).

Compile path: entries are plain strings, read in one round trip that refreshes their TTL (EXPIRE) and reads
their first FIRST_READ_BYTES (GETRANGE), all of an entry of the usual size; a longer one costs a round trip
for its size (STRLEN) and, when within `max_entry_bytes`, one for the rest: an entry over the limit is never
downloaded. Each compile-path call
(fetch, lease) is bounded as a whole by the operation timeout (`deadline.Watchdog`): the socket timeout
bounds each read only, and a server trickling its reply would hold the compile. Stores run in the client's
background flusher and take up to three pipelined round trips to keep identical binaries stored once.
Fleet metrics are applied by one Lua script per batch, guarded by a per-batch marker so a retried batch
counts once; every metrics key shares one hash slot (see `cachestore.keys`) so the script is legal on a
cluster.

Reader side (reports, inspection): everything streams (SCAN/HSCAN/XRANGE pages, pipelines of BATCH keys),
so memory stays bounded by the batch size, not by the size of the cache. Reading an entry here never
refreshes its TTL: looking does not keep it alive. Entries are read as on the compile path, sizes first.

Every redis-py error, `RedisClusterException` included (it is not a `RedisError`), becomes a `TierError`
in one place: `redis_errors`.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, unquote

import redis
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from bridge.identity import toolchain_id
from cachestore.api import (
    BATCH,
    MAX_BATCH_NUMBER,
    READ_CONNECT_TIMEOUT,
    READ_TIMEOUT,
    BatchRefused,
    KeyRecord,
    MetricsBatch,
    RawEntry,
    StoreRequest,
    TierTimeout,
    TierUnavailable,
    WriteItem,
    batched,
    pass_time,
    redact_url,
    stored_number,
)
from cachestore.backends.deadline import watchdog
from cachestore.entry import MAX_ENTRY_BYTES, TooLarge
from cachestore.keys import KeySpace

if TYPE_CHECKING:
    from cachestore.settings import Settings

T = TypeVar("T")
APPLIED_MARKER_TTL = 7 * 24 * 3600  # seconds a batch id is remembered; retries come far sooner
INVALID_BATCH = "invalid metrics batch"  # how the metrics script's error reply says it refused a batch
PASS_LOG_MAXLEN = 1_000_000
# `report --zero`: KEYS[1] the pass log, KEYS[2..] the counter hashes and the sets naming them; ARGV[1] the record.
ZERO_COUNTERS_LUA = """
redis.call('DEL', unpack(KEYS, 2))
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'pass', ARGV[1])
return 1
"""
# Bytes of an entry read before its size is known: entries a compile writes are smaller (a few to a few hundred
# KiB) and come in one round trip; a refused oversized one costs no more than this.
FIRST_READ_BYTES = 1 << 20

# KEYS[1] applied-batch marker   KEYS[2] totals           KEYS[3] workers set     KEYS[4] this worker's totals
# KEYS[5] kernel call counts     KEYS[6] kernel variants  KEYS[7] key usage       KEYS[8] key first use
# KEYS[9] key last use           KEYS[10] key -> kernel   KEYS[11] pass log       KEYS[12] toolchains set
# KEYS[13] this toolchain's totals                                                KEYS[13+i] hosts of key i
# ARGV[1] JSON {totals, kernel_calls, keys: [[key, kernel, usage, first, last]...], host, member, toolchain,
#               pass, ttl, maxlen}
# Every check comes before the first write (the applied marker included): a batch applies wholly or not at
# all, and a refused one leaves nothing behind, so its id can still be applied once the batch is valid. The
# checks are cachestore.api.batch_problem's, made again here because a command that fails half-way through a
# script (HINCRBYFLOAT of a NaN, HINCRBY of 2.5) keeps the writes before it.
APPLY_METRICS_LUA = """
local MAX, INVALID = MAX_BATCH_NUMBER, INVALID_BATCH
local function refuse(what) return redis.error_reply('ERR ' .. INVALID .. ': ' .. what) end
local function finite(v) return type(v) == 'number' and v == v and v ~= math.huge and v ~= -math.huge end
local function number(v, whole)
  if not finite(v) or v > MAX or v < -MAX then return false end
  return not whole or v == math.floor(v)
end
local function text(v) return type(v) == 'string' end
local decoded, p = pcall(cjson.decode, ARGV[1])
if not decoded or type(p) ~= 'table' then return refuse('ARGV[1] is not a JSON object') end
if not (text(p.host) and text(p.member) and text(p.toolchain) and text(p.pass)) then
  return refuse('host, member, toolchain and pass must be strings')
end
if type(p.totals) ~= 'table' or type(p.kernel_calls) ~= 'table' or type(p.keys) ~= 'table' then
  return refuse('totals, kernel_calls and keys must be JSON objects or arrays')
end
for name, value in pairs(p.totals) do
  if not number(value, false) then return refuse('totals.' .. tostring(name) .. ' is not a finite number') end
end
for name, calls in pairs(p.kernel_calls) do
  if not number(calls, true) then return refuse('kernel_calls.' .. tostring(name) .. ' is not a whole number') end
end
if #KEYS ~= 13 + #p.keys then return refuse(#KEYS .. ' keys for ' .. #p.keys .. ' cache keys') end
for i, k in ipairs(p.keys) do
  if type(k) ~= 'table' or not (text(k[1]) and text(k[2]) and number(k[3], true) and number(k[4], false)
                                and number(k[5], false)) then
    return refuse('keys[' .. i .. '] is not [key, kernel, whole usage, finite first use, finite last use]')
  end
end
if p.pass ~= '' then
  local parsed, record = pcall(cjson.decode, p.pass)
  if not parsed or type(record) ~= 'table' then return refuse('pass is not a JSON object') end
  for name, value in pairs(record) do
    if type(value) == 'number' and not finite(value) then
      return refuse('pass.' .. tostring(name) .. ' is not a finite number')
    end
  end
end

if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', p.ttl) then return 0 end
for name, value in pairs(p.totals) do
  redis.call('HINCRBYFLOAT', KEYS[2], name, value)
  redis.call('HINCRBYFLOAT', KEYS[4], name, value)
  if p.toolchain ~= '' then redis.call('HINCRBYFLOAT', KEYS[13], name, value) end
end
redis.call('SADD', KEYS[3], p.member)
if p.toolchain ~= '' then redis.call('SADD', KEYS[12], p.toolchain) end
for name, calls in pairs(p.kernel_calls) do redis.call('HINCRBY', KEYS[5], name, calls) end
for i, k in ipairs(p.keys) do
  local key, kernel, usage, first, last = k[1], k[2], k[3], k[4], k[5]
  if redis.call('HSETNX', KEYS[8], key, first) == 1 then
    redis.call('HINCRBY', KEYS[6], kernel, 1)
    redis.call('HSET', KEYS[10], key, kernel)
  elseif first < tonumber(redis.call('HGET', KEYS[8], key)) then
    redis.call('HSET', KEYS[8], key, first)
  end
  if last > tonumber(redis.call('HGET', KEYS[9], key) or '0') then redis.call('HSET', KEYS[9], key, last) end
  redis.call('HINCRBY', KEYS[7], key, usage)
  redis.call('SADD', KEYS[13 + i], p.host)
end
if p.pass ~= '' then
  redis.call('XADD', KEYS[11], 'MAXLEN', '~', p.maxlen, '*', 'pass', p.pass)
end
return 1
""".replace("MAX_BATCH_NUMBER", str(MAX_BATCH_NUMBER)).replace("INVALID_BATCH", json.dumps(INVALID_BATCH))

# KEYS[1] lease key   ARGV[1] owner: delete the lease only if this owner still holds it.
RELEASE_LEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS[1] lease key   ARGV[1] owner   ARGV[2] ttl (ms): extend the lease only if this owner still holds it.
RENEW_LEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


def connect(url: str, *, connect_timeout: float, op_timeout: float, password: str | None = None) -> Any:
    """A redis-py client for a tier URL; `password` (from the environment) overrides one in the URL."""
    # No retries: a failed operation is counted and trips the breaker at once, instead of multiplying the
    # operation timeout by redis-py's default retry count.
    options: dict[str, Any] = {
        "socket_connect_timeout": connect_timeout, "socket_timeout": op_timeout, "retry": Retry(NoBackoff(), 0),
    }  # fmt: skip
    if password is not None:
        options["password"] = password
    if url.startswith(("redis+cluster://", "rediss+cluster://")):
        scheme, _, rest = url.partition("://")
        rest, _, query = rest.partition("?")
        credentials, _, hosts = rest.rpartition("@")
        nodes = [_cluster_node(part, url) for part in hosts.split("/")[0].split(",") if part]
        if credentials:
            user, _, secret = credentials.partition(":")
            options.setdefault("password", unquote(secret) or None)
            options["username"] = unquote(user) or None
        options.update(_opened(lambda: _query_options(query)))  # ?ssl_ca_certs=/path/ca.pem, as redis:// takes it
        # A cluster client connects to its startup nodes as it is built.
        return _opened(lambda: RedisCluster(
            startup_nodes=nodes, ssl=scheme.startswith("rediss"), require_full_coverage=False, **options,
        ))  # fmt: skip
    return _opened(lambda: redis.Redis.from_url(url, **options))


def _query_options(query: str) -> dict[str, Any]:
    """A URL's query options (ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs, ...), typed as
    redis.from_url types them."""
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS

    options: dict[str, Any] = {}
    for name, values in parse_qs(query).items():
        parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
        options[name] = parser(values[0]) if parser else values[0]
    return options


def _opened(open_client: Callable[[], T]) -> T:
    """The client, or TierUnavailable: an unreachable cluster or a malformed URL must not fail a compile."""
    try:
        return open_client()
    except (rex.RedisError, rex.RedisClusterException, OSError, ValueError) as exc:
        raise TierUnavailable(f"cannot open the Redis tier: {type(exc).__name__}: {exc}") from None


@contextlib.contextmanager
def redis_errors(description: str) -> Iterator[None]:
    """Every failure of a redis-py call as a TierError naming `description` (the URL without its password)."""
    try:
        yield
    except rex.TimeoutError as exc:
        raise TierTimeout(f"{description}: timed out: {exc}") from None
    except (rex.RedisError, rex.RedisClusterException, OSError) as exc:  # RedisClusterException is no RedisError
        raise TierUnavailable(f"{description}: {type(exc).__name__}: {exc}") from None


def _cluster_node(part: str, url: str) -> ClusterNode:
    host, _, port = part.rpartition(":")
    if not host or not port.isdigit():
        raise TierUnavailable(f"bad cluster node {part!r} in {redact_url(url)}; expected host:port")
    return ClusterNode(host, int(port))


class RedisBackend:
    """A tier over a redis-py client (Redis, RedisCluster, or fakeredis in unit tests): the compile path
    and the reader side."""

    read_only = False
    keeps_expired = False  # Redis expires entries itself

    def __init__(
        self,
        client: Any,
        keys: KeySpace,
        description: str = "redis",
        toolchain: str | None = None,
        *,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        op_timeout: float | None = None,
    ):
        """`toolchain`: the partition of entries and leases this backend works in (default: this compiler's).
        `max_entry_bytes`: larger entries are never downloaded, only their size (TooLarge). `op_timeout`:
        seconds each compile-path call (fetch, acquire_lease, lease_holder) may take as a whole; None: bounded
        by the client's socket timeout per read only (reports and inspection)."""
        self.client = client
        self.keys = keys
        self.description = description
        self.toolchain = toolchain or toolchain_id()
        self.max_entry_bytes = max_entry_bytes
        self.op_timeout = op_timeout
        self._apply_metrics = client.register_script(APPLY_METRICS_LUA)
        self._release_lease = client.register_script(RELEASE_LEASE_LUA)
        self._renew_lease = client.register_script(RENEW_LEASE_LUA)
        self._zero_counters = client.register_script(ZERO_COUNTERS_LUA)

    @classmethod
    def open(cls, settings: Settings, *, reading: bool = False, toolchain: str | None = None) -> RedisBackend:
        """Connect to the tier the settings name; `reading` (reports, inspection) allows longer timeouts."""
        connect_timeout, op_timeout = settings.connect_timeout, settings.op_timeout
        if reading:
            connect_timeout, op_timeout = max(connect_timeout, READ_CONNECT_TIMEOUT), max(op_timeout, READ_TIMEOUT)
        client = connect(settings.tier, connect_timeout=connect_timeout, op_timeout=op_timeout,
                         password=settings.redis_password)  # fmt: skip
        return cls(client, KeySpace(settings.namespace), redact_url(settings.tier), toolchain,
                   max_entry_bytes=settings.max_entry_bytes, op_timeout=None if reading else op_timeout)  # fmt: skip

    def __repr__(self) -> str:
        return f"RedisBackend({self.description}, toolchain {self.toolchain})"

    def in_toolchain(self, toolchain: str) -> RedisBackend:
        """The same store and client, working in another toolchain's partition (closing either closes both)."""
        partition = copy.copy(self)
        partition.toolchain = toolchain
        return partition

    def entry_toolchains(self) -> list[str]:
        """The toolchains that hold entries (a SCAN of the entry keys, no values read)."""
        found: set[str] = set()
        for redis_key in self._stream(lambda: self.client.scan_iter(match=self.keys.entry_pattern(), count=1000)):
            found.add(self.keys.parse_entry(text(redis_key) or "")[0])
        return sorted(found)

    def _entry(self, cache_key: str) -> str:
        return self.keys.entry(self.toolchain, cache_key)

    def _lease(self, cache_key: str) -> str:
        return self.keys.lease(self.toolchain, cache_key)

    def _digest(self, digest: str) -> str:
        return self.keys.digest(self.toolchain, digest)

    def _call(self, operation: Callable[[], T]) -> T:
        with redis_errors(self.description):
            return operation()

    def _within_op_timeout(self, operation: Callable[[], T]) -> T:
        """A compile-path call, bounded as a whole by `op_timeout`: past it, the watchdog closes the client's
        connections (the one the call is blocked on among them; later calls connect again), and the call
        raises TierTimeout whatever redis-py made of the closed socket."""
        if self.op_timeout is None:
            return self._call(operation)
        with watchdog().watching(self.op_timeout, self._drop_connections) as watch:
            try:
                return self._call(operation)
            except Exception:
                if not watch.aborted:
                    raise
        raise TierTimeout(f"{self.description}: no whole answer within the {self.op_timeout} s operation timeout")

    def _drop_connections(self) -> None:
        """Close every connection of the client, those in use by other threads included (redis-py supports it):
        a read blocked on one of them fails at once. A background write on one fails too and is retried, as
        after any failure; by then the tier is counted as timed out and its breaker is open anyway."""
        if isinstance(self.client, RedisCluster):
            self.client.disconnect_connection_pools()
        else:
            self.client.connection_pool.disconnect()

    def _pipeline(self, fill: Callable[[Any], object]) -> list:
        def run() -> list:
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()

        return self._call(run)

    def _stream(self, iterator_factory: Callable[[], Iterator]) -> Iterator:
        """Items of a redis-py scan iterator, with errors translated at every step."""
        with redis_errors(self.description):
            iterator = iterator_factory()
        while True:
            with redis_errors(self.description):
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item

    # -- entries ----------------------------------------------------------------------------------
    def fetch(self, cache_keys: Sequence[str], ttl: int) -> dict[str, bytes | TooLarge]:
        def read() -> dict[str, bytes | TooLarge]:
            values = self._read_entries([self._entry(key) for key in cache_keys], refresh_ttl=ttl)
            return {key: value for key, (value, _) in zip(cache_keys, values, strict=True) if value is not None}

        return self._within_op_timeout(read)

    def _read_entries(
        self, redis_keys: Sequence[str], refresh_ttl: int | None = None
    ) -> list[tuple[bytes | TooLarge | None, float | None]]:
        """(value, seconds left) of each key: None for a key with no value, TooLarge for a value over
        max_entry_bytes, and seconds left when not refreshing (None: the key never expires).

        Never more than max_entry_bytes of a value is downloaded, and without a script (a cluster pipeline runs
        none): one round trip reads the first FIRST_READ_BYTES of each value, which is all of a value of the
        usual size, with one more command per key (EXPIRE refreshing the TTL of an entry used, as GETEX did, or
        PTTL); only values longer than that cost a second (their size) and a third (the value, still bounded).
        A value shorter than asked for is whole whatever happened in between, and one that grew past the limit
        after its size was asked comes back longer than the limit, so it is refused all the same."""
        limit = self.max_entry_bytes
        first = min(FIRST_READ_BYTES, limit + 1)

        def heads(pipe: Any) -> None:
            for key in redis_keys:
                # Both say whether the key is there: an empty value and a missing key read alike.
                if refresh_ttl is not None:
                    pipe.expire(key, refresh_ttl)
                else:
                    pipe.pttl(key)
                pipe.getrange(key, 0, first - 1)

        replies = self._pipeline(heads)
        found: list[tuple[bytes | TooLarge | None, float | None]] = []
        longer: list[int] = []  # values longer than their head
        for i in range(len(redis_keys)):
            there, head = replies[2 * i : 2 * i + 2]
            ttl = None if refresh_ttl is not None or there < 0 else there / 1000
            if (not there) if refresh_ttl is not None else there == -2:  # EXPIRE's 0, PTTL's -2: no key
                found.append((None, None))
            elif len(head) < first:
                found.append((head, ttl))
            else:
                found.append((None, ttl))
                longer.append(i)
        if not longer:
            return found
        sizes = self._pipeline(lambda pipe: [pipe.strlen(redis_keys[i]) for i in longer])
        within = []
        for i, size in zip(longer, sizes, strict=True):
            if size > limit:
                found[i] = (TooLarge(size, limit), found[i][1])
            elif size:  # else deleted since
                within.append(i)
        if within:
            values = self._pipeline(lambda pipe: [pipe.getrange(redis_keys[i], 0, limit) for i in within])
            for i, value in zip(within, values, strict=True):
                # Longer than the limit: it grew since its size was asked (by how much is unknown: at least that).
                # Empty: deleted since.
                whole = TooLarge(len(value), limit) if len(value) > limit else value or None
                found[i] = (whole, found[i][1])
        return found

    def store(self, requests: Sequence[StoreRequest], ttl: int) -> None:
        if not requests:
            return
        claims = self._pipeline(
            lambda pipe: [
                (
                    pipe.set(self._digest(r.digest), r.cache_key, nx=True, ex=ttl),
                    pipe.get(self._digest(r.digest)),
                )
                for r in requests
            ]
        )
        holders = [text(claims[2 * i + 1]) for i in range(len(requests))]
        others = [(r, holder) for r, holder in zip(requests, holders, strict=True) if holder not in (None, r.cache_key)]
        alive = self._pipeline(lambda pipe: [pipe.exists(self._entry(h)) for _, h in others]) if others else []
        # A holder earlier in this batch is written below, in the same pipeline, before its references.
        in_batch = {r.cache_key for r, holder in zip(requests, holders, strict=True) if holder == r.cache_key}
        referenced = {
            r.cache_key: holder
            for (r, holder), exists in zip(others, alive, strict=True)
            if exists or holder in in_batch
        }

        def write(pipe: Any) -> None:
            for r in requests:
                if r.cache_key in referenced:
                    pipe.set(self._entry(r.cache_key), r.reference(referenced[r.cache_key]), ex=ttl)
                else:
                    pipe.set(self._entry(r.cache_key), r.full, ex=ttl)
                    pipe.set(self._digest(r.digest), r.cache_key, ex=ttl)

        self._pipeline(write)

    # -- single flight ----------------------------------------------------------------------------
    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        return bool(
            self._within_op_timeout(lambda: self.client.set(self._lease(cache_key), owner, nx=True, px=int(ttl * 1000)))
        )

    def release_lease(self, cache_key: str, owner: str) -> None:
        self._call(lambda: self._release_lease(keys=[self._lease(cache_key)], args=[owner]))

    def renew_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        return bool(self._call(lambda: self._renew_lease(keys=[self._lease(cache_key)], args=[owner, int(ttl * 1000)])))

    def lease_holder(self, cache_key: str) -> str | None:
        return text(self._within_op_timeout(lambda: self.client.get(self._lease(cache_key))))

    # -- metrics ----------------------------------------------------------------------------------
    def apply_metrics(self, batch: MetricsBatch) -> bool:
        """Apply the batch in one script run; BatchRefused (nothing written) when the script finds it invalid.
        A NaN is sent as it is, not checked here first: the script guards the metrics against every sender."""
        k = self.keys
        ordered = sorted(batch.keys.items())
        keys = [
            k.applied_batch(batch.batch_id), k.totals, k.workers, k.worker_metrics(batch.host, batch.worker),
            k.kernel_calls, k.kernel_variants, k.key_usage, k.key_first, k.key_last, k.key_kernel, k.pass_log,
            k.toolchains, k.toolchain_metrics(batch.toolchain), *(k.key_hosts(key) for key, _ in ordered),
        ]  # fmt: skip
        try:
            pass_text = json.dumps(batch.pass_record, sort_keys=True) if batch.pass_record is not None else ""
        except (TypeError, ValueError) as exc:  # not JSON at all: nothing the script could be handed
            raise BatchRefused(f"{self.description}: metrics batch {batch.batch_id} refused: {exc}") from None
        payload = {
            "totals": batch.totals,
            "kernel_calls": batch.kernel_calls,
            "keys": [[key, u.kernel_name, u.usage, u.first_use, u.last_use] for key, u in ordered],
            "host": batch.host,
            "member": f"{batch.host}:{batch.worker}",
            "toolchain": batch.toolchain,
            "pass": pass_text,
            "ttl": APPLIED_MARKER_TTL,
            "maxlen": PASS_LOG_MAXLEN,
        }

        def run() -> object:
            try:  # default=str: a value JSON cannot hold reaches the script as a string, which it refuses
                return self._apply_metrics(keys=keys, args=[json.dumps(payload, default=str)])
            except rex.ResponseError as exc:
                if INVALID_BATCH not in str(exc):
                    raise  # a failure of the tier itself, translated by redis_errors
                raise BatchRefused(f"{self.description}: metrics batch {batch.batch_id} refused: {exc}") from None

        return bool(self._call(run))

    # -- fleet metrics ------------------------------------------------------------------------------
    def _float_hash(self, name: str) -> dict[str, float]:
        return {text(k): stored_number(v) for k, v in self._stream(lambda: self.client.hscan_iter(name, count=1000))}

    def totals(self) -> dict[str, float]:
        return self._float_hash(self.keys.totals)

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        members = self._stream(lambda: self.client.sscan_iter(self.keys.workers, count=1000))
        for batch in batched(text(m) for m in members):
            pairs = [member.partition(":")[::2] for member in batch]
            hashes = self._pipeline(lambda pipe, p=pairs: [pipe.hgetall(self.keys.worker_metrics(h, w)) for h, w in p])
            for (host, worker), values in zip(pairs, hashes, strict=True):
                yield host, worker, {text(k): stored_number(v) for k, v in values.items()}

    def toolchains(self) -> dict[str, dict[str, float]]:
        members = self._stream(lambda: self.client.sscan_iter(self.keys.toolchains, count=1000))
        found: dict[str, dict[str, float]] = {}
        for batch in batched(text(m) for m in members):
            hashes = self._pipeline(lambda pipe, b=batch: [pipe.hgetall(self.keys.toolchain_metrics(t)) for t in b])
            for toolchain, values in zip(batch, hashes, strict=True):
                found[toolchain] = {text(k): stored_number(v) for k, v in values.items()}
        return dict(sorted(found.items()))

    def kernels(self) -> dict[str, dict[str, int]]:
        calls = self._float_hash(self.keys.kernel_calls)
        variants = self._float_hash(self.keys.kernel_variants)
        return {
            name: {"call_count": int(calls.get(name, 0)), "variants": int(variants.get(name, 0))}
            for name in sorted(set(calls) | set(variants))
        }

    def key_usage(self) -> Iterator[tuple[str, int]]:
        for key, usage in self._stream(lambda: self.client.hscan_iter(self.keys.key_usage, count=1000)):
            yield text(key), int(stored_number(usage))

    def key_count(self) -> int:
        with redis_errors(self.description):
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
                    found[key] = KeyRecord(key, text(kernel[i]) or "", int(stored_number(usage[i])),
                                           stored_number(first[i]), stored_number(last[i]))  # fmt: skip
        return found

    def key_hosts(self, cache_keys: Sequence[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            members = self._pipeline(lambda pipe, c=chunk: [pipe.smembers(self.keys.key_hosts(key)) for key in c])
            for key, hosts in zip(chunk, members, strict=True):
                if hosts:
                    found[key] = sorted(text(h) for h in hosts)
        return found

    @staticmethod
    def _stream_id(since: float | None) -> str:
        return "-" if since is None else str(max(0, int(since * 1000)))

    def pass_log_span(self, since: float | None) -> tuple[float, float] | None:
        with redis_errors(self.description):
            first = self.client.xrange(self.keys.pass_log, min=self._stream_id(since), count=1)
            last = self.client.xrevrange(self.keys.pass_log, count=1)
        if not first or not last:
            return None
        return _record_time(*first[0]), _record_time(*last[0])

    def pass_log(self, since: float | None) -> Iterator[tuple[float, dict]]:
        start = self._stream_id(since)
        while True:
            with redis_errors(self.description):
                page = self.client.xrange(self.keys.pass_log, min=start, count=1000)
            for stream_id, fields in page:
                record = _pass_record(fields)
                if record is not None:
                    yield _record_time(stream_id, fields), record
            if len(page) < 1000:
                return
            start = "(" + text(page[-1][0])

    def zero_counters(self, record: dict) -> None:
        """Zero the fleet counters (totals, per worker, per toolchain) and append `record` to the pass log, in one
        script run (every key declared, all in the metrics slot); entries, key usage, per-kernel counts and the
        pass log are kept."""
        k = self.keys
        workers = [text(m) for m in self._call(lambda: self.client.smembers(k.workers))]
        toolchains = [text(m) for m in self._call(lambda: self.client.smembers(k.toolchains))]
        hashes = [k.worker_metrics(*m.partition(":")[::2]) for m in workers]
        hashes += [k.toolchain_metrics(t) for t in toolchains]
        keys = [k.pass_log, k.totals, k.workers, k.toolchains, *hashes]
        self._call(lambda: self._zero_counters(keys=keys, args=[json.dumps(record, sort_keys=True), PASS_LOG_MAXLEN]))

    # -- entries ------------------------------------------------------------------------------------
    def scan_entries(self, with_ttl: bool = True) -> Iterator[RawEntry]:
        pattern = self.keys.entry_pattern(self.toolchain)
        redis_keys = self._stream(lambda: self.client.scan_iter(match=pattern, count=1000))
        for batch in batched(text(key) for key in redis_keys):
            for redis_key, (data, ttl) in zip(batch, self._read_entries(batch), strict=True):
                if data is not None:
                    yield RawEntry(self.keys.parse_entry(redis_key)[1], data, ttl if with_ttl else None, self.toolchain)

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        found: dict[str, bytes | TooLarge] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            values = self._read_entries([self._entry(key) for key in chunk])
            found.update((key, value) for key, (value, _) in zip(chunk, values, strict=True) if value is not None)
        return found

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        pattern = self._entry(prefix.replace("*", "")).removesuffix("}") + "*"
        found: list[str] = []
        for redis_key in self._stream(lambda: self.client.scan_iter(match=pattern, count=1000)):
            found.append(self.keys.parse_entry(text(redis_key) or "")[1])
            if len(found) >= limit:
                break
        return sorted(found)

    def put_entries(self, items: Sequence[WriteItem]) -> None:
        def fill(pipe: Any) -> None:
            for item in items:
                ttl_ms = max(1, int(item.ttl * 1000))
                pipe.set(self._entry(item.cache_key), item.data, px=ttl_ms)
                if item.digest:
                    pipe.set(self._digest(item.digest), item.cache_key, px=ttl_ms)

        if items:
            self._pipeline(fill)

    def delete_entries(self, items: Sequence[tuple[str, str | None]]) -> None:
        if not items:
            return
        self._pipeline(lambda pipe: [pipe.delete(self._entry(key)) for key, _ in items])
        indexed = [(key, digest) for key, digest in items if digest]
        if not indexed:
            return
        holders = self._pipeline(lambda pipe: [pipe.get(self._digest(digest)) for _, digest in indexed])
        # Only index entries still naming a deleted key. One stored again in between loses its index entry,
        # which costs that binary its deduplication once, never correctness (stores check the holder exists).
        stale = [digest for (key, digest), holder in zip(indexed, holders, strict=True) if text(holder) == key]
        if stale:
            self._pipeline(lambda pipe: [pipe.delete(self._digest(digest)) for digest in stale])

    def expired_count(self) -> tuple[int, int]:
        return 0, 0  # Redis drops an entry when it expires

    def purge_expired(self) -> None:
        pass

    def close(self) -> None:
        self._call(self.client.close)


def text(value: bytes | str | None) -> str | None:
    """A Redis reply as text (redis-py returns bytes unless the client decodes responses)."""
    # Replacing what is not UTF-8: a name written by hand must not fail a whole report or listing.
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else value


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
    return pass_time(record.get("finished"), int(text(stream_id).partition("-")[0]) / 1000)
