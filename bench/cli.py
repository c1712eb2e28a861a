"""`nkicache bench`: the performance goals, measured as ratios in one run."""

from __future__ import annotations

import json
import sys

import click

from workers.cli_common import EXIT_CHECK_FAILED, echo_json


@click.command("bench")
@click.option("--quick", is_flag=True, help="A smaller workload and fewer repetitions (under 5 minutes).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with every figure.")
@click.option(
    "--redis-url",
    default=None,
    metavar="URL",
    help="Measure against this Redis instead of a private redis-server on a free loopback port.",
)
def bench_command(quick: bool, as_json: bool, redis_url: str | None) -> None:
    """Measure nkicache against its goals, each figure a median of several runs and each goal a ratio of
    two things measured side by side in this run (a noisy machine moves both).

    The goals are what a user feels: whole `nkicache` processes on one graph of the workload, each the median
    of 5 runs after a warm-up, beside a floor (a bare interpreter importing the third-party modules the
    command needs, nothing of nkicache) measured in the same rounds:

    \b
      warm_compile_local_vs_floor  warm `compile` of one graph, local tier / its floor       goal <= 2.0
      warm_compile_redis_vs_floor  the same on Redis / its floor (redis-py instead of sqlite3) goal <= 2.0
      warm_compile_s3_vs_floor  the same on s3:// (moto's server) / obstore's bare GETs of the
                             objects it reads, in the same rounds (bench/ script)            goal <= 2.0
      version_vs_goal        `nkicache --version` / (3 x python_ms + 60 ms)                  goal <= 1.0
      exec_startup_overhead_ms  `nkicache exec -- python -c pass` - `python -c pass`, in ms  goal <= 60
      broken_tier_overhead   `compile --workers 2` of the workload on a down, frozen or trickling
                             Redis (the worst) / the same with --tier off, alternated        goal <= 1.1
      mid_compile_fault_overhead  the same on a Redis frozen or killed once the compile stored 20
                             entries (the worse) / --tier off, in the same rounds            goal <= 1.15
      fleet_job_latency_vs_local  `submit --wait` of one warm graph to 2 idle workers / a local warm
                             `compile` of it on the same Redis, alternated (bench/ script)   goal <= 1.2
      flood_jobs_per_second  2,000 tiny warm jobs through 2 workers, printed beside the floor: a
                             bare XADD/XREADGROUP/XACK loop on the same server (bench/)     goal >= 231
      version_ms, help_ms, exec_python_ms, python_ms, floor_local_ms, floor_redis_ms, cold_compile_local_ms,
      warm_compile_local_ms, cold_compile_redis_ms, warm_compile_redis_ms, report_local_ms,
      warm_compile_local_workers2_ms (start-up of --workers 2), toolchain_id_ms (one call in a
      fresh process): the figures behind them, in milliseconds

    The in-process ratios below are diagnostics of where time goes inside one process:

    \b
      warm_speedup           no tier / warm local tier, compiling a generated workload   goal >= 100
      warm_speedup_redis     no tier / warm Redis tier, the same workload                 goal >= 50
      mirror_overhead        cold compile mirroring to Redis / tier off                   goal <= 1.03
      mirror_overhead_direct 1 + compiling thread's time in tier calls / tier off         goal <= 1.005
      remote_hit_vs_raw_get  one remote hit (fetch, verify, decode, store) / raw GET      goal <= 1.5
                             (redis-py's `get`) of the same bytes; remote_hit_vs_raw_getrange
                             beside it: / redis-py's `getrange`, the command the hit sends
      local_hit_us           one local hit in the orchestrator, in microseconds
      key_throughput_ratio   keys/s through _compute_cache_key_from_components / hashlib
      pool_scaling           graphs/s with 2 workers / 1 worker, 12 models, tier off     goal >= 1.7
      single_graph_scaling   the same on one cold graph of 94 variants                    goal >= 1.7
      fleet_single_graph_scaling  that graph submitted to 2 fleet workers / 1              goal >= 1.6
      report_seconds_100k    report and verify over 100k entries, and peak memory
      storage_ratio          Redis bytes per variant (entry, digest and variant index) / binary bytes  goal <= 0.15
      wire_bytes_ratio       bytes read from Redis per hit / binary bytes                 goal <= 0.15
      upgrade_first_pass_hit_rate  a new compiler's first pass after nkicache warm          goal >= 0.99
      signature_overhead     writer-signature checks / remote hits, FIRST hits (a fresh     reported
                             reader): the worse of a pass-by-pass prefetch of the workload
                             and lookups one at a time, each the median of 5 fresh readers;
                             the check timed whole, verifies included; verifies per hit
                             beside it
                             (signature_overhead_hit_again: entries hit again, reported)
      l1_redis_read_reduction  1 - Redis reads of a second compile with a local level in front
                             / with Redis alone (INFO commandstats, private server)       goal >= 0.9
      value_retention_ratio  compile seconds saved, value-ranked / LRU retention, on the
                             workload's pass log replayed 10x at a quarter of its bytes   goal >= 1.3
      miss_cause_coverage    tier misses given a cause other than unknown, on a workload
                             built to contain every cause                                 goal >= 0.95
      miss_classification_overhead  1 + seconds finding the causes / cold compile seconds    goal <= 1.02

    Starts a private redis-server unless --redis-url is given. bench/RESULTS.md explains a full run.
    pool_scaling (with single_graph_scaling), fleet_single_graph_scaling, fleet_job_latency_vs_local,
    flood_jobs_per_second and report_seconds_100k run the scripts in bench/, each in a process of its own. A
    measurement that cannot run is reported as skipped, with the reason, and the command exits 1 (the others
    still run). Each scaling figure is printed beside its CPU control. The command and its measurements come
    with a source checkout (`pip install -e '.[dev]'`); no wheel has them.
    """
    from bench.dev_redis import answers_ping, start_private_server
    from bench.figures import BenchConfig, run_benchmarks
    from bridge.errors import NkiCacheError
    from cachestore.tier_urls import is_cluster, is_redis, redact_url, tier_url_problem

    if redis_url:
        # Checked first: the measurements would fail on it, after the first ones ran and printed many warnings.
        # The bench talks to one server, with redis-py's from_url.
        problem = (
            tier_url_problem(redis_url)
            if is_redis(redis_url) and not is_cluster(redis_url)
            else "is not a redis://, rediss:// or unix:// URL"
        )
        if problem:
            raise NkiCacheError(f"--redis-url {redact_url(redis_url)} {problem}")
        if not answers_ping(redis_url):
            raise NkiCacheError(f"--redis-url {redact_url(redis_url)} does not answer PING")
    config = BenchConfig.for_mode(quick)
    server = None if redis_url else start_private_server()
    try:
        results = run_benchmarks(
            config, redis_url or server.url, lambda name: click.echo(f"measuring {name}", err=True)
        )
    finally:
        if server is not None:
            server.cleanup()
    if as_json:
        echo_json(results)
    else:
        _print_figures(results)
    if results["skipped"]:
        # Not every goal was measured: a script or CI reading the figures must not take them as complete.
        sys.exit(EXIT_CHECK_FAILED)


def _print_figures(results: dict) -> None:
    from bench.figures import GOALS

    for name, value in results.items():
        if name.endswith("_detail") or name in ("config", "skipped"):
            continue
        goal = GOALS.get(name)
        verdict = ""
        if goal is not None and isinstance(value, int | float):
            kind, bound = goal
            met = value >= bound if kind == "min" else value <= bound
            verdict = f"  goal {'>=' if kind == 'min' else '<='} {bound}: {'met' if met else 'NOT MET'}"
        shown = f"{value:.3f}" if isinstance(value, float) else json.dumps(value)
        control = (results.get(f"{name}_detail") or {}).get("cpu_control")
        if isinstance(control, int | float):  # what two processes got from the machine at that moment
            verdict += f"  (CPU control {control:.2f})"
        floor = (results.get(f"{name}_detail") or {}).get("floor_jobs_per_second")
        if isinstance(floor, int | float):  # the most Redis Streams allow here, at that moment
            verdict += f"  (floor {floor:.0f} jobs/s)"
        verifies = (results.get(f"{name}_detail") or {}).get("verifies_per_hit")
        if isinstance(verifies, int | float):  # signature_overhead: what its ratio is made of
            verdict += f"  ({verifies:.3f} Ed25519 verifies per hit)"
        click.echo(f"{name:24} {shown}{verdict}")
    for name, reason in results["skipped"].items():
        click.echo(f"{name:24} skipped: {reason}")
    sys.stdout.flush()
