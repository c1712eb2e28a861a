"""Every Redis key nkicache uses, built here and nowhere else.

Layout (NS = namespace, V = layout version, TC = toolchain id, see `bridge.identity`):

    NS:vV:tc:TC:entry:{K}        string   encoded entry for cache key KEY (TTL, refreshed on use); K = key_tag(KEY)
    NS:vV:tc:TC:lease:{K}        string   single-flight lease: the tracing worker's id (short TTL)
    NS:vV:variants:{KERNEL}      hash     the variant index of one kernel name (cachestore.variant_index): what
                               each toolchain stored of it, for the cause of a miss (TTL, refreshed on store)
    NS:vV:metrics-shards       string   S, the number of metrics shards (set once, by the first batch)
    {NS:vV:metrics}:...        fleet metrics, shard 0; shard i > 0 is {NS:vV:metrics:i}:... A pass's own
                               counts go to the shard of its batch id, each cache key's to the shard of
                               the key: one script per shard applies the batch's part there
    NS:vV:job-shards           string   J, the number of job shards (set once, by the first submit or worker)
    {NS:vV:jobs}:...           the fleet's job queue, shard 0; shard i > 0 is {NS:vV:jobs:i}:... Each shard
                               holds a stream with a consumer group per toolchain, and the results, failures,
                               counts and dead letters of its jobs, in one slot so job scripts are atomic. A
                               job goes to shard crc32(job id) % J. Shard 0 also holds the hash of toolchains,
                               the worker heartbeats, the batches' job lists, the lists of each batch's
                               finished jobs and each toolchain's wake-up tokens (workers/fleet_wakeups.py)
    NS:vV:artifact:{JOB}       string   a finished job's artifact (TTL job_ttl), in the slot of its job id

K, an entry's and its lease's tag, is the 32 bytes of the cache key (a SHA-256 in hex, as the codegen loop makes
every key) in unpadded base64url: 43 characters instead of 64 (issue 16: the key's name is stored with it, and
Redis rounds the name's allocation up to a size class: 96 bytes instead of 128 here). Its alphabet has no brace
and no glob character. A key that is no SHA-256 hex (tests, hands) is its tag as it is, after a "=" that no
base64url tag holds. Entries an older release stored under the hex key (`entry:{<64 hex>}`) are never read: they
are misses, expire with their TTL, and `delete_entries` removes them with their new name (gc).

The braces are Redis Cluster hash tags: an entry and its lease share a slot (the tag is the cache key), and
every key of a metrics shard shares that shard's slot, which is what lets the part of a batch that goes to a
shard apply atomically and exactly once (each shard keeps its own applied-batch marker). The shards spread
the metrics over a cluster's nodes: with one slot, every pass's batch and every variant's usage sat on one.

A scope other than the trusted one (issue 22: an untrusted writer, `cachestore.credentials.resolve_scope`) is a
partition of its own inside the toolchain's, TC:scope:NAME (`partition`):

    NS:vV:tc:TC:scope:NAME:entry:{KEY}   (and :lease:) an untrusted scope's entries

so a trusted reader never reads them, and they never hold a lease on, replace or evict a trusted entry. The
trusted scope is the toolchain's partition itself: the layout of an existing tier is unchanged. A Redis ACL
user can be limited to untrusted scopes by the key pattern `NS:vV:tc:*:scope:*`.

Keys `NS:vV:tc:TC:digests:B` (hashes) that older builds wrote for content dedupe are not read or written:
they expire on their own.

Entries and leases are partitioned by toolchain: two compilers (a rolling upgrade) share one Redis without
ever reading or evicting each other's binaries, while the fleet
metrics and the job queue stay shared. The specification's SHA-256 stays the cache key inside a partition.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import zlib

import msgspec

LAYOUT_VERSION = 1  # of the key layout; the entry format has its own (cachestore.entry.SCHEMA_VERSION)
# Shards of a new namespace's metrics: on a cluster of tens of nodes, each node holds one or a few.
DEFAULT_METRICS_SHARDS = 64
MAX_METRICS_SHARDS = 1024  # a report reads every shard: more would cost it more than any cluster gains
DEFAULT_JOB_SHARDS = 16  # of a new namespace's job queue: an idle worker polls each once a second
MAX_JOB_SHARDS = 1024


TRUSTED_SCOPE = ""
QUARANTINE_SCOPE = "quarantine"  # entries the determinism sentinel took out of service (workers.sentinel)
_SCOPE_MARK = ":scope:"


def partition(toolchain: str, scope: str = TRUSTED_SCOPE) -> str:
    """The partition of one toolchain's entries in one scope: what a store reads and writes entries and leases
    in (`Backend.partition`, `Reader.partition`)."""
    return toolchain if scope == TRUSTED_SCOPE else f"{toolchain}{_SCOPE_MARK}{scope}"


def split_partition(name: str) -> tuple[str, str]:
    """(toolchain, scope) of a partition; the scope is TRUSTED_SCOPE for a toolchain's own partition."""
    toolchain, _, scope = name.partition(_SCOPE_MARK)
    return toolchain, scope


class KeySpace(msgspec.Struct, frozen=True):
    namespace: str = "nkicache"
    version: int = LAYOUT_VERSION

    @property
    def prefix(self) -> str:
        return f"{self.namespace}:v{self.version}"

    # -- entries (one partition per toolchain and scope, `partition`) ------------------------------
    def entry(self, partition: str, cache_key: str) -> str:
        return f"{self.prefix}:tc:{partition}:entry:{{{key_tag(cache_key)}}}"

    def legacy_entry(self, partition: str, cache_key: str) -> str:
        """Where a release before issue 16 stored the entry: never read, only deleted with the entry."""
        return f"{self.prefix}:tc:{partition}:entry:{{{cache_key}}}"

    def lease(self, partition: str, cache_key: str) -> str:
        return f"{self.prefix}:tc:{partition}:lease:{{{key_tag(cache_key)}}}"

    def variant_index(self, kernel_name: str) -> str:
        """Shared by every toolchain: a miss under one tells `other_toolchain` from `new_variant` by it."""
        return f"{self.prefix}:variants:{{{kernel_name}}}"

    def namespace_patterns(self) -> tuple[str, str]:
        """SCAN patterns that together match every key of this namespace (and layout version): the
        partitioned keys and the hash-tagged metrics and jobs keys."""
        return f"{self.prefix}:*", f"{{{self.prefix}:*"

    def entry_pattern(self, partition: str | None = None) -> str:
        """SCAN pattern of one partition's entries, or of every partition's."""
        return f"{self.prefix}:tc:{partition or '*'}:entry:*"

    def lease_pattern(self, partition: str | None = None) -> str:
        """SCAN pattern of one partition's leases, or of every partition's (`lease` takes a cache key, not a
        pattern: its tag of "*" is "=*")."""
        return f"{self.prefix}:tc:{partition or '*'}:lease:*"

    def entry_partition(self, redis_key: str) -> str:
        """The partition (toolchain, and scope) of an entry's Redis key, as `parse_entry` gives it."""
        return redis_key[len(self.prefix) + len(":tc:") :].partition(":entry:")[0]

    def parse_entry(self, redis_key: str) -> tuple[str, str]:
        """(partition, cache key) of an entry's Redis key."""
        partition, _, tagged = redis_key[len(self.prefix) + len(":tc:") :].partition(":entry:")
        return partition, cache_key_of_tag(tagged[1:-1])

    def entry_prefix_pattern(self, partition: str, hex_prefix: str) -> str:
        """A SCAN pattern matching at least the entries whose cache key starts with `hex_prefix` (hex digits):
        base64 encodes 3 bytes (6 hex digits) as 4 characters, so the pattern holds the whole groups of the
        prefix, and the caller checks the rest of it on the parsed keys."""
        whole = len(hex_prefix) - len(hex_prefix) % 6
        head = base64.urlsafe_b64encode(bytes.fromhex(hex_prefix[:whole])).decode() if whole else ""
        return f"{self.prefix}:tc:{partition}:entry:{{{head}*"

    # -- metrics (S shards, one slot each) ---------------------------------------------------------
    @property
    def metrics_shard_count(self) -> str:
        """The namespace's number of metrics shards, fixed when its first batch is applied (a count that
        changed later would move every cache key's usage to another shard)."""
        return f"{self.prefix}:metrics-shards"

    def metrics_shard(self, shard: int) -> MetricsKeys:
        return MetricsKeys(f"{{{self.prefix}:metrics}}" if shard == 0 else f"{{{self.prefix}:metrics:{shard}}}")

    # -- the fleet's job queue (J shards, one slot each) ---------------------------------------------
    @property
    def job_shard_count(self) -> str:
        """The namespace's number of job shards, fixed by its first submit or worker (a count that changed
        later would send `results_of` to another shard than the one a job was queued in)."""
        return f"{self.prefix}:job-shards"

    def job_shard(self, shard: int) -> JobKeys:
        return JobKeys(f"{{{self.prefix}:jobs}}" if shard == 0 else f"{{{self.prefix}:jobs:{shard}}}")

    @property
    def jobs_tag(self) -> str:
        """Shard 0's tag, which also holds the queue's small shared keys (toolchains, heartbeats, batches)."""
        return self.job_shard(0).tag

    def jobs(self, name: str) -> str:
        return f"{self.jobs_tag}:{name}"

    @property
    def job_toolchains(self) -> str:
        """A hash toolchain -> when a job was last submitted under it: `nkicache queue` finds every stream
        (with a waiting job or not) by one HGETALL, which both ACL users may run, instead of a SCAN."""
        return self.jobs("toolchains")

    @property
    def worker_heartbeats(self) -> str:
        return self.jobs("workers")

    def job_batch(self, batch_id: str) -> str:
        return self.jobs(f"batch:{batch_id}")

    def job_batch_done(self, batch_id: str) -> str:
        """The ids of a batch's jobs as they finish (a list, TTL `job_ttl`): what `submit --wait` blocks on."""
        return self.jobs(f"batch-done:{batch_id}")

    def job_wake(self, toolchain: str) -> str:
        """Wake-up tokens for a toolchain's idle workers (a short list): pushed with each job queued, popped by
        a worker that found no job and blocks for one."""
        return self.jobs(f"wake:{toolchain}")

    def job_traced(self, job_id: str) -> str:
        """The cache keys other workers traced from a job's trace tasks (a set, TTL `job_ttl`): how the job tells
        a trace made for it from another job's it only waited for (workers/trace_tasks.py)."""
        return f"{self.prefix}:traced-for:{{{job_id}}}"

    def job_artifact(self, job_id: str) -> str:
        """A finished job's artifact (TTL `job_ttl`), tagged by its job id: artifacts, up to megabytes each,
        spread over a cluster's masters instead of all sitting on the jobs slot's one."""
        return f"{self.prefix}:artifact:{{{job_id}}}"


class JobKeys(msgspec.Struct, frozen=True):
    """The keys of one job shard, all in its hash slot (`tag`): its toolchains' streams (with their consumer
    groups), the results, failure counts and dead letters of its jobs, and its counts. Everything the complete,
    fail and requeue scripts touch for a job is here, so they stay atomic. Shard 0 is the tag of the layout
    before sharding, so a queue from then reads as shard 0."""

    tag: str

    def stream(self, toolchain: str) -> str:
        """The stream (with its consumer group) of this shard's jobs submitted under one toolchain: a worker
        reads only its own compiler's streams, so it never compiles a job that another compiler submitted."""
        return f"{self.tag}:stream:{toolchain}"

    def result(self, job_id: str) -> str:
        """A finished job's result (a JSON string with a TTL): its own key, so results expire one by one."""
        return f"{self.tag}:result:{job_id}"

    def result_pattern(self) -> str:
        return f"{self.tag}:result:*"

    @property
    def dead_letters(self) -> str:
        return f"{self.tag}:dead-letter"

    @property
    def failures(self) -> str:
        return f"{self.tag}:failures"

    @property
    def counts(self) -> str:
        return f"{self.tag}:counts"


class MetricsKeys(msgspec.Struct, frozen=True):
    """The keys of one metrics shard, all in its hash slot (`tag`), so that one script applies a batch's part
    atomically. Shard 0 is the tag of the layout before sharding, so a namespace from then reads as 1 shard."""

    tag: str

    def metrics(self, name: str) -> str:
        return f"{self.tag}:{name}"

    def applied_batch(self, batch_id: str) -> str:
        return self.metrics(f"applied:{batch_id}")

    def worker_metrics(self, host: str, worker: str) -> str:
        return self.metrics(f"worker:{host}:{worker}")

    def key_hosts(self, cache_key: str) -> str:
        return self.metrics(f"key-hosts:{cache_key}")

    @property
    def totals(self) -> str:
        return self.metrics("totals")

    @property
    def workers(self) -> str:
        return self.metrics("workers")

    @property
    def kernel_calls(self) -> str:
        return self.metrics("kernel-calls")

    @property
    def kernel_variants(self) -> str:
        return self.metrics("kernel-variants")

    @property
    def key_usage(self) -> str:
        return self.metrics("key-usage")

    @property
    def key_first(self) -> str:
        return self.metrics("key-first")

    @property
    def key_last(self) -> str:
        return self.metrics("key-last")

    @property
    def key_kernel(self) -> str:
        return self.metrics("key-kernel")

    @property
    def pass_log(self) -> str:
        return self.metrics("pass-log")

    @property
    def toolchains(self) -> str:
        """The set of toolchain ids whose passes applied a batch."""
        return self.metrics("toolchains")

    def toolchain_metrics(self, toolchain: str) -> str:
        """One toolchain's totals (a hash, like a worker's)."""
        return self.metrics(f"toolchain:{toolchain}")


def pass_shard(batch_id: str, shards: int) -> int:
    """The shard of a pass's own counts (totals, worker, toolchain, kernel calls, pass log): a function of
    the batch id, so a retried batch goes where its first attempt went."""
    return zlib.crc32(batch_id.encode()) % shards


def key_shard(cache_key: str, shards: int) -> int:
    """The one shard holding everything about a cache key (usage, first/last use, kernel, hosts), so a
    variant is counted once and per-key data is split S ways."""
    return zlib.crc32(cache_key.encode()) % shards


def job_shard(job_id: str, shards: int) -> int:
    """The shard a job is queued in, and so holds its result: a function of the job id alone, so that
    `results_of` and `job show` find it without a lookup."""
    return zlib.crc32(job_id.encode()) % shards


# 32 bytes in unpadded base64url: 42 characters of 6 bits, then one holding the last 4 bits and two zero bits.
_KEY_TAG = re.compile(r"[A-Za-z0-9_-]{42}[AEIMQUYcgkosw048]")


def key_tag(cache_key: str) -> str:
    """An entry's and its lease's hash tag: a SHA-256 hex cache key in 43 characters of unpadded base64url,
    any other key as "=" and its text."""
    raw = sha256_raw(cache_key)
    if raw is None:
        return "=" + cache_key
    return binascii.b2a_base64(raw, newline=False)[:43].translate(_TO_URLSAFE).decode()  # (43: no "=" padding)


def cache_key_of_tag(tag: str) -> str:
    """The cache key a tag names (`key_tag`); a tag of neither form (an older release's hex key, a hand's) as
    it is."""
    if tag.startswith("="):
        return tag[1:]
    # Decoding alone would drop characters out of the alphabet and accept a last character whose two unused bits
    # are set: only the one tag key_tag gives a key names it (a regular expression, not a second encoding: every
    # entry of a scan is parsed).
    if _KEY_TAG.fullmatch(tag):
        # binascii without base64's checks and copies: the expression has checked the alphabet (1.4 -> 0.8 µs a key,
        # every key of a scan).
        return binascii.a2b_base64(tag.encode().translate(_FROM_URLSAFE) + b"=").hex()
    return tag


_FROM_URLSAFE = bytes.maketrans(b"-_", b"+/")
_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")


def sha256_raw(text: str) -> bytes | None:
    """The 32 raw bytes of a SHA-256 hex text (64 lowercase hex digits, nothing else), None for any other text.
    bytes.fromhex and hex() tell the two apart in fewer calls than a regular expression and a second decoding:
    every remote hit names its entry by its key's tag."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        return None
    return raw if len(raw) == 32 and raw.hex() == text else None


logger = logging.getLogger(__name__)
_REPORTED: set[tuple[str, str]] = set()  # (key, value) of the invalid shard counts this process warned of


def shard_count_or(stored: bytes | str, maximum: int, configured: int, name: str) -> int:
    """The shard count the key `name` holds; `configured` (this process's setting) when it holds no count from 1
    to `maximum`, with one warning per process. Any writer of the key (a hand, another tool, the untrusted ACL
    user) could write one: taking the setting every process of the fleet shares reads and writes the same
    shards it would for a new namespace, instead of failing every report, scrape and metrics batch."""
    count = stored_shard_count(stored, maximum)
    if count is not None:
        return count
    shown = stored.decode(errors="backslashreplace") if isinstance(stored, bytes) else stored
    if (name, shown) not in _REPORTED:
        _REPORTED.add((name, shown))
        logger.warning(
            "%s holds %r, not a shard count from 1 to %d; using the setting, %d (set the key to the "
            "fleet's count to silence this)",
            name,
            shown[:40],
            maximum,
            configured,
        )
    return configured


def stored_shard_count(stored: bytes | str, maximum: int) -> int | None:
    """The shard count a stored value (metrics-shards, job-shards) holds; None when it is no count from 1 to
    `maximum` (a hand or another tool wrote it)."""
    try:
        count = int(stored)
    except ValueError:
        return None
    return count if 1 <= count <= maximum else None
