"""The Redis backend: a single server (redis://, rediss://, unix://) or a Redis Cluster (redis+cluster://).

Compile path: entries are plain strings, read in one round trip that refreshes their TTL (EXPIRE) and reads
their first FIRST_READ_BYTES (GETRANGE), all of an entry of the usual size; a longer one costs a round trip
for its size (STRLEN) and, when within `max_entry_bytes`, one for the rest: an entry over the limit is never
downloaded. Each compile-path call
(fetch, lease) is bounded as a whole by the operation timeout (`deadline.Watchdog`): the socket timeout
bounds each read only, and a server trickling its reply would hold the compile. Stores run in the client's
background flusher, each batch of entries with their variant index fields in one pipelined round trip.
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
import heapq
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, overload
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
    Backend,
    BatchRefused,
    ConnectionsDropped,
    KeyRecord,
    MetricsBatch,
    PagedReader,
    RawEntry,
    StoreRequest,
    TierTimeout,
    TierUnavailable,
    WriteItem,
    batch_problem,
    batched,
    pass_time,
    stored_number,
)
from cachestore.backends.deadline import watchdog
from cachestore.entry import MAX_ENTRY_BYTES, TooLarge
from cachestore.keys import (
    DEFAULT_METRICS_SHARDS,
    MAX_METRICS_SHARDS,
    KeySpace,
    MetricsKeys,
    key_shard,
    pass_shard,
    shard_count_or,
)
from cachestore.tier_urls import is_cluster, redact_url

if TYPE_CHECKING:
    from cachestore.settings import Settings

logger = logging.getLogger(__name__)
T = TypeVar("T")
RedisClient = redis.Redis | RedisCluster  # what `connect` opens: a server's client, or a cluster's
APPLIED_MARKER_TTL = 7 * 24 * 3600  # seconds a batch id is remembered; retries come far sooner
INVALID_BATCH = "invalid metrics batch"  # how the metrics script's error reply says it refused a batch
PASS_LOG_MAXLEN = 1_000_000
# `report --zero`, in one metrics shard: KEYS[1] its pass log, KEYS[2..] its counter hashes and the sets naming
# them; ARGV[1] the record to log ('' in every shard but one), ARGV[2] the log's MAXLEN.
ZERO_COUNTERS_LUA = """
redis.call('DEL', unpack(KEYS, 2))
if ARGV[1] ~= '' then
  local function log() return redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', 'pass', ARGV[1]) end
  local reply = log()
  if type(reply) == 'table' and reply.err and string.find(reply.err, 'WRONGTYPE', 1, true) then
    redis.call('DEL', KEYS[1])  -- another tool's key under the pass log's name: replaced, as the metrics script does
    reply = log()
  end
  if type(reply) == 'table' and reply.err then return redis.error_reply(reply.err) end
end
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
#               pass, ttl, maxlen, pass_part}
# Every key is one metrics shard's. A batch is applied as one part per shard it touches: the pass's own counts
# (totals, worker, toolchain, kernel calls, pass log; `pass_part` true) in the shard of its batch id, each
# cache key's usage in the shard of the key. Each part has its own applied marker, so it applies exactly once
# however often the batch is retried.
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
-- A field that another tool or a hand left holding no number (or a key of another type) would fail this
-- increment, half-way through, for every batch to come: such a stored value counts as absent.
local function add(command, key, name, value)
  local reply = redis.pcall(command, key, name, value)
  if type(reply) == 'table' and reply.err then
    if type(redis.pcall('HSET', key, name, value)) == 'table' then
      redis.call('DEL', key)
      redis.call('HSET', key, name, value)
    end
  end
end
local function stored(key, name) return tonumber(redis.pcall('HGET', key, name)) end
-- A key another tool or a hand left holding another type (a string under the workers set, a hash under the
-- pass log) would fail its command half-way through every batch to come, the same way: it is replaced.
local function put(command, key, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then
    if string.find(reply.err, 'WRONGTYPE', 1, true) then redis.call('DEL', key) end
    reply = redis.call(command, key, ...)  -- raises any other error, as redis.call does
  end
  return reply
end
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
if p.pass_part then
for name, value in pairs(p.totals) do
  add('HINCRBYFLOAT', KEYS[2], name, value)
  add('HINCRBYFLOAT', KEYS[4], name, value)
  if p.toolchain ~= '' then add('HINCRBYFLOAT', KEYS[13], name, value) end
end
put('SADD', KEYS[3], p.member)
if p.toolchain ~= '' then put('SADD', KEYS[12], p.toolchain) end
for name, calls in pairs(p.kernel_calls) do add('HINCRBY', KEYS[5], name, calls) end
if p.pass ~= '' then
  put('XADD', KEYS[11], 'MAXLEN', '~', p.maxlen, '*', 'pass', p.pass)
end
end
for i, k in ipairs(p.keys) do
  local key, kernel, usage, first, last = k[1], k[2], k[3], k[4], k[5]
  if put('HSETNX', KEYS[8], key, first) == 1 then
    add('HINCRBY', KEYS[6], kernel, 1)
    put('HSET', KEYS[10], key, kernel)
  else
    local known = stored(KEYS[8], key)
    if not (known and first >= known) then put('HSET', KEYS[8], key, first) end
  end
  if last > (stored(KEYS[9], key) or 0) then put('HSET', KEYS[9], key, last) end
  add('HINCRBY', KEYS[7], key, usage)
  put('SADD', KEYS[13 + i], p.host)
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


def connect(url: str, *, connect_timeout: float, op_timeout: float, password: str | None = None) -> RedisClient:
    """A redis-py client for a tier URL; `password` (from the environment) overrides one in the URL."""
    # No retries: a failed operation is counted and trips the breaker at once, instead of multiplying the
    # operation timeout by redis-py's default retry count.
    options: dict[str, Any] = {
        "socket_connect_timeout": connect_timeout,
        "socket_timeout": op_timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    if password is not None:
        options["password"] = password
    if is_cluster(url):
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
        return _opened(
            lambda: RedisCluster(
                startup_nodes=nodes,
                ssl=scheme.startswith("rediss"),
                require_full_coverage=False,
                **options,
            )
        )
    return _opened(lambda: redis.Redis.from_url(url, **options))


def _query_options(query: str) -> dict[str, Any]:
    """A URL's query options (ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs, ...), typed as
    redis.from_url types them."""
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS

    options: dict[str, Any] = {}
    for name, values in parse_qs(query).items():
        parser = URL_QUERY_ARGUMENT_PARSERS.get(name)
        options[name] = parser(values[0]) if callable(parser) else values[0]  # redis-py leaves the table untyped
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
    except BrokenPipeError:
        raise  # redis-py wraps its own sockets' errors: this one is the caller's (stdout closed under `| head`)
    except (rex.RedisError, rex.RedisClusterException, OSError) as exc:  # RedisClusterException is no RedisError
        raise TierUnavailable(f"{description}: {type(exc).__name__}: {exc}") from None


def _cluster_node(part: str, url: str) -> ClusterNode:
    host, _, port = part.rpartition(":")
    if not host or not port.isdigit():
        raise TierUnavailable(f"bad cluster node {part!r} in {redact_url(url)}; expected host:port")
    return ClusterNode(host, int(port))


class RedisBackend(Backend, PagedReader):
    """A tier over a redis-py client (Redis, RedisCluster, or fakeredis in unit tests): the compile path
    and the reader side."""

    value_ttls = True  # an entry stays for its TTL alone
    keeps_expired = False  # Redis expires entries itself
    splits_scans = True  # a PagedReader: a scan's pages can be read by other processes (cachestore.scan_split)

    def __init__(
        self,
        client: RedisClient,
        keys: KeySpace,
        description: str = "redis",
        partition: str | None = None,
        *,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
        op_timeout: float | None = None,
        metrics_shards: int = DEFAULT_METRICS_SHARDS,
    ):
        """`partition`: the partition of entries and leases this backend works in (default: this compiler's).
        `max_entry_bytes`: larger entries are never downloaded, only their size (TooLarge). `op_timeout`:
        seconds each compile-path call (fetch, acquire_lease, lease_holder) may take as a whole; None: bounded
        by the client's socket timeout per read only (reports and inspection)."""
        self.client = client
        self.keys = keys
        self.description = description
        self.partition = partition or toolchain_id()
        self.max_entry_bytes = max_entry_bytes
        self.op_timeout = op_timeout
        self.metrics_shards = metrics_shards  # for a namespace that has none yet (see _shard_count)
        self._shards: int | None = None
        self._drops = 0  # how often the watchdog closed the client's connections (abort_calls)
        self._apply_metrics = client.register_script(APPLY_METRICS_LUA)
        self._release_lease = client.register_script(RELEASE_LEASE_LUA)
        self._renew_lease = client.register_script(RENEW_LEASE_LUA)
        self._zero_counters = client.register_script(ZERO_COUNTERS_LUA)

    @classmethod
    def open(cls, settings: Settings, *, reading: bool = False, partition: str | None = None) -> RedisBackend:
        """Connect to the tier the settings name; `reading` (reports, inspection) allows longer timeouts."""
        connect_timeout, op_timeout = settings.connect_timeout, settings.op_timeout
        if reading:
            connect_timeout, op_timeout = max(connect_timeout, READ_CONNECT_TIMEOUT), max(op_timeout, READ_TIMEOUT)
        client = connect(
            settings.tier, connect_timeout=connect_timeout, op_timeout=op_timeout, password=settings.redis_password
        )
        return cls(
            client,
            KeySpace(settings.namespace),
            redact_url(settings.tier),
            partition,
            max_entry_bytes=settings.max_entry_bytes,
            op_timeout=None if reading else op_timeout,
            metrics_shards=settings.metrics_shards,
        )

    def __repr__(self) -> str:
        return f"RedisBackend({self.description}, partition {self.partition})"

    def entry_partitions(self) -> list[str]:
        """The partitions that hold entries (a SCAN of the entry keys, no values read)."""
        found: set[str] = set()
        # Pages of 10k keys, and the partition's name alone (no cache key decoded): du over 100k entries scanned
        # them all here, page by page of 1k, before reading any (bench/RESULTS.md, "Scans split over processes").
        for redis_key in self._stream(lambda: self.client.scan_iter(match=self.keys.entry_pattern(), count=10_000)):
            found.add(self.keys.entry_partition(text(redis_key) or ""))
        return sorted(found)

    def entry_keys(self) -> Iterator[tuple[str, str]]:
        for redis_key in self._stream(lambda: self.client.scan_iter(match=self.keys.entry_pattern(), count=10_000)):
            yield self.keys.parse_entry(text(redis_key) or "")

    def _entry(self, cache_key: str) -> str:
        return self.keys.entry(self.partition, cache_key)

    def _lease(self, cache_key: str) -> str:
        return self.keys.lease(self.partition, cache_key)

    def _call(self, operation: Callable[[], T]) -> T:
        drops = self._drops
        try:  # not `with redis_errors`: a generator-based context manager costs a remote hit a few µs
            return operation()
        except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
            if self._drops != drops:  # its connection was closed under it, for another call's timeout
                raise ConnectionsDropped(f"{self.description}: connections closed by an operation timeout") from None
            with redis_errors(self.description):
                raise exc from None

    def _within_op_timeout(self, operation: Callable[[], T], seconds: float | None = None) -> T:
        """A compile-path call, bounded as a whole by `op_timeout` (or the `seconds` left of it): past it, the
        watchdog closes the client's connections (the one the call is blocked on among them; later calls connect
        again), and the call raises TierTimeout whatever redis-py made of the closed socket."""
        if self.op_timeout is None:
            return self._call(operation)
        dog = watchdog()
        watch = dog.watch(self.op_timeout if seconds is None else max(seconds, 0.0), self.abort_calls)
        try:
            return self._call(operation)
        except Exception:
            if not watch.aborted:
                raise
        finally:
            dog.unwatch(watch)
        raise TierTimeout(f"{self.description}: no whole answer within the {self.op_timeout} s operation timeout")

    def abort_calls(self) -> None:
        """Close every connection of the client, those in use by other threads included (redis-py supports it):
        a read blocked on one of them fails at once. A background write on one fails too, with
        ConnectionsDropped: the timed-out call counts the one timeout, and the write stays queued."""
        self._drops += 1
        if isinstance(self.client, RedisCluster):
            self.client.disconnect_connection_pools()
        else:
            self.client.connection_pool.disconnect()

    def _pipeline(self, fill: Callable[[Any], object], raise_on_error: bool = True) -> list:
        """Replies of the commands `fill` queues, in one round trip. With `raise_on_error` False a command's
        error is its reply (an exception object) rather than raised, after every command has run."""

        def run() -> list:
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute(raise_on_error=raise_on_error)

        return self._call(run)

    def _stream(self, iterator_factory: Callable[[], Iterator], *, of_metric: bool = False) -> Iterator:
        """Items of a redis-py scan iterator, with errors translated at every step. `of_metric`: a scan of one
        metrics key, which ends, empty, where another type stands under its name (another tool's or a hand's:
        a report reads past it, and the metrics script replaces it at the next batch)."""
        with redis_errors(self.description):
            iterator = iterator_factory()
        while True:
            # Not `with redis_errors` around each step: entering a context manager per key was a tenth of a
            # 100k-entry verify. The same errors are translated, by the same function.
            try:
                item = next(iterator)
            except StopIteration:
                return
            except (rex.RedisError, rex.RedisClusterException, OSError) as exc:
                if of_metric and _wrong_type(exc):
                    return
                with redis_errors(self.description):
                    raise exc from None
            yield item

    # -- entries ----------------------------------------------------------------------------------
    def fetch(self, cache_keys: Sequence[str], ttl: int | None) -> dict[str, bytes | TooLarge]:
        """With `ttl` None only reading commands are sent (GETRANGE, STRLEN), which the nkicache-reader ACL user
        may run: one GETRANGE a key, in one pipeline (TierClient refreshes TTLs in the background, batched).
        Otherwise each entry found has its TTL refreshed (EXPIRE) in the same round trip. An empty value reads as
        no value: GETRANGE does not tell them apart, and an empty entry is no entry anyway."""
        if ttl is None:
            return self._within_op_timeout(lambda: self._fetch_heads(cache_keys))

        def read() -> dict[str, bytes | TooLarge]:
            values = self._read_entries([self._entry(key) for key in cache_keys], refresh_ttl=ttl)
            return {key: value for key, (value, _) in zip(cache_keys, values, strict=True) if value is not None}

        return self._within_op_timeout(read)

    def _fetch_heads(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        """fetch without a TTL refresh: the first FIRST_READ_BYTES of each value, then the longer ones bounded."""
        first = min(FIRST_READ_BYTES, self.max_entry_bytes + 1)
        redis_keys = [self._entry(key) for key in cache_keys]
        heads = self._heads(redis_keys, first)
        found: dict[str, bytes | TooLarge] = {}
        longer: list[int] = []
        for i, head in enumerate(heads):
            if len(head) >= first:
                longer.append(i)
            elif head:
                found[cache_keys[i]] = head
        if longer:
            values = self._read_longer(redis_keys, [(None, None)] * len(redis_keys), longer)
            found.update((cache_keys[i], value) for i in longer if (value := values[i][0]) is not None)
        return found

    def _read_entries(
        self, redis_keys: Sequence[str], refresh_ttl: int | None = None, with_ttl: bool = True
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
        if refresh_ttl is None and not with_ttl:
            return self._read_heads_alone(redis_keys, first)

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
        return self._read_longer(redis_keys, found, longer)

    def _read_heads_alone(
        self, redis_keys: Sequence[str], first: int
    ) -> list[tuple[bytes | TooLarge | None, float | None]]:
        """As `_read_entries` for a scan that wants no TTLs (verify, du, gc's sizes): one GETRANGE a key, half
        the commands. An empty reply is a missing key or an empty value: EXISTS tells them apart, for those
        alone (an empty value is rare, and is reported as the entry it is)."""
        heads = self._heads(redis_keys, first)
        empty = [i for i, head in enumerate(heads) if not head]
        there = self._pipeline(lambda pipe: [pipe.exists(redis_keys[i]) for i in empty]) if empty else []
        present = {i for i, exists in zip(empty, there, strict=True) if exists}
        found: list[tuple[bytes | TooLarge | None, float | None]] = []
        longer: list[int] = []
        for i, head in enumerate(heads):
            if not head and i not in present:
                found.append((None, None))
            elif len(head) < first:
                found.append((head, None))
            else:
                found.append((None, None))
                longer.append(i)
        return self._read_longer(redis_keys, found, longer)

    def _heads(self, redis_keys: Sequence[str], first: int) -> list:
        """The first `first` bytes of each value (b"": no key, or an empty value), one GETRANGE a key."""
        return self._pipeline(lambda pipe: [pipe.getrange(key, 0, first - 1) for key in redis_keys])

    def _read_longer(
        self, redis_keys: Sequence[str], found: list[tuple[bytes | TooLarge | None, float | None]], longer: list[int]
    ) -> list[tuple[bytes | TooLarge | None, float | None]]:
        """`found` with the values longer than their head read (their size first: never more than the limit)."""
        limit = self.max_entry_bytes
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

        def write(pipe: Any) -> None:
            for r in requests:
                pipe.set(self._entry(r.cache_key), r.full, ex=r.ttl or ttl)  # r.ttl: value-ranked (cachestore.value)
            self._fill_variant_index(pipe, requests, ttl)

        # One round trip for the entries and their indexes (two before 2026-12-01: a round trip costs the compiling
        # process a wake-up and the flusher's Python, and a one-shot compile waits for the last one in close()).
        # An entry's write that fails fails the store (retried whole); an index's is only logged (_fill_indexes).
        replies = self._pipeline(write, raise_on_error=False)
        refused = [reply for reply in replies[: len(requests)] if isinstance(reply, Exception)]
        if refused:
            with redis_errors(self.description):
                raise refused[0]
        failed = [reply for reply in replies[len(requests) :] if isinstance(reply, Exception)]
        if failed:
            logger.debug("%s: index not written: %s", self.description, failed)

    def _fill_variant_index(self, pipe: Any, requests: Sequence[StoreRequest], ttl: int) -> None:
        """Queue on `pipe` the variant index fields of the requests. They only name a miss's cause: a key of
        another type under their names must not fail the entries' writes, which would then be retried, and fail,
        for ever (the caller runs the pipeline without raising, and only logs their errors)."""
        index: dict[str, dict[bytes, bytes]] = {}
        for r in requests:
            index.setdefault(r.kernel_name, {}).update(r.index_fields)
        for kernel_name, fields in index.items():
            if fields:
                pipe.hset(self.keys.variant_index(kernel_name), mapping=fields)
                pipe.expire(self.keys.variant_index(kernel_name), ttl)

    def read_variant_index(self, queries: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[bytes | None] | None]:
        if not queries:
            return []
        replies = self._within_op_timeout(
            lambda: self._pipeline(
                lambda pipe: [pipe.hmget(self.keys.variant_index(kernel), list(fields)) for kernel, fields in queries],
                raise_on_error=False,
            )
        )
        return [None if isinstance(reply, Exception) else reply for reply in replies]  # a key of another type

    def refresh_ttls(self, items: Sequence[tuple[str, int]]) -> None:
        if items:  # EXPIRE leaves a key that is gone (evicted, deleted since the read) gone
            self._pipeline(lambda pipe: [pipe.expire(self._entry(key), ttl) for key, ttl in items])

    # -- single flight ----------------------------------------------------------------------------
    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        """SET NX with the lease's TTL, and in the same round trip PEXPIRE LT: a lease that would live longer
        than `ttl` from now (one planted with no TTL, or a longer one) is cut to `ttl`, so no lease lasts for
        ever. A holder renews to `ttl`, so its lease is never cut."""
        key, milliseconds = self._lease(cache_key), int(ttl * 1000)

        def acquire() -> bool:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(key, owner, nx=True, px=milliseconds)
            pipe.pexpire(key, milliseconds, lt=True)
            taken, _ = pipe.execute(raise_on_error=False)  # a server before 7.0 refuses LT: only the SET counts
            if isinstance(taken, Exception):
                raise taken
            return taken is True

        return self._within_op_timeout(acquire)

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> None:
        calls = [([self._lease(cache_key)], [owner]) for cache_key, owner in leases]
        self._call(lambda: self._run_script(self._release_lease, calls, lambda pipe: None))

    def release_lease(self, cache_key: str, owner: str) -> None:
        self._call(lambda: self._release_lease(keys=[self._lease(cache_key)], args=[owner]))

    def renew_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        return bool(self._call(lambda: self._renew_lease(keys=[self._lease(cache_key)], args=[owner, int(ttl * 1000)])))

    def lease_holder(self, cache_key: str) -> str | None:
        return text(self._within_op_timeout(lambda: self.client.get(self._lease(cache_key))))

    # -- metrics ----------------------------------------------------------------------------------
    def apply_metrics(self, batch: MetricsBatch) -> bool:
        """Apply the batch, one script run per shard it touches (pipelined on one server); True when its pass
        part was new. BatchRefused (nothing written) for an invalid batch: it is checked here before any part
        is sent, and each part's script checks its own again against every other sender."""
        problem = batch_problem(batch)
        if problem is not None:
            raise BatchRefused(f"{self.description}: metrics batch {batch.batch_id} refused: {problem}")
        try:
            pass_text = json.dumps(batch.pass_record, sort_keys=True) if batch.pass_record is not None else ""
        except (TypeError, ValueError) as exc:  # not JSON at all: nothing the script could be handed
            raise BatchRefused(f"{self.description}: metrics batch {batch.batch_id} refused: {exc}") from None
        parts = self._metrics_parts(batch, pass_text, self._shard_count(writing=True))

        def run() -> list:
            try:
                return self._run_script(self._apply_metrics, parts, self._keep_shard_count)
            except rex.ResponseError as exc:
                if INVALID_BATCH not in str(exc):
                    raise  # a failure of the tier itself, translated by redis_errors
                raise BatchRefused(f"{self.description}: metrics batch {batch.batch_id} refused: {exc}") from None

        return bool(self._call(run)[0])

    def _keep_shard_count(self, pipe: Any) -> None:
        """Store the shard count again if it is gone (a server restarted without persistence, a FLUSHALL) while
        this process goes on writing every shard: readers learn it from that key."""
        pipe.set(self.keys.metrics_shard_count, self._shard_count(), nx=True)

    def _run_script(
        self, script: Any, calls: Sequence[tuple[list[str], list[str]]], prelude: Callable[[Any], None]
    ) -> list:
        """Run `script` once per (KEYS, ARGV), pipelined after the `prelude` command(s): one round trip on a
        server; on a cluster, one per master that holds a call's slot (redis-py's cluster pipeline refuses
        scripts, so each master gets a pipeline of its own) and one for the prelude, however many calls."""
        if not isinstance(self.client, RedisCluster):
            return _pipelined_script(self.client, script, calls, prelude)
        fill = self.client.pipeline()
        prelude(fill)
        fill.execute()
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, (keys, _) in enumerate(calls):
            node = self.client.get_node_from_key(keys[0])
            by_node.setdefault(node.name, (node, []))[1].append(i)
        results: list = [None] * len(calls)
        for node, indices in by_node.values():
            try:
                replies = _pipelined_script(
                    self.client.get_redis_connection(node), script, [calls[i] for i in indices], lambda pipe: None
                )
            except rex.ResponseError as exc:
                if not str(exc).startswith(("MOVED", "ASK")):
                    raise
                # The slot moved since the client learnt the layout: through the cluster client, which follows.
                replies = [script(keys=calls[i][0], args=calls[i][1]) for i in indices]
            for i, reply in zip(indices, replies, strict=True):
                results[i] = reply
        return results

    def _metrics_parts(self, batch: MetricsBatch, pass_text: str, shards: int) -> list[tuple[list[str], list[str]]]:
        """(KEYS, ARGV) of each shard's script run, the pass part first."""
        home = pass_shard(batch.batch_id, shards)
        by_shard: dict[int, list] = {home: []}
        for key, usage in sorted(batch.keys.items()):
            by_shard.setdefault(key_shard(key, shards), []).append((key, usage))
        parts = []
        for shard, ordered in by_shard.items():
            k = self.keys.metrics_shard(shard)
            keys = [
                k.applied_batch(batch.batch_id),
                k.totals,
                k.workers,
                k.worker_metrics(batch.host, batch.worker),
                k.kernel_calls,
                k.kernel_variants,
                k.key_usage,
                k.key_first,
                k.key_last,
                k.key_kernel,
                k.pass_log,
                k.toolchains,
                k.toolchain_metrics(batch.toolchain),
                *(k.key_hosts(key) for key, _ in ordered),
            ]
            payload = {
                "totals": batch.totals if shard == home else {},
                "kernel_calls": batch.kernel_calls if shard == home else {},
                "keys": [[key, u.kernel_name, u.usage, u.first_use, u.last_use] for key, u in ordered],
                "host": batch.host,
                "member": f"{batch.host}:{batch.worker}",
                "toolchain": batch.toolchain,
                "pass": pass_text if shard == home else "",
                "ttl": APPLIED_MARKER_TTL,
                "maxlen": PASS_LOG_MAXLEN,
                "pass_part": shard == home,
            }
            # default=str: a value JSON cannot hold reaches the script as a string, which it refuses
            parts.append((keys, [json.dumps(payload, default=str)]))
        return parts

    def _shard_count(self, *, writing: bool = False) -> int:
        """The namespace's number of metrics shards. The first writer fixes it: this backend's setting for a new
        namespace, 1 for one whose metrics predate sharding (they are shard 0). A reader of a namespace that no
        batch has reached yet reads 1 shard, and asks again next time."""
        if self._shards is not None:
            return self._shards
        stored = self._call(lambda: self.client.get(self.keys.metrics_shard_count))
        if stored is None and writing:
            old = self.keys.metrics_shard(0)
            before_shards = self._call(lambda: self.client.exists(old.totals) or self.client.exists(old.key_usage))
            count = 1 if before_shards else self.metrics_shards
            self._call(lambda: self.client.set(self.keys.metrics_shard_count, count, nx=True))
            stored = self._call(lambda: self.client.get(self.keys.metrics_shard_count))
        if stored is None:
            return 1
        self._shards = shard_count_or(stored, MAX_METRICS_SHARDS, self.metrics_shards, self.keys.metrics_shard_count)
        return self._shards

    def _metric_read(self, read: Callable[[], Any]) -> Any:
        """A read of one metrics key (a set's members, a page of a log); empty where another type stands under
        its name (as `_stream(of_metric=True)`)."""
        with redis_errors(self.description):
            try:
                return read()
            except rex.ResponseError as exc:
                if _wrong_type(exc):
                    return []
                raise

    def _of_metric(self, reply: T | Exception, empty: T) -> T:
        """A pipeline reply of a metrics key read without raising: `empty` where another type stands under its
        name, any other error raised as a TierError."""
        if isinstance(reply, Exception):
            if _wrong_type(reply):
                return empty
            with redis_errors(self.description):
                raise reply
        return reply

    def _metric_shards(self) -> list[MetricsKeys]:
        return [self.keys.metrics_shard(i) for i in range(self._shard_count())]

    # -- fleet metrics (summed over the shards) ----------------------------------------------------
    def _summed_hashes(self, names: Sequence[str]) -> dict[str, float]:
        """Field-wise sums of the hashes `names` (one per shard), read in one pipeline."""
        return _summed(self._hashes(names))

    # The metrics keys each pipeline below reads may be of another type: the reply is then the command's error.
    def _hashes(self, names: Sequence[str]) -> list:
        """HGETALL of each of `names`, in one pipeline."""
        return self._pipeline(lambda pipe: [pipe.hgetall(name) for name in names], raise_on_error=False)

    def _hash_fields(self, names: Sequence[str], fields: list[str]) -> list:
        """HMGET of `fields` in each of `names`, in one pipeline."""
        return self._pipeline(lambda pipe: [pipe.hmget(name, fields) for name in names], raise_on_error=False)

    def _set_members(self, names: Sequence[str]) -> list:
        """SMEMBERS of each of `names`, in one pipeline."""
        return self._pipeline(lambda pipe: [pipe.smembers(name) for name in names], raise_on_error=False)

    def _members(self, name_of: Callable[[MetricsKeys], str]) -> list[str]:
        """The union of one set per shard, sorted."""
        found: set[str] = set()
        for shard in self._metric_shards():
            members = self._stream(partial(self.client.sscan_iter, name_of(shard), count=1000), of_metric=True)
            found.update(text(m) for m in members)
        return sorted(found)

    def totals(self) -> dict[str, float]:
        return self._summed_hashes([shard.totals for shard in self._metric_shards()])

    def workers(self) -> Iterator[tuple[str, str, dict[str, float]]]:
        shards = self._metric_shards()
        # Many workers' hashes per pipeline: one round trip per batch of workers, not per worker.
        for group in batched(self._members(lambda shard: shard.workers), max(1, BATCH // len(shards))):
            pairs = [member.partition(":")[::2] for member in group]
            names = [shard.worker_metrics(host, worker) for host, worker in pairs for shard in shards]
            hashes = iter(self._hashes(names))
            for host, worker in pairs:
                yield host, worker, _summed([next(hashes) for _ in shards])

    def toolchains(self) -> dict[str, dict[str, float]]:
        shards = self._metric_shards()
        return {
            toolchain: self._summed_hashes([shard.toolchain_metrics(toolchain) for shard in shards])
            for toolchain in self._members(lambda shard: shard.toolchains)
        }

    def kernels(self) -> dict[str, dict[str, int]]:
        shards = self._metric_shards()
        calls = self._summed_hashes([shard.kernel_calls for shard in shards])
        # A cache key's usage lives in one shard only, so its variant is counted there once: the sum is exact.
        variants = self._summed_hashes([shard.kernel_variants for shard in shards])
        return {
            name: {"call_count": int(calls.get(name, 0)), "variants": int(variants.get(name, 0))}
            for name in sorted(set(calls) | set(variants))
        }

    def key_usage(self) -> Iterator[tuple[str, int]]:
        for shard in self._metric_shards():
            pairs = self._stream(partial(self.client.hscan_iter, shard.key_usage, count=1000), of_metric=True)
            for key, usage in pairs:
                yield text(key), int(stored_number(usage))

    def key_count(self) -> int:
        lengths = self._pipeline(
            lambda pipe: [pipe.hlen(shard.key_usage) for shard in self._metric_shards()], raise_on_error=False
        )
        return int(sum(self._of_metric(length, 0) for length in lengths))

    def _by_key_shard(self, cache_keys: Sequence[str]) -> Iterator[tuple[MetricsKeys, list[str]]]:
        """The keys grouped by the shard that holds them, in chunks of at most BATCH."""
        count = self._shard_count()
        groups: dict[int, list[str]] = {}
        for key in cache_keys:
            groups.setdefault(key_shard(key, count), []).append(key)
        for shard, keys in sorted(groups.items()):
            for chunk in batched(keys):
                yield self.keys.metrics_shard(shard), chunk

    def key_records(self, cache_keys: Sequence[str]) -> dict[str, KeyRecord]:
        found: dict[str, KeyRecord] = {}
        for k, chunk in self._by_key_shard(cache_keys):
            replies = self._hash_fields((k.key_usage, k.key_kernel, k.key_first, k.key_last), chunk)
            usage, kernel, first, last = (self._of_metric(reply, [None] * len(chunk)) for reply in replies)
            for i, key in enumerate(chunk):
                if usage[i] is not None:
                    found[key] = KeyRecord(
                        key,
                        text(kernel[i]) or "",
                        int(stored_number(usage[i])),
                        stored_number(first[i]),
                        stored_number(last[i]),
                    )
        return found

    def key_hosts(self, cache_keys: Sequence[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for k, chunk in self._by_key_shard(cache_keys):
            members = self._set_members([k.key_hosts(key) for key in chunk])
            for key, hosts in zip(chunk, members, strict=True):
                if self._of_metric(hosts, None):
                    found[key] = sorted(text(h) for h in hosts)
        return found

    @staticmethod
    def _stream_id(since: float | None) -> str:
        return "-" if since is None else str(max(0, int(since * 1000)))

    def pass_log_span(self, since: float | None) -> tuple[float, float] | None:
        spans = []
        start = self._stream_id(since)
        for shard in self._metric_shards():
            first = self._metric_read(partial(self.client.xrange, shard.pass_log, min=start, count=1))
            last = self._metric_read(partial(self.client.xrevrange, shard.pass_log, count=1))
            if first and last:
                spans.append((_record_time(*first[0]), _record_time(*last[0])))
        if not spans:
            return None
        return min(first for first, _ in spans), max(last for _, last in spans)

    def pass_log(self, since: float | None) -> Iterator[tuple[float, dict]]:
        """The shards' logs merged in the order their records were added (each log is in that order); records of
        two shards added in the same millisecond, by the time their passes ended."""
        logs = [self._shard_pass_log(shard, since) for shard in self._metric_shards()]
        for _, when, record in heapq.merge(*logs, key=lambda item: item[0]):
            yield when, record

    def _shard_pass_log(self, shard: MetricsKeys, since: float | None) -> Iterator[tuple[tuple, float, dict]]:
        start = self._stream_id(since)
        while True:
            page = self._metric_read(partial(self.client.xrange, shard.pass_log, min=start, count=1000))
            for stream_id, fields in page:
                record = _pass_record(fields)
                if record is not None:
                    when = _record_time(stream_id, fields)
                    milliseconds, sequence = _stream_order(stream_id)
                    yield (milliseconds, when, sequence), when, record
            if len(page) < 1000:
                return
            start = "(" + text(page[-1][0])

    def zero_counters(self, record: dict) -> None:
        """Zero the fleet counters (totals, per worker, per toolchain) and append `record` to the pass log (of
        shard 0): one script run per shard, each atomic in its shard; entries, key usage, per-kernel counts and
        the pass log are kept."""
        calls = []
        for i, k in enumerate(self._metric_shards()):
            workers = [text(m) for m in self._metric_read(partial(self.client.smembers, k.workers))]
            toolchains = [text(m) for m in self._metric_read(partial(self.client.smembers, k.toolchains))]
            hashes = [k.worker_metrics(*m.partition(":")[::2]) for m in workers]
            hashes += [k.toolchain_metrics(t) for t in toolchains]
            logged = json.dumps(record, sort_keys=True) if i == 0 else ""
            calls.append(([k.pass_log, k.totals, k.workers, k.toolchains, *hashes], [logged, str(PASS_LOG_MAXLEN)]))
        self._call(lambda: self._run_script(self._zero_counters, calls, lambda pipe: None))

    # -- entries ------------------------------------------------------------------------------------
    def scan_entries(self, with_ttl: bool = True) -> Iterator[RawEntry]:
        for page in self.entry_pages():
            yield from self.read_entry_page(page, with_ttl)

    def entry_pages(self, every_partition: bool = False, size: int = BATCH) -> Iterator[list[str]]:
        """The names of this partition's entries (of every partition's: `every_partition`), `size` a page, as
        SCAN finds them; no value is read. `read_entry_page` reads a page, in this process or another one
        (cachestore.scan_split)."""
        pattern = self.keys.entry_pattern(None if every_partition else self.partition)
        # SCAN pages of 10k keys (the server matches them against the pattern): entries are a fraction of a
        # tier's keys (metrics, hosts of each key), and a page of 1k cost a round trip per few hundred entries.
        redis_keys = self._stream(lambda: self.client.scan_iter(match=pattern, count=10_000))
        yield from batched((text(key) or "" for key in redis_keys), size)

    def read_entry_page(self, names: Sequence[str], with_ttl: bool = True) -> list[RawEntry]:
        """The entries of a page of `entry_pages` still stored, each with the partition its name says (this
        reader's own for a name in it)."""
        found = []
        for redis_key, (data, ttl) in zip(names, self._read_entries(names, with_ttl=with_ttl), strict=True):
            if data is not None:
                partition, cache_key = self.keys.parse_entry(redis_key)
                found.append(RawEntry(cache_key, data, ttl if with_ttl else None, partition))
        return found

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        found: dict[str, bytes | TooLarge] = {}
        for start in range(0, len(cache_keys), BATCH):
            chunk = list(cache_keys[start : start + BATCH])
            # No TTLs (one GETRANGE a key, packed).
            values = self._read_entries([self._entry(key) for key in chunk], with_ttl=False)
            found.update((key, value) for key, (value, _) in zip(chunk, values, strict=True) if value is not None)
        return found

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        """Cache keys starting with `prefix` (hex digits in either case narrow the scan; any other prefix is
        matched on every key of the partition), at most `limit`."""
        is_hex = all(c in "0123456789abcdef" for c in prefix.lower())
        prefix = prefix.lower() if is_hex else prefix
        pattern = self.keys.entry_prefix_pattern(self.partition, prefix if is_hex else "")
        found: list[str] = []
        for redis_key in self._stream(lambda: self.client.scan_iter(match=pattern, count=10_000)):
            cache_key = self.keys.parse_entry(text(redis_key) or "")[1]
            if cache_key.startswith(prefix):
                found.append(cache_key)
                if len(found) >= limit:
                    break
        return sorted(found)

    def put_entries(self, items: Sequence[WriteItem]) -> None:
        def fill(pipe: Any) -> None:
            for item in items:
                ttl_ms = max(1, int(item.ttl * 1000))
                pipe.set(self._entry(item.cache_key), item.data, px=ttl_ms)

        if items:
            self._pipeline(fill)

    def delete_entries(self, cache_keys: Sequence[str]) -> None:
        if not cache_keys:
            return
        names = [self._entry(key) for key in cache_keys]
        # And each key's name before issue 16 (keys.legacy_entry), which an upgraded tier may still hold: one DEL
        # a name, as a cluster refuses a DEL of keys in two slots.
        legacy = {self.keys.legacy_entry(self.partition, key) for key in cache_keys} - set(names)
        self._pipeline(lambda pipe: [pipe.delete(name) for name in [*names, *sorted(legacy)]])

    def expired_count(self) -> tuple[int, int]:
        return 0, 0  # Redis drops an entry when it expires

    def purge_expired(self) -> None:
        pass

    def close(self) -> None:
        self._call(self.client.close)


def _pipelined_script(
    client: redis.Redis, script: Any, calls: Sequence[tuple[list[str], list[str]]], prelude: Callable[[Any], None]
) -> list:
    """EVALSHA of `script` per call in one pipeline of a plain client, after the `prelude` command(s); a server
    that lacks the script gets it loaded and runs again only the calls it refused. Any other error is raised."""
    results: list = [None] * len(calls)
    pending = list(range(len(calls)))
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        if attempt == 0:
            prelude(pipe)
        first = len(pipe.command_stack)
        for i in pending:
            keys, args = calls[i]
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        missing = []
        replies = pipe.execute(raise_on_error=False)
        for reply in replies[:first]:
            if isinstance(reply, Exception):
                raise reply
        for i, reply in zip(pending, replies[first:], strict=True):
            if isinstance(reply, rex.NoScriptError) and attempt == 0:
                missing.append(i)
            elif isinstance(reply, Exception):
                raise reply
            else:
                results[i] = reply
        if not missing:
            break
        client.script_load(script.script)
        pending = missing
    return results


def _wrong_type(exc: BaseException) -> bool:
    return isinstance(exc, rex.ResponseError) and str(exc).startswith("WRONGTYPE")


def _unless_error(reply: T | Exception) -> T | None:
    """A pipeline reply read without raising, None for a command's error (a key of another type)."""
    return None if isinstance(reply, Exception) else reply


def _summed(hashes: Sequence[dict | Exception]) -> dict[str, float]:
    """Field-wise sums of hashes as a pipeline read them; a key of another type (its reply an error, when read
    without raising) counts as an empty hash, so that another tool's key fails no report."""
    summed: dict[str, float] = {}
    for values in hashes:
        if isinstance(values, Exception):
            continue
        for field, value in values.items():
            summed[text(field)] = summed.get(text(field), 0.0) + stored_number(value)
    return summed


def _stream_order(stream_id: bytes | str) -> tuple[int, int]:
    milliseconds, _, sequence = (text(stream_id) or "0-0").partition("-")
    return int(milliseconds), int(sequence or 0)


@overload
def text(value: bytes | str) -> str: ...


@overload
def text(value: None) -> None: ...


def text(value: bytes | str | None) -> str | None:
    """A Redis reply as text (redis-py returns bytes unless the client decodes responses)."""
    # Replacing what is not UTF-8: a name written by hand must not fail a whole report or listing.
    return value.decode(errors="backslashreplace") if isinstance(value, bytes) else value


def _pass_record(fields: dict) -> dict | None:
    raw = fields.get(b"pass", fields.get("pass"))
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except (TypeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _record_time(stream_id: bytes | str, fields: dict) -> float:
    """When the pass ended (its record's `finished`), else when it was appended (the stream id)."""
    record = _pass_record(fields) or {}
    return pass_time(record.get("finished"), int(text(stream_id).partition("-")[0]) / 1000)


def open_store(settings: Settings, url: str, *, reading: bool, partition: str | None, writable: bool) -> RedisBackend:
    """The Redis server or cluster `url` names (cachestore.stores); a read-only client only sends it reads."""
    return RedisBackend.open(settings.replace(tier=url), reading=reading, partition=partition)
