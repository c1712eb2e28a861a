"""`nkicache submit`, `worker` and `queue`: the fleet on Redis Streams (see workers/fleet.py)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import click

from workers.cli_common import (
    EXIT_CHECK_FAILED,
    EXIT_PROJECT_ERROR,
    echo_json,
    expand,
    load_cli_settings,
    tier_options,
)


def _fleet(tier: str | None, tier_mode: str | None = None, **extra) -> tuple:
    from cachestore.keys import KeySpace
    from workers.fleet import fleet_client

    settings = load_cli_settings(tier=tier, tier_mode=tier_mode, **extra)
    return settings, fleet_client(settings), KeySpace(settings.namespace)


def _redis_errors(function):
    """Turn an unreachable or failing Redis into one clear line (exit 2) instead of a traceback."""
    import functools

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        from cachestore.backends.redis import redis_errors

        with redis_errors("the fleet's Redis"):
            return function(*args, **kwargs)

    return wrapper


@click.command("submit")
@click.argument("graphs", nargs=-1, required=True, metavar="GRAPH_OR_DIR...")
@tier_options
@click.option("--wait", is_flag=True, help="Return only when every job is completed or dead-lettered.")
@click.option("--timeout", type=float, default=None, help="With --wait: give up after this many seconds.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="With --wait: download the completed jobs' artifacts into this folder.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_redis_errors
def submit_command(graphs, tier, tier_mode, wait, timeout, out_dir, as_json) -> None:
    """Put one compile job per graph file on the fleet's Redis Stream for this compiler's toolchain.

    The graph travels inside the job, so workers need no shared disk; artifacts come back through Redis
    (`--wait --out DIR` downloads them for `nkicache run`). Only a worker with the same toolchain (`nkicache
    --version`) takes the jobs; with --wait, a warning on stderr says so when no live worker has it, and
    the jobs keep waiting for one. Without --wait it prints the batch id and the toolchain and returns.
    Every file is checked before the first job is enqueued: one that cannot be read, is larger than 16 MiB,
    is not UTF-8 JSON or is not a valid graph is an error naming it, and nothing is submitted.

    --json keys: batch, toolchain, submitted, completed, failed, dead_letter, unfinished, jobs ({id: {file,
    status, error}}), artifacts (with --out).
    """
    from workers import fleet

    files = expand(graphs, ".json")
    if not files:
        raise click.UsageError(f"no .json graph files in {', '.join(graphs)}")
    settings, client, keys = _fleet(tier, tier_mode)
    submission = fleet.submit(client, keys, files, settings.entry_ttl)
    report: dict = {
        "batch": submission.batch_id,
        "toolchain": submission.toolchain,
        "submitted": len(submission.job_ids),
    }
    if wait:
        tty = not as_json and sys.stderr.isatty()
        next_look, warned = 0.0, False

        def progress(done: int) -> None:
            nonlocal next_look, warned
            if tty:
                click.echo(f"\r{done}/{len(submission.job_ids)} jobs finished", err=True, nl=False)
            # Only a worker of this toolchain takes these jobs: say once when none is live rather than wait in
            # silence (the jobs still wait, for one that starts later). Heartbeats change once an interval, so
            # looking more often would tell nothing new.
            if warned or done == len(submission.job_ids) or time.monotonic() < next_look:
                return
            next_look = time.monotonic() + settings.heartbeat_interval
            if not fleet.serves(client, keys, submission.toolchain, settings.heartbeat_interval):
                warned = True
                after_progress = "\n" if tty else ""  # off the progress line
                click.echo(f"{after_progress}warning: no live worker has toolchain {submission.toolchain} (this "
                           "compiler's); the jobs wait until one starts", err=True)  # fmt: skip

        results = fleet.wait_for(client, keys, submission.job_ids, timeout, progress)
        statuses = [r.get("status") for r in results.values()]
        report.update(
            completed=statuses.count("completed"),
            dead_letter=statuses.count("dead_letter"),
            failed=sum(int(r.get("attempts", 0)) for r in results.values() if r.get("status") == "dead_letter"),
            unfinished=len(submission.job_ids) - len(results),
            jobs={job: {"file": submission.names[job], "status": results.get(job, {}).get("status", "unfinished"),
                        "error": results.get(job, {}).get("error")} for job in submission.job_ids},
        )  # fmt: skip
        if out_dir:
            report["artifacts"] = fleet.download_artifacts(client, keys, results, out_dir)
    if as_json:
        echo_json(report)
    else:
        click.echo(f"batch {submission.batch_id}: {report['submitted']} jobs submitted for toolchain "
                   f"{submission.toolchain}")  # fmt: skip
        if wait:
            click.echo(f"{report['completed']} completed, {report['dead_letter']} dead-lettered, "
                       f"{report['unfinished']} unfinished")  # fmt: skip
            for job, info in report["jobs"].items():
                if info["status"] != "completed":
                    click.echo(f"  {job} {info['file']}: {info['status']} {info['error'] or ''}".rstrip())
    if wait and (report["dead_letter"] or report["unfinished"]):
        sys.exit(EXIT_CHECK_FAILED)


@click.command("worker")
@tier_options
@click.option("--name", default=None, help="This worker's consumer name. Default: HOST-PID.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Worker processes on this machine, each its own consumer.")  # fmt: skip
@click.option("--max-jobs", type=click.IntRange(min=1), default=None, help="Exit after this many jobs.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Also write each artifact into this folder (artifacts always go to Redis).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True,
              help="When the workers exit, print {jobs, workers: [{name, jobs}]} on stdout.")  # fmt: skip
@_redis_errors
def worker_command(tier, tier_mode, name, concurrency, max_jobs, out_dir, as_json) -> None:
    """Compile jobs from the fleet's stream until SIGTERM or Ctrl-C.

    Reads with the consumer group, compiles with a fresh codegen loop per job (reading and mirroring the
    tier on the same Redis), stores the artifact and the result and acknowledges, in one script. Jobs
    whose worker went quiet for job_claim_idle seconds are reclaimed (XAUTOCLAIM); a job that fails
    job_max_attempts times goes to the dead-letter stream with its error. SIGTERM finishes the current
    job, then exits 0. Heartbeats every heartbeat_interval seconds show in `nkicache queue`.
    """
    import multiprocessing

    base = name or os.environ.get("NKICACHE_WORKER") or f"{socket.gethostname()}-{os.getpid()}"
    try:
        base.encode("utf-8")  # bytes that are not UTF-8 arrive escaped; Redis could not be sent them
    except UnicodeEncodeError:
        raise click.BadParameter("the worker's name is not UTF-8 text", param_hint="--name") from None
    if concurrency == 1:
        _print_done([(base, _run_worker(tier, tier_mode, base, max_jobs, out_dir))], as_json)
        return
    # A Redis that is down at start is one error line here, before any process starts, not one per process.
    _settings, client, _keys = _fleet(tier, tier_mode)
    client.ping()
    client.close()
    context = multiprocessing.get_context("spawn")
    done = context.SimpleQueue()  # (name, jobs) from each process that exits cleanly
    processes = [context.Process(target=_worker_process,
                                 args=(tier, tier_mode, f"{base}-{i}", max_jobs, out_dir, done))
                 for i in range(concurrency)]  # fmt: skip

    def forward(signum: int, frame: object) -> None:
        # A supervisor signals this process only (Kubernetes, `kill PID`): pass it on, so each worker
        # finishes its job and exits, instead of this process dying and leaving them running.
        for process in processes:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    finished = []
    while not done.empty():
        finished.append(done.get())
    _print_done(sorted(finished), as_json)
    if any(process.exitcode != 0 for process in processes):
        sys.exit(EXIT_CHECK_FAILED)


def _print_done(finished: list[tuple[str, int]], as_json: bool) -> None:
    if as_json:
        echo_json({"jobs": sum(jobs for _, jobs in finished),
                   "workers": [{"name": name, "jobs": jobs} for name, jobs in finished]})  # fmt: skip


def _run_worker(tier, tier_mode, name, max_jobs, out_dir) -> int:
    from workers.fleet import Worker

    settings = load_cli_settings(tier=tier, tier_mode=tier_mode)
    worker = Worker(settings, name, out_dir=out_dir, max_jobs=max_jobs)
    worker.install_signal_handlers()
    done = worker.run()
    click.echo(f"worker {name}: {done} jobs, exiting", err=True)
    return done


def _worker_process(tier, tier_mode, name, max_jobs, out_dir, done) -> None:
    """One process of `worker --concurrency N`. Its errors are one line and exit 2, as in the command's own
    process: multiprocessing would print the traceback of an error that ends the process."""
    from bridge.errors import NkiCacheError
    from cachestore.backends.redis import redis_errors

    try:
        with redis_errors("the fleet's Redis"):
            done.put((name, _run_worker(tier, tier_mode, name, max_jobs, out_dir)))
    except NkiCacheError as exc:
        click.echo(f"nkicache: error: {exc}", err=True)
        sys.exit(EXIT_PROJECT_ERROR)


@click.command("queue")
@tier_options
@click.option("--dead-letters", is_flag=True, help="Also list the dead-lettered jobs with their errors.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--live-check", is_flag=True,
              help="Exit 0 if worker NAME (or NAME-i) has a fresh heartbeat, else 1: a liveness probe.")  # fmt: skip
@click.option("--name", default=None, help="With --live-check. Default: $NKICACHE_WORKER, else the host name.")
@_redis_errors
def queue_command(tier, tier_mode, dead_letters, as_json, live_check, name) -> None:
    """Show the fleet's queue: pending (not yet delivered), in flight (delivered, not acknowledged),
    completed, failed attempts, dead-lettered, and the live workers (heartbeat within 3 intervals).

    Jobs are routed by toolchain (only a worker of the submitter's compiler takes a job), so pending and in
    flight are also shown per toolchain, with its live workers; a warning names every toolchain whose jobs
    wait and no live worker has.

    --json keys: pending, in_flight (sums over the toolchains), completed, failed, dead_letter, workers
    ([{name, host, pid, toolchain, job, done, time}]), toolchains ({toolchain: {pending, in_flight,
    live_workers}} for each toolchain with waiting jobs or live workers), unserved ({toolchain: waiting jobs}
    for those with no live worker), and dead_letters with --dead-letters.
    """
    from bridge.identity import toolchain_id
    from workers import fleet

    settings, client, keys = _fleet(tier, tier_mode)
    if live_check:
        # A liveness probe runs every few seconds: it reads the heartbeats only, not every toolchain's stream.
        workers = fleet.live_workers(client, keys, settings.heartbeat_interval)
        wanted = name or os.environ.get("NKICACHE_WORKER") or socket.gethostname()
        live = [w["name"] for w in workers if w["name"] == wanted or w["name"].startswith(wanted + "-")]
        click.echo(f"{wanted}: {'live (' + ', '.join(live) + ')' if live else 'no fresh heartbeat'}")
        sys.exit(0 if live else EXIT_CHECK_FAILED)
    status = fleet.queue_status(client, keys, settings.heartbeat_interval)
    if dead_letters:
        status["dead_letters"] = list(fleet.dead_letters(client, keys))
    if as_json:
        echo_json(status)
        return
    click.echo(f"pending {status['pending']}, in flight {status['in_flight']}, completed {status['completed']}, "
               f"failed attempts {status['failed']}, dead-lettered {status['dead_letter']}")  # fmt: skip
    mine = toolchain_id()
    for toolchain, row in status["toolchains"].items():
        click.echo(f"toolchain {toolchain}{' (this compiler)' if toolchain == mine else ''}: pending "
                   f"{row['pending']}, in flight {row['in_flight']}, {row['live_workers']} live workers")  # fmt: skip
    for toolchain, waiting in status["unserved"].items():
        click.echo(f"warning: {waiting} jobs wait for toolchain {toolchain}, which no live worker has")
    click.echo(f"{len(status['workers'])} live workers")
    for w in status["workers"]:
        age = time.time() - w["time"]
        click.echo(f"  {w['name']} on {w['host']} (pid {w['pid']}, toolchain {w['toolchain'] or 'unknown'}): "
                   f"{w['done']} jobs, {'on ' + w['job'] if w['job'] else 'idle'}, seen {age:.1f} s ago")  # fmt: skip
    for d in status.get("dead_letters", []):
        click.echo(f"  dead: {d['job']}: {d['error']}")
