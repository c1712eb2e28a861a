"""The Redis tier: a single server (redis://, rediss://, unix://) or a Redis Cluster (redis+cluster://).

Entries are plain strings read with GETEX (one round trip, TTL refreshed on use). Stores run in the
background flusher and take up to three pipelined round trips to keep identical binaries stored once. Fleet
metrics are applied by one Lua script per batch, guarded by a per-batch marker so a retried batch counts
once; every metrics key shares one hash slot (see `cachestore.keys`) so the script is legal on a cluster.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote

import redis
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from cachestore.keys import KeySpace
from cachestore.tier import MetricsBatch, StoreRequest, TierTimeout, TierUnavailable

T = TypeVar("T")
APPLIED_MARKER_TTL = 7 * 24 * 3600  # seconds a batch id is remembered; retries come far sooner
PASS_LOG_MAXLEN = 1_000_000

# KEYS[1] applied-batch marker   KEYS[2] totals           KEYS[3] workers set     KEYS[4] this worker's totals
# KEYS[5] kernel call counts     KEYS[6] kernel variants  KEYS[7] key usage       KEYS[8] key first use
# KEYS[9] key last use           KEYS[10] key -> kernel   KEYS[11] pass log       KEYS[11+i] hosts of key i
# ARGV[1] JSON {totals, kernel_calls, keys: [[key, kernel, usage, first, last]...], host, member, pass, ttl}
APPLY_METRICS_LUA = """
local p = cjson.decode(ARGV[1])
if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', p.ttl) then return 0 end
for name, value in pairs(p.totals) do
  redis.call('HINCRBYFLOAT', KEYS[2], name, value)
  redis.call('HINCRBYFLOAT', KEYS[4], name, value)
end
redis.call('SADD', KEYS[3], p.member)
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
  redis.call('SADD', KEYS[11 + i], p.host)
end
if p.pass ~= '' then
  redis.call('XADD', KEYS[11], 'MAXLEN', '~', p.maxlen, '*', 'pass', p.pass)
end
return 1
"""

# KEYS[1] lease key   ARGV[1] owner: delete the lease only if this owner still holds it.
RELEASE_LEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
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


def _cluster_node(part: str, url: str) -> ClusterNode:
    host, _, port = part.rpartition(":")
    if not host or not port.isdigit():
        raise TierUnavailable(f"bad cluster node {part!r} in {url}; expected host:port")
    return ClusterNode(host, int(port))


class RedisTier:
    """A tier backend over a redis-py client (Redis, RedisCluster, or fakeredis in unit tests)."""

    def __init__(self, client: Any, keys: KeySpace, description: str = "redis"):
        self.client = client
        self.keys = keys
        self.description = description
        self._apply_metrics = client.register_script(APPLY_METRICS_LUA)
        self._release_lease = client.register_script(RELEASE_LEASE_LUA)

    def __repr__(self) -> str:
        return f"RedisTier({self.description})"

    def _call(self, operation: Callable[[], T]) -> T:
        try:
            return operation()
        except rex.TimeoutError as exc:
            raise TierTimeout(f"{self.description}: timed out: {exc}") from None
        except (rex.RedisError, rex.RedisClusterException, OSError) as exc:  # the latter is no RedisError
            raise TierUnavailable(f"{self.description}: {type(exc).__name__}: {exc}") from None

    def _pipeline(self, fill: Callable[[Any], None]) -> list:
        def run() -> list:
            pipe = self.client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()

        return self._call(run)

    # -- entries ----------------------------------------------------------------------------------
    def fetch(self, cache_keys: Sequence[str], ttl: int) -> dict[str, bytes]:
        if len(cache_keys) == 1:
            value = self._call(lambda: self.client.getex(self.keys.entry(cache_keys[0]), ex=ttl))
            return {} if value is None else {cache_keys[0]: value}
        values = self._pipeline(lambda pipe: [pipe.getex(self.keys.entry(key), ex=ttl) for key in cache_keys])
        return {key: value for key, value in zip(cache_keys, values, strict=True) if value is not None}

    def store(self, requests: Sequence[StoreRequest], ttl: int) -> None:
        if not requests:
            return
        claims = self._pipeline(
            lambda pipe: [
                (
                    pipe.set(self.keys.digest(r.digest), r.cache_key, nx=True, ex=ttl),
                    pipe.get(self.keys.digest(r.digest)),
                )
                for r in requests
            ]
        )
        holders = [_text(claims[2 * i + 1]) for i in range(len(requests))]
        others = [(r, holder) for r, holder in zip(requests, holders, strict=True) if holder not in (None, r.cache_key)]
        alive = self._pipeline(lambda pipe: [pipe.exists(self.keys.entry(h)) for _, h in others]) if others else []
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
                    pipe.set(self.keys.entry(r.cache_key), r.reference(referenced[r.cache_key]), ex=ttl)
                else:
                    pipe.set(self.keys.entry(r.cache_key), r.full, ex=ttl)
                    pipe.set(self.keys.digest(r.digest), r.cache_key, ex=ttl)

        self._pipeline(write)

    def scan_entries(self) -> Iterator[tuple[str, bytes]]:
        """Streams: SCAN a page of keys, read their values with one pipeline, hand them out, go on."""
        keys = self.client.scan_iter(match=self.keys.entry_pattern(), count=1000)
        while True:
            batch = self._call(lambda: [_text(k) or "" for k in itertools.islice(keys, 500)])
            if not batch:
                return
            yield from self._values(batch)

    def _values(self, redis_keys: list[str]) -> Iterator[tuple[str, bytes]]:
        if not redis_keys:
            return
        values = self._pipeline(lambda pipe: [pipe.get(key) for key in redis_keys])
        for redis_key, value in zip(redis_keys, values, strict=True):
            if value is not None:
                yield self.keys.cache_key_of_entry(redis_key), value

    # -- single flight ----------------------------------------------------------------------------
    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        return bool(self._call(lambda: self.client.set(self.keys.lease(cache_key), owner, nx=True, px=int(ttl * 1000))))

    def release_lease(self, cache_key: str, owner: str) -> None:
        self._call(lambda: self._release_lease(keys=[self.keys.lease(cache_key)], args=[owner]))

    def lease_holder(self, cache_key: str) -> str | None:
        return _text(self._call(lambda: self.client.get(self.keys.lease(cache_key))))

    # -- metrics ----------------------------------------------------------------------------------
    def apply_metrics(self, batch: MetricsBatch) -> bool:
        k = self.keys
        ordered = sorted(batch.keys.items())
        keys = [
            k.applied_batch(batch.batch_id), k.totals, k.workers, k.worker_metrics(batch.host, batch.worker),
            k.kernel_calls, k.kernel_variants, k.key_usage, k.key_first, k.key_last, k.key_kernel, k.pass_log,
            *(k.key_hosts(key) for key, _ in ordered),
        ]  # fmt: skip
        payload = {
            "totals": batch.totals,
            "kernel_calls": batch.kernel_calls,
            "keys": [[key, u.kernel_name, u.usage, u.first_use, u.last_use] for key, u in ordered],
            "host": batch.host,
            "member": f"{batch.host}:{batch.worker}",
            "pass": json.dumps(batch.pass_record, sort_keys=True) if batch.pass_record is not None else "",
            "ttl": APPLIED_MARKER_TTL,
            "maxlen": PASS_LOG_MAXLEN,
        }
        return bool(self._call(lambda: self._apply_metrics(keys=keys, args=[json.dumps(payload)])))

    def ping(self) -> None:
        self._call(self.client.ping)

    def close(self) -> None:
        self._call(self.client.close)


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value
