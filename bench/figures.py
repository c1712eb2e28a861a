"""The performance goals of nkicache, measured as ratios side by side in one run (`nkicache bench`).

Every figure is the median of several repetitions, and every ratio compares two things measured in the
same process, against the same server, minutes apart at most, so a noisy shared machine moves both sides.
bench/RESULTS.md records a full run and what the figures mean.
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from bench.miss_causes import miss_cause_coverage
from bench.timed_store import TimedStore
from bridge.codegen import BirCodeGenLoop
from bridge.errors import NkiCacheError
from bridge.graph import Graph, load_graph
from bridge.ir import BasicBlock, InternalNkiKernel
from bridge.key_rule import canonical_text
from bridge.targets import make_target
from cachestore import entry as entry_module
from cachestore.credentials import settings_credentials
from cachestore.keys import KeySpace
from cachestore.settings import load_settings
from cachestore.stores import level_backend, open_tier, tier_client
from cachestore.tier_urls import redact_url
from cachestore.trust import TrustPolicy

GOALS = {
    # What a user feels, whole processes (bench.processes): the project's performance goals.
    "warm_compile_local_vs_floor": ("max", 2.0),
    "warm_compile_redis_vs_floor": ("max", 2.0),
    "warm_compile_s3_vs_floor": ("max", 2.0),
    "version_vs_goal": ("max", 1.0),
    "exec_startup_overhead_ms": ("max", 60.0),
    "broken_tier_overhead": ("max", 1.1),
    "mid_compile_fault_overhead": ("max", 1.15),
    "fleet_job_latency_vs_local": ("max", 1.2),
    "flood_jobs_per_second": ("min", 231.0),  # 2 workers, f84cae3's 10,000-job flood: no lower than then
    # In-process ratios: diagnostics of where time goes inside one process.
    "warm_speedup": ("min", 100.0),
    "warm_speedup_redis": ("min", 50.0),
    "mirror_overhead": ("max", 1.03),
    "mirror_overhead_direct": ("max", 1.005),
    "remote_hit_vs_raw_get": ("max", 1.5),  # a floor: a hit is a GET plus its checks and decode
    "pool_scaling": ("min", 1.7),
    "single_graph_scaling": ("min", 1.7),
    "fleet_single_graph_scaling": ("min", 1.6),
    "storage_ratio": ("max", 0.15),
    "wire_bytes_ratio": ("max", 0.15),
    "upgrade_first_pass_hit_rate": ("min", 0.99),
    "miss_cause_coverage": ("min", 0.95),
    "miss_classification_overhead": ("max", 1.02),
    "l1_redis_read_reduction": ("min", 0.9),
    "value_retention_ratio": ("min", 1.3),
}

# pool_scaling, report_seconds_100k and the fleet figures run the scripts beside this module (bench/NAME.py).
BENCH_SCRIPTS = Path(__file__).resolve().parent


class MeasurementSkipped(NkiCacheError):
    """A measurement that cannot run here; the message is the one-line reason."""


class BenchConfig(msgspec.Struct):
    models: int = 12
    seed: int = 0
    repeats: int = 5
    quick: bool = False
    process_rounds: int = 5  # timed runs of each whole process (bench.processes), after a warm-up

    @classmethod
    def for_mode(cls, quick: bool) -> BenchConfig:
        return cls(models=6, repeats=3, quick=True) if quick else cls()


def median_seconds(function: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def workload_graphs(directory: Path, config: BenchConfig) -> list[Graph]:
    from workers.workload import generate_workload

    return [load_graph(p) for p in generate_workload(directory, config.models, config.seed)]


def compile_all(graphs: list[Graph], tier: Any) -> tuple[int, list[BasicBlock]]:
    """Compile every graph in this process, one fresh loop per pass; returns (traces, basic blocks)."""
    traces, blocks = 0, []
    for graph in graphs:
        loop = BirCodeGenLoop(make_target(graph.target or "Trn2"), tier=tier)
        blocks.append(loop.run(graph))
        traces += loop.traces
    return traces, blocks


def tier_settings(url: str, mode: str = "read-through", namespace: str = "nkibench") -> Any:
    return load_settings({"tier": url, "tier_mode": mode, "namespace": namespace, "single_flight": False})


# -- 1. warm_speedup (local tier) and warm_speedup_redis ----------------------------------------------
def warm_speedup(graphs: list[Graph], config: BenchConfig, work: Path) -> dict:
    return _warm_against(graphs, config, tier_settings(f"local:{work / 'warm.sqlite'}"))


def warm_speedup_redis(graphs: list[Graph], config: BenchConfig, redis_url: str) -> dict:
    measured = _warm_against(graphs, config, tier_settings(redis_url, namespace="nkibench-warm"))
    return {f"{name}_redis" if name == "warm_speedup" else name: value for name, value in measured.items()}


def _warm_against(graphs: list[Graph], config: BenchConfig, settings: Any) -> dict:
    """The workload compiled with no tier / the same with a warm tier of these settings (0 traces)."""
    cold = median_seconds(lambda: compile_all(graphs, None), config.repeats)
    tier = open_tier(settings)
    try:
        compile_all(graphs, tier)  # populate
        tier.flush(30)
        warm_traces = compile_all(graphs, tier)[0]
        warm = median_seconds(lambda: compile_all(graphs, tier), config.repeats)
    finally:
        tier.close()
    return {"warm_speedup": cold / warm, "cold_seconds": cold, "warm_seconds": warm, "warm_traces": warm_traces}


# -- 2. mirror_overhead ---------------------------------------------------------------------------
def mirror_overhead(graphs: list[Graph], config: BenchConfig, redis_url: str) -> dict:
    tier = open_tier(tier_settings(redis_url, mode="mirror", namespace="nkibench-mirror"))
    off, mirror = [], []
    try:
        compile_all(graphs, tier)  # connect, load the scripts, warm the allocator: not part of the ratio
        # ABBA order: the first run of a pair is measurably slower here, whichever it is, so each side takes
        # both positions equally often.
        for i in range(2 * config.repeats):
            order = [(off, None), (mirror, tier)] if i % 2 == 0 else [(mirror, tier), (off, None)]
            for samples, target in order:
                samples.append(median_seconds(lambda target=target: compile_all(graphs, target), 1))
    finally:
        tier.close()
    # The same overhead without the machine's noise: the time the compiling thread itself spends in tier
    # calls (publish and the pass record queue; the pass does not wait for the sends), over a compile without a tier.
    # A median of `repeats` runs, as every other figure (one run was the whole figure before 2026-12-01 12:40: a
    # single wait for the GIL of a few ms moved it by 0.002), each into an emptied namespace; every run is kept.
    settings = tier_settings(redis_url, mode="mirror", namespace="nkibench-mirror2")
    runs = []
    for _ in range(config.repeats):
        drop_namespaces(redis_url, ["nkibench-mirror2"])
        runs.append(_time_in_tier_calls(graphs, settings))
    spent = statistics.median(runs)
    off_median = statistics.median(off)
    return {
        "mirror_overhead": statistics.median(mirror) / off_median,
        "off_seconds": off_median,
        "mirror_seconds": statistics.median(mirror),
        "tier_seconds_in_compile_thread": spent,
        "tier_seconds_in_compile_thread_runs": runs,
        "mirror_overhead_direct": 1 + spent / off_median,
    }


def _time_in_tier_calls(graphs: list[Graph], settings: Any) -> float:
    """Seconds the compiling thread spends in every call the loop makes into a mirror tier."""
    tier = open_tier(settings)
    timed = TimedStore(tier)
    try:
        compile_all(graphs, timed)
    finally:
        tier.close()
    return timed.total


# -- 3. remote_hit_vs_raw_get ---------------------------------------------------------------------
def remote_hit_vs_raw_get(graphs: list[Graph], config: BenchConfig, redis_url: str) -> dict:
    import redis

    settings = tier_settings(redis_url, namespace="nkibench-hit")
    tier = open_tier(settings)
    raw = redis.Redis.from_url(redis_url)
    keys_space = KeySpace(settings.namespace)
    try:
        compile_all(graphs, tier)
        tier.flush(30)
        full = [raw.cache_key for raw in tier._backend.scan_entries()]  # every stored cache key
        loop = BirCodeGenLoop(make_target("Trn2"))
        rounds = max(1, 2000 // max(1, len(full)))

        def interleaved() -> tuple[list[float], list[float], list[float]]:
            """Each key: one remote hit, one raw GET of the same bytes (redis-py's `get`), and the same bytes read
            by redis-py's `getrange` (the command the hit sends), timed one by one, so the loopback's ups and downs
            fall on all three alike."""
            hit_times, get_times, getrange_times = [], [], []
            for _ in range(rounds):
                for key in full:
                    redis_key = keys_space.entry(tier._partition, key)
                    started = time.perf_counter()
                    entry = tier.lookup(key)
                    loop._cache_new_nki_frontend_binary(key, entry.trace_result(), entry.key_components)
                    middle = time.perf_counter()
                    raw.get(redis_key)
                    last = time.perf_counter()
                    raw.getrange(redis_key, 0, -1)
                    hit_times.append(middle - started)
                    get_times.append(last - middle)
                    getrange_times.append(time.perf_counter() - last)
            return hit_times, get_times, getrange_times

        def batched() -> None:
            for _ in range(rounds):
                for key, entry in tier.find_many(full)[0].items():
                    loop._cache_new_nki_frontend_binary(key, entry.trace_result(), entry.key_components)

        def raw_batched() -> None:
            for _ in range(rounds):
                raw.mget([keys_space.entry(tier._partition, key) for key in full])

        count = rounds * len(full)
        hit_times, get_times, getrange_times = interleaved()
        hit, get, getrange = (statistics.median(times) for times in (hit_times, get_times, getrange_times))
        result = {
            "remote_hit_vs_raw_get": hit / get,
            "remote_hit_us": hit * 1e6,
            "raw_get_us": get * 1e6,
            "raw_getrange_us": getrange * 1e6,
            "remote_hit_vs_raw_getrange": hit / getrange,
            "entries": len(full),
        }
        many = median_seconds(batched, config.repeats) / count
        raw_many = median_seconds(raw_batched, config.repeats) / count
        result.update(batched_hit_us=many * 1e6, batched_vs_raw_mget=many / raw_many)
        return result
    finally:
        tier.close()
        raw.close()


# -- signature_overhead (issue 22) ----------------------------------------------------------------------
def signature_overhead(graphs: list[Graph], config: BenchConfig, redis_url: str, work: Path) -> dict:
    """The time a trusted reader spends checking writers' signatures / the time of its remote hits, measured in
    the same reads, on entries a writer with an Ed25519 key stored by compiling the workload, a pass a graph
    (each entry signed alone). The headline `signature_overhead` is the worse of two first-hit figures, every hit
    an entry's first in its process (a reader with a fresh trust policy, so an empty memo of verified
    signatures):

    - `signature_overhead_prefetch`: a fresh reader compiles the workload graph by graph, as a worker does:
      each pass's prefetch reads the graph's variants in one round trip; the time is that of the tier's reads
      (fetch, verify, decode), per entry found.
    - `signature_overhead_first_hit`: a fresh reader hits every full entry one lookup at a time, in the order
      the tier lists them (the time of each lookup, plus handing it to the loop).

    `signature_overhead_hit_again`: the same lookups again in the same process (the memos answer).
    `signature_overhead_big_pass`: the prefetch figure when the writer stores, and the reader reads, one large
    graph (bench/pool_scaling.py's one-big-model, one pass). Each figure comes with its verifies per hit.

    The check time is every writer-signature check the reader makes (`TimedTrust`, its trust policy's `check`):
    each entry's memo lookup and, on a first hit, its verify (50-120 us).

    One reader's first-hit ratio swings with whatever else the machine runs at that moment: each first-hit
    figure is measured with FRESH_READERS fresh readers, one after another, and is the
    median of their ratios; every reader's ratio is kept beside it (`*_runs`), the worst included."""
    from cachestore.trust import write_writer_key

    drop_namespaces(redis_url, SIGNATURE_NAMESPACES)  # a run before this one left entries of another key
    key = write_writer_key(work / "bench-writer.key", "bench")
    policy = work / "bench-trust.toml"
    policy.write_text(key.policy_entry("bench"))
    settings = tier_settings(redis_url, namespace=SIGNATURE_NAMESPACES[0]).replace(trust_policy=str(policy))
    writer = open_tier(settings.replace(writer_key_file=str(work / "bench-writer.key")))
    reader_settings = settings.replace(tier_mode="read-only")
    try:
        compile_all(graphs, writer)
        writer.flush(30)
        stored = {raw.cache_key: raw.data for raw in writer._backend.scan_entries()}
        full = list(stored)
        prefetch = _median_run([_first_pass_reads(graphs, reader_settings) for _ in range(FRESH_READERS)])
        lookups = _lookup_rounds(full, reader_settings, max(2, 1000 // max(1, len(full))))
        more = [_lookup_rounds(full, reader_settings, 1) for _ in range(FRESH_READERS - 1)]
    finally:
        writer.close()
    big = _big_pass(settings.replace(namespace=SIGNATURE_NAMESPACES[1]), work)
    again = lookups["rounds"][1:]
    first_hit = _median_run([{**_overhead(run["rounds"][0]), "run": run} for run in [lookups, *more]])
    lookups = {**first_hit.pop("run"), "rejected": sum(run["rejected"] for run in [lookups, *more])}
    hit_again = _overhead([hit for rounds in again for hit in rounds])
    worst_is_prefetch = prefetch["overhead"] >= first_hit["overhead"]
    first_verifies = lookups["first_verifies"] / max(1, len(full))
    result = {
        "signature_overhead": max(prefetch["overhead"], first_hit["overhead"]),
        "verifies_per_hit": prefetch["verifies_per_hit"] if worst_is_prefetch else first_verifies,
        "signature_overhead_prefetch": prefetch["overhead"],
        "signature_overhead_first_hit": first_hit["overhead"],
        "signature_overhead_hit_again": hit_again["overhead"],
        "signature_overhead_prefetch_runs": prefetch["runs"],
        "signature_overhead_first_hit_runs": first_hit["runs"],
        "signature_overhead_big_pass": big.get("overhead"),
        **{f"prefetch_{name}": value for name, value in prefetch.items() if name not in ("overhead", "runs")},
        **{f"big_pass_{name}": value for name, value in big.items() if name != "overhead"},  # its runs too
        "first_hit_verifies_per_hit": first_verifies,
        "first_hit_us": first_hit["hit_us"],
        "first_check_us": first_hit["check_us"],
        "hit_us": hit_again["hit_us"],
        "memo_check_us": hit_again["check_us"],
        "entries": len(full),
        "rounds": len(again) + 1,
        "rejected": prefetch["rejected"] + lookups["rejected"],
    }
    signed = [data for data in stored.values() if entry_module.writer_of(data)]
    return {**result, "signed": len(signed), "entry_bytes": statistics.mean(map(len, stored.values())) if stored else 0}


SIGNATURE_NAMESPACES = ("nkibench-sig", "nkibench-sig-big")
FRESH_READERS = 5  # fresh readers a first-hit figure is the median of


def _median_run(runs: list[dict]) -> dict:
    """The run of median `overhead` (the upper one of an even count), with every run's overhead as `runs`."""
    ranked = sorted(runs, key=lambda run: run["overhead"])
    return {**ranked[len(ranked) // 2], "runs": [run["overhead"] for run in runs]}


def _big_pass(settings: Any, work: Path) -> dict:
    """The writer compiles bench/pool_scaling.py's one large graph in one pass, a fresh reader reads it: the
    prefetch figures."""
    import importlib.util

    script = BENCH_SCRIPTS / "pool_scaling.py"
    spec = importlib.util.spec_from_file_location("nkibench_pool_scaling", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    graph = load_graph(module.big_graph(work / "big"))
    writer = open_tier(settings.replace(writer_key_file=str(work / "bench-writer.key")))
    try:
        compile_all([graph], writer)
        writer.flush(30)
    finally:
        writer.close()
    reads = [_first_pass_reads([graph], settings.replace(tier_mode="read-only")) for _ in range(FRESH_READERS)]
    return _median_run(reads)


class TimedTrust(TrustPolicy):
    """A copy of a trust policy (the same writers, an empty memo) that adds the seconds each of its signature
    checks takes to `seconds`: the memo lookup and, when the memo does not answer, the Ed25519 verify. Handed to
    a reader as its trust policy (`timed_reader`), so nothing of the reader is patched."""

    def __init__(self, policy: TrustPolicy) -> None:
        super().__init__(list(policy.writers.values()), policy.source)
        self.seconds = 0.0

    def check(self, key_id: bytes, message: bytes, signature: bytes) -> str | None:
        started = time.perf_counter()
        try:
            return super().check(key_id, message, signature)
        finally:
            self.seconds += time.perf_counter() - started


def timed_reader(reader_settings: Any) -> tuple[Any, TimedTrust]:
    """A client of these settings opened as open_tier opens one, with the settings' trust policy timed: (the
    client, its TimedTrust)."""
    credentials = settings_credentials(reader_settings)
    trust = TimedTrust(credentials.trust)
    credentials = msgspec.structs.replace(credentials, trust=trust)
    backend = level_backend(reader_settings, credentials)
    return tier_client(backend, reader_settings, redact_url(reader_settings.tier), credentials), trust


def _first_pass_reads(graphs: list[Graph], reader_settings: Any) -> dict:
    """A fresh reader compiles every graph once; the seconds in its tier reads and, within them, in signature
    checks, the Ed25519 verifies, and the entries it found."""
    reader, trust = timed_reader(reader_settings)
    try:
        timed = TimedStore(reader)
        compile_all(graphs, timed)
        reads = timed.seconds["find_traces"]
        counts = reader.counts()
        hits = max(1, counts["entries_found"])
        return {
            "overhead": trust.seconds / reads,
            "hit_us": reads * 1e6 / hits,
            "check_us": trust.seconds * 1e6 / hits,
            "verifies_per_hit": trust.verifies / hits,
            "hits": counts["entries_found"],
            "rejected": counts["tier_rejected"],
        }
    finally:
        reader.close()


def _lookup_rounds(full: list[str], reader_settings: Any, rounds: int) -> dict:
    """A fresh reader looks every key of `full` up, one at a time, `rounds` times: per round, per lookup,
    (seconds of the hit, seconds in its signature check)."""
    reader, trust = timed_reader(reader_settings)
    try:
        loop = BirCodeGenLoop(make_target("Trn2"))
        measured, first_verifies = [], 0
        for _ in range(rounds):
            times = []
            for cache_key in full:
                trust.seconds = 0.0
                started = time.perf_counter()
                entry = reader.lookup(cache_key)
                loop._cache_new_nki_frontend_binary(cache_key, entry.trace_result(), entry.key_components)
                times.append((time.perf_counter() - started, trust.seconds))
            measured.append(times)
            first_verifies = first_verifies or trust.verifies
        return {"rounds": measured, "first_verifies": first_verifies, "rejected": reader.counts()["tier_rejected"]}
    finally:
        reader.close()


def _overhead(hits: list[tuple[float, float]]) -> dict:
    """Check time / hit time over these (hit, check) seconds: the sums' ratio (a first verify is rare and
    large, so a median would hide it), and the means in microseconds."""
    hit, check = sum(h for h, _ in hits), sum(c for _, c in hits)
    return {"overhead": check / hit, "hit_us": hit / len(hits) * 1e6, "check_us": check / len(hits) * 1e6}


# -- 4. local_hit_us and 5. key_throughput_ratio ---------------------------------------------------
def local_hit_cost(graphs: list[Graph], config: BenchConfig) -> dict:
    op = next(op for g in graphs for op in g.ops if isinstance(op, InternalNkiKernel))
    loop = BirCodeGenLoop(make_target("Trn2"))
    bb = BasicBlock()
    loop.codegenInternalNativeNkiKernel(op, bb)  # the miss that fills the cache
    rounds = 20_000 if not config.quick else 5_000

    def hits() -> None:
        for _ in range(rounds):
            loop.codegenInternalNativeNkiKernel(op, bb)
            bb.instructions.pop()

    components = next(iter(loop._cache_key_components.values()))

    def keys_only() -> None:
        for _ in range(rounds):
            loop._compute_cache_key_from_components(dict(components))

    hit = median_seconds(hits, config.repeats) / rounds
    key = median_seconds(keys_only, config.repeats) / rounds
    return {"local_hit_us": hit * 1e6, "key_us": key * 1e6, "local_hit_vs_key": hit / key}


def key_throughput(graphs: list[Graph], config: BenchConfig) -> dict:
    loop = BirCodeGenLoop(make_target("Trn2"))
    components = []
    for graph in graphs:
        probe = BirCodeGenLoop(make_target(graph.target or "Trn2"))
        probe.run(graph)
        components.extend(probe._cache_key_components.values())
    strings = [canonical_text(kc) for kc in components]
    rounds = max(1, 20_000 // len(components))

    def via_loop() -> None:
        for _ in range(rounds):
            for kc in components:
                loop._compute_cache_key_from_components(dict(kc))

    def bare() -> None:
        for _ in range(rounds):
            for s in strings:
                hashlib.sha256(s).hexdigest()

    n = rounds * len(components)
    with_loop = n / median_seconds(via_loop, config.repeats)
    with_hashlib = n / median_seconds(bare, config.repeats)
    return {
        "key_throughput_ratio": with_loop / with_hashlib,
        "keys_per_second": with_loop,
        "hashlib_per_second": with_hashlib,
    }


# -- 8. storage_ratio -----------------------------------------------------------------------------
def storage_ratio(graphs: list[Graph], redis_url: str) -> dict:
    import redis

    settings = tier_settings(redis_url, namespace="nkibench-storage")
    tier, opened = counting_client(settings)
    raw = redis.Redis.from_url(redis_url)
    space = KeySpace(settings.namespace)
    try:
        _, blocks = compile_all(graphs, tier)
        tier.flush(30)
        binaries = {}
        for bb in blocks:
            for inst in bb.instructions:
                if hasattr(inst, "klir_binary"):
                    binaries[hashlib.sha256(inst.klir_binary).hexdigest()] = len(inst.klir_binary)
        # Everything stored per variant: the entries and the variant index (for miss causes).
        entry_keys = list(raw.scan_iter(match=space.entry_pattern(), count=1000))
        index_keys = list(raw.scan_iter(match=space.variant_index("*"), count=1000))
        kinds = {"entries": entry_keys, "index": index_keys}
        sizes = {name: sum(raw.memory_usage(k, samples=0) or 0 for k in keys) for name, keys in kinds.items()}
        used = sum(sizes.values())
        store = opened[0].inner
        read_before, per_key_binary = opened[0].bytes, 0
        for stored in store.scan_entries():
            entry = tier.lookup(stored.cache_key)  # a hit, as the compile takes it
            per_key_binary += len(entry.binary)
        wire = {"bytes": opened[0].bytes - read_before}
        unique_binary = sum(binaries.values())
    finally:
        tier.close()
        raw.close()
    return {
        "storage_ratio": used / unique_binary,
        "entries": len(entry_keys),
        "unique_binaries": len(binaries),
        "redis_bytes": used,
        "redis_bytes_by_kind": sizes,
        "binary_bytes_unique": unique_binary,
        "dedupe_saving": 1 - unique_binary / per_key_binary if per_key_binary else 0.0,
        "wire_bytes_ratio": wire["bytes"] / per_key_binary,  # bytes read from Redis per hit / binary bytes
        "wire_bytes": wire["bytes"],
        "binary_bytes_hit": per_key_binary,
    }


class CountingBackend:
    """A store that counts the bytes of every value its `fetch` hands over (what a hit reads), delegating the
    rest to the store it wraps: handed to tier_client as the store it opens, not patched into one."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.bytes = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def fetch(self, cache_keys: Sequence[str], ttl: int | None) -> dict:
        found = self.inner.fetch(cache_keys, ttl)
        self.bytes += sum(len(value) for value in found.values())
        return found


def counting_client(settings: Any) -> tuple[Any, list[CountingBackend]]:
    """A client of these settings opened as open_tier opens one, on a CountingBackend: (the client, the store it
    opened, once it has)."""
    credentials = settings_credentials(settings)
    store = level_backend(settings, credentials)
    opened: list[CountingBackend] = []

    def backend() -> CountingBackend:
        opened.append(CountingBackend(store()))
        return opened[-1]

    return tier_client(backend, settings, redact_url(settings.tier), credentials), opened


# -- 6. pool_scaling and 7. report_seconds_100k: scripts in bench/, each run as its own process -------------
def bench_script(name: str, *args: str) -> dict:
    """Run bench/NAME.py --json and return what it printed."""
    import json
    import subprocess
    import sys

    script = BENCH_SCRIPTS / f"{name}.py"
    done = subprocess.run([sys.executable, str(script), *args, "--json"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NkiCacheError(f"{script.name} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def pool_scaling(config: BenchConfig) -> dict:
    """pool_scaling on the first workload given (12 models, the default; 6 with --quick), and with it
    single_graph_scaling (one cold graph of over 90 variants), each beside its CPU control."""
    models = [str(config.models)] if config.quick else [str(config.models), "40"]
    return bench_script(
        "pool_scaling",
        "--models",
        *models,
        "--repeats",
        "1" if config.quick else "5",
        "--single-graph-repeats",
        "3" if config.quick else "5",
        "--seed",
        str(config.seed),
    )


def _from_pool(results: dict) -> dict:
    """single_graph_scaling is measured with pool_scaling, by the same script, on the same machine minutes apart."""
    detail = results.get("pool_scaling_detail")
    if detail is None:
        raise MeasurementSkipped("measured with pool_scaling, which was not")
    return {
        "single_graph_scaling": detail["single_graph_scaling"],
        "cpu_control": detail["single_graph_cpu_control"],
        **detail["single_graph"],
    }


def fleet_single_graph_scaling(config: BenchConfig) -> dict:
    """One cold graph of 94 variants submitted to 2 fleet workers vs 1 (bench/fleet_single_graph.py), beside the
    CPU control of the moment."""
    return bench_script("fleet_single_graph", "--repeats", "2" if config.quick else "5")


def fleet_latency(config: BenchConfig) -> dict:
    """`submit --wait` of one warm graph to 2 idle workers vs a local warm compile of it on the same Redis tier,
    alternated (bench/fleet_latency.py)."""
    return bench_script("fleet_latency", "--rounds", "3" if config.quick else "9")


def s3_warm(config: BenchConfig) -> dict:
    """A warm `compile` of one graph on an s3:// tier (moto's server, in the script's process) against the same
    client's bare GETs of the objects it reads, in the same rounds (bench/s3_warm.py)."""
    return bench_script("s3_warm", "--rounds", str(config.process_rounds))


def fleet_flood(config: BenchConfig) -> dict:
    """Tiny warm jobs through 2 workers, beside a bare XADD / XREADGROUP / XACK loop (bench/fleet_flood.py)."""
    return bench_script("fleet_flood", "--jobs", "500" if config.quick else "2000")


def report_scale(config: BenchConfig) -> dict:
    return bench_script("report_scale", "--sizes", "100000", *(["--quick"] if config.quick else []))


# -- upgrade: a new compiler warmed from the old one's entries --------------------------------------------
def upgrade(config: BenchConfig, work: Path) -> dict:
    """Compile the workload with this compiler (the old one) on a fresh local tier; make a new compiler (a
    copy of the package whose softmax kernel module defines one more, unused, constant: another toolchain id,
    the same maths); `nkicache warm --top N` with it, N the variants the old one used; then the new compiler's first
    pass over the workload. Its tier hit rate (remote hits / tier lookups) shows how warm an upgrade starts,
    and the warm's seconds per variant stand beside the old cold compile's seconds per trace."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from bridge.identity import package_root

    graphs, tier = work / "upgrade-graphs", f"local:{work / 'upgrade.sqlite'}"
    from workers.workload import generate_workload

    generate_workload(graphs, config.models, config.seed)
    copy = work / "upgrade-compiler"
    shutil.copytree(package_root(), copy / "bridge", ignore=shutil.ignore_patterns("__pycache__"))
    softmax = copy / "bridge" / "kernels" / "softmax.py"
    softmax.write_text(softmax.read_text() + "\nNEXT_RELEASE = True\n")  # a comment would keep the id
    env = {**os.environ, "NKICACHE_NAMESPACE": "nkibench-upgrade"}

    def nkicache(*args: str, new: bool) -> dict:
        environment = {**env, "PYTHONPATH": os.pathsep.join([str(copy), env.get("PYTHONPATH", "")])} if new else env
        done = subprocess.run(
            [sys.executable, "-c", "from workers.cli import main; main()", *args, "--json"],
            cwd=work,
            env=environment,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise NkiCacheError(f"nkicache {args[0]} failed in the upgrade measurement: {done.stderr.strip()}")
        return json.loads(done.stdout)

    old = nkicache("compile", str(graphs), "--out", str(work / "upgrade-old"), "--tier", tier, new=False)
    # The variants seen: the old compiler's entries (its trace count can be lower: with 2 pool processes a
    # variant one traced is a remote hit for the other).
    from cachestore.stores import open_backend

    reader = open_backend(load_settings({"tier": tier}), reading=True)
    try:
        variants = sum(1 for _ in reader.scan_entries(with_ttl=False))
    finally:
        reader.close()
    warmed = nkicache("warm", "--tier", tier, "--top", str(variants), "--workers", "2", new=True)
    first = nkicache("compile", str(graphs), "--out", str(work / "upgrade-new"), "--tier", tier, new=True)
    return {
        "upgrade_first_pass_hit_rate": first["shared_hit_rate"] or 0.0,
        "warm_seconds_per_variant": warmed["seconds"] / max(1, warmed["traced"]),
        "cold_seconds_per_trace": old["compile_seconds"] / max(1, old["traces"]),
        "variants": variants,
        "warmed": warmed["traced"],
        "first_pass_traces": first["traces"],
    }


# -- l1_redis_read_reduction: a local level in front of Redis ----------------------------------------------
# What a lookup sends Redis (cachestore.backends.redis fetch: EXPIRE or PTTL with GETRANGE, STRLEN for a long
# value) and what a wait for another's trace adds (GET of the lease): the commands a near level saves.
REDIS_READ_COMMANDS = ("get", "getrange", "mget", "strlen", "pttl", "ttl", "expire", "exists")


def l1_redis_read_reduction(config: BenchConfig, work: Path) -> dict:
    """A machine's second compile of the workload, against a private redis-server: with `--tier redis://`
    alone, and with `--tier local:... --tier redis://` (each machine's first compile filled its tiers). The
    Redis read commands of each second compile are counted from INFO commandstats (reset just before it);
    the figure is 1 - stacked / alone. Both second compiles' artifacts must be byte-identical to a compile
    with no tier, or the measurement fails."""
    from bench.dev_redis import start_private_server
    from workers.passes import compile_graph
    from workers.workload import generate_workload

    files = generate_workload(work / "l1-graphs", config.models, config.seed)
    untiered = [compile_graph(path)[1] for path in files]
    server = start_private_server()
    try:
        alone = _second_compile_reads(files, server.url, server.url, "alone")
        stacked = _second_compile_reads(files, f"local:{work / 'l1.sqlite'} {server.url}", server.url, "stacked")
    finally:
        server.cleanup()
    if alone["artifacts"] != untiered or stacked["artifacts"] != untiered:
        raise NkiCacheError("a stacked or Redis-only compile produced an artifact unlike the untiered compile's")
    reads_alone, reads_stacked = alone["read_commands"], stacked["read_commands"]
    return {
        "l1_redis_read_reduction": 1 - reads_stacked / reads_alone if reads_alone else 0.0,
        "redis_reads_alone": reads_alone,
        "redis_reads_stacked": reads_stacked,
        "redis_commands_alone": alone["commands"],
        "redis_commands_stacked": stacked["commands"],
        "level_hits_stacked": stacked["level_hits"],
        "traces_second_compile": alone["traces"] + stacked["traces"],
        "graphs": len(files),
        "artifacts_identical": True,
    }


def _second_compile_reads(files: Sequence[Path], tier: str, redis_url: str, label: str) -> dict:
    """Compile `files` twice, each with a fresh tier client (two compiles of one machine), and count what the
    second sent Redis."""
    import redis

    from workers.passes import add_level_hits, compile_graph

    settings = load_settings({"tier": tier, "namespace": f"nkibench-l1-{label}"})
    first = open_tier(settings)
    for path in files:
        compile_graph(path, tier=first)
    first.close(30)
    stats = redis.Redis.from_url(redis_url)
    try:
        stats.config_resetstat()
        second = open_tier(settings)
        compiled = [compile_graph(path, tier=second) for path in files]
        second.close(30)
        commands = stats.info("commandstats")
    finally:
        stats.close()
    calls = {name.removeprefix("cmdstat_"): int(item["calls"]) for name, item in commands.items()}
    calls.pop("config", None)  # the reset itself
    calls.pop("info", None)
    return {
        "read_commands": sum(calls.get(name, 0) for name in REDIS_READ_COMMANDS),
        "commands": sum(calls.values()),
        "artifacts": [encoded for _, encoded in compiled],
        "traces": sum(int(result.counts["traces"]) for result, _ in compiled),
        "level_hits": add_level_hits([result for result, _ in compiled]),
    }


# -- value_retention_ratio: value-ranked retention against LRU, on a replayed pass log ----------------------
def value_retention(graphs: list[Graph], config: BenchConfig, work: Path) -> dict:
    """Record the workload's pass log (each pass's calls per cache key) and its entries (compile seconds, stored
    bytes) by compiling it into a fresh local tier; replay a workload 10 times as long (bench.replay:
    passes drawn with Zipf-like popularity) against a cache holding a quarter of the bytes of the entries it
    uses, once under LRU and once under value-ranked retention. The figure: compile seconds the hits saved
    under value / under LRU."""
    from bench.replay import LoggedPass, compare, scaled_log

    settings = tier_settings(f"local:{work / 'replay.sqlite'}")
    tier = open_tier(settings)
    recorded = []
    try:
        for graph in graphs:
            loop = BirCodeGenLoop(make_target(graph.target or "Trn2"), tier=tier)
            loop.run(graph)
            variants = loop.pass_record(graph.name, 0.0, 0.0).variants
            recorded.append(LoggedPass(0.0, {key: use.usage for key, use in variants.items()}))
        tier.flush(30)
        entries = _logged_entries(tier)
    finally:
        tier.close()
    passes = scaled_log(recorded, 10, config.seed)
    used = {key for logged in passes for key in logged.uses}
    budget = sum(entries[key].stored_bytes for key in used) // 4
    results = compare(passes, entries, budget)
    lru, value = results["lru"], results["value"]
    return {
        "value_retention_ratio": value.saved_seconds / lru.saved_seconds if lru.saved_seconds else 0.0,
        "lru": lru.as_json(),
        "value": value.as_json(),
        "passes": len(passes),
        "recorded_passes": len(recorded),
        "entries": len(used),
        "budget_bytes": budget,
    }


def _logged_entries(tier: Any) -> dict:
    """{cache key: LoggedEntry} of every entry of the tier: its compile seconds, and the bytes it takes."""
    from bench.replay import LoggedEntry
    from cachestore.entry import decode_entry

    raw = {item.cache_key: item.data for item in tier._backend.scan_entries(with_ttl=False)}
    decoded = {key: decode_entry(data, tier.policy) for key, data in raw.items()}
    return {key: LoggedEntry(entry.compile_seconds, len(raw[key])) for key, entry in decoded.items()}


# The namespaces the measurements write to in the Redis they are given: deleted when the run ends.
REDIS_NAMESPACES = (
    "nkibench",
    "nkibench-warm",
    "nkibench-mirror",
    "nkibench-mirror2",
    "nkibench-hit",
    "nkibench-storage",
    "nkibench-upgrade",
    "nkibench-misses",
    *SIGNATURE_NAMESPACES,
)


def drop_namespaces(redis_url: str, namespaces: Sequence[str] = REDIS_NAMESPACES) -> int:
    """Delete every key of `namespaces` from the Redis at `redis_url` (the bench's own, never another's);
    returns how many went."""
    import redis

    from cachestore.keys import KeySpace

    client = redis.Redis.from_url(redis_url)
    deleted = 0
    try:
        for namespace in namespaces:
            for pattern in KeySpace(namespace).namespace_patterns():
                keys = list(client.scan_iter(match=pattern, count=1000))
                for start in range(0, len(keys), 1000):
                    deleted += client.delete(*keys[start : start + 1000])
    finally:
        client.close()
    return deleted


# The whole-process figures reported beside warm_compile_local_vs_floor, each from the same run of commands.
PROCESS_FIGURES = (
    "warm_compile_redis_vs_floor",
    "version_vs_goal",
    "exec_startup_overhead_ms",
    "exec_python_ms",
    "version_ms",
    "help_ms",
    "python_ms",
    "floor_local_ms",
    "floor_redis_ms",
    "warm_compile_local_ms",
    "cold_compile_local_ms",
    "warm_compile_redis_ms",
    "cold_compile_redis_ms",
    "warm_compile_local_workers2_ms",
    "report_local_ms",
    "toolchain_id_ms",
)


def whole_process(work: Path, redis_url: str, rounds: int) -> dict:
    """Whole `nkicache` processes on the workload's first graph, beside their floors (bench.processes)."""
    from bench.processes import process_figures, redis_namespaces

    graph = sorted((work / "graphs").glob("*.json"))[0]
    namespace = "nkibench-process"
    try:
        return process_figures(graph, redis_url, namespace, work / "process", rounds)
    finally:
        drop_namespaces(redis_url, redis_namespaces(namespace, rounds))


def broken_tier(work: Path, config: BenchConfig) -> dict:
    """The workload compiled with --workers 2 on a Redis down, frozen or trickling from the start and on one
    frozen or killed mid-compile, beside --tier off."""
    from bench.broken_tier import ROUNDS, broken_tier_overhead

    return broken_tier_overhead(
        work / "graphs", work / "broken-tier", config.process_rounds if config.quick else ROUNDS
    )


def _from_process(results: dict, name: str) -> dict:
    detail = results.get("warm_compile_local_vs_floor_detail")
    if detail is None:
        raise MeasurementSkipped("the whole-process measurement did not run")
    return {name: detail[name]}


def _from_broken_tier(results: dict) -> dict:
    """mid_compile_fault_overhead is measured with broken_tier_overhead (the same rounds)."""
    detail = results.get("broken_tier_overhead_detail")
    if detail is None:
        raise MeasurementSkipped("broken_tier_overhead was not measured")
    return detail


def _from_storage(results: dict) -> dict:
    """wire_bytes_ratio is measured with storage_ratio (the same stored workload, every entry hit once)."""
    detail = results.get("storage_ratio_detail")
    if detail is None:
        raise MeasurementSkipped("storage_ratio was not measured")
    return detail


def _from_miss_causes(results: dict) -> dict:
    """miss_classification_overhead is measured with miss_cause_coverage (its cold compile)."""
    detail = results.get("miss_cause_coverage_detail")
    if detail is None:
        raise MeasurementSkipped("miss_cause_coverage was not measured")
    return detail


def run_benchmarks(config: BenchConfig, redis_url: str, progress: Callable[[str], None]) -> dict:
    """Every measurement: results[name] is the figure, results[name + "_detail"] what it was computed from,
    and results["skipped"] maps each measurement that could not run here to why (no figure for it). The keys
    the measurements wrote to the Redis at `redis_url` are deleted at the end, whatever happened."""
    try:
        return _run_benchmarks(config, redis_url, progress)
    finally:
        drop_namespaces(redis_url)


def _run_benchmarks(config: BenchConfig, redis_url: str, progress: Callable[[str], None]) -> dict:
    with tempfile.TemporaryDirectory(prefix="nkibench-") as tmp:
        work = Path(tmp)
        graphs = workload_graphs(work / "graphs", config)
        results: dict[str, Any] = {"config": msgspec.structs.asdict(config), "skipped": {}}
        steps = [
            ("warm_compile_local_vs_floor", lambda: whole_process(work, redis_url, config.process_rounds)),
            *((name, partial(_from_process, results, name)) for name in PROCESS_FIGURES),
            ("warm_compile_s3_vs_floor", lambda: s3_warm(config)),
            ("broken_tier_overhead", lambda: broken_tier(work, config)),
            ("mid_compile_fault_overhead", lambda: _from_broken_tier(results)),
            ("warm_speedup", lambda: warm_speedup(graphs, config, work)),
            ("warm_speedup_redis", lambda: warm_speedup_redis(graphs, config, redis_url)),
            ("mirror_overhead", lambda: mirror_overhead(graphs, config, redis_url)),
            ("remote_hit_vs_raw_get", lambda: remote_hit_vs_raw_get(graphs, config, redis_url)),
            ("signature_overhead", lambda: signature_overhead(graphs, config, redis_url, work)),
            ("local_hit_us", lambda: local_hit_cost(graphs, config)),
            ("key_throughput_ratio", lambda: key_throughput(graphs, config)),
            ("storage_ratio", lambda: storage_ratio(graphs, redis_url)),
            ("wire_bytes_ratio", lambda: _from_storage(results)),
            ("pool_scaling", lambda: pool_scaling(config)),
            ("single_graph_scaling", lambda: _from_pool(results)),
            ("fleet_single_graph_scaling", lambda: fleet_single_graph_scaling(config)),
            ("fleet_job_latency_vs_local", lambda: fleet_latency(config)),
            ("flood_jobs_per_second", lambda: fleet_flood(config)),
            ("report_seconds_100k", lambda: report_scale(config)),
            ("upgrade_first_pass_hit_rate", lambda: upgrade(config, work)),
            ("miss_cause_coverage", lambda: miss_cause_coverage(graphs, redis_url)),
            ("miss_classification_overhead", lambda: _from_miss_causes(results)),
            ("l1_redis_read_reduction", lambda: l1_redis_read_reduction(config, work)),
            ("value_retention_ratio", lambda: value_retention(graphs, config, work)),
        ]
        for name, step in steps:
            progress(name)
            try:
                detail = step()
            except MeasurementSkipped as exc:
                results["skipped"][name] = str(exc)
                continue
            results[name] = detail[name]
            results[f"{name}_detail"] = detail
    return results
