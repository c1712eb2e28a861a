"""`nkicache submit`, `worker` and `queue`: the fleet on Redis Streams (see workers/fleet.py)."""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import time

import click

from workers.cli_common import (
    EXIT_CHECK_FAILED,
    EXIT_PROJECT_ERROR,
    WAIT_SECONDS,
    echo_json,
    expand,
    load_cli_settings,
    plural,
    refuse_read_only,
    tier_options,
)


def _fleet(tier: tuple[str, ...], tier_mode: str | None = None, **extra) -> tuple:
    from cachestore.keys import KeySpace
    from workers.fleet import fleet_client

    settings = load_cli_settings(tier=tier, tier_mode=tier_mode, **extra)
    client = fleet_client(settings)
    # What the imports made (redis-py's alone is most of a submit's start) lives until the process exits: frozen,
    # no full collection walks it again (the one a submit's artifact download set off cost 15 ms here).
    gc.freeze()
    return settings, client, KeySpace(settings.namespace)


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
@click.option(
    "--timeout",
    type=WAIT_SECONDS,
    default=None,
    help="With --wait: give up after this many seconds (default: the wait_timeout setting, 1 hour).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="With --wait: download the completed jobs' artifacts into this folder.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_redis_errors
def submit_command(graphs, tier, tier_mode, wait, timeout, out_dir, as_json) -> None:
    """Put one compile job per graph file on the fleet's Redis Stream for this compiler's toolchain.

    The graph travels inside the job, so workers need no shared disk; artifacts come back through Redis
    (`--wait --out DIR` downloads them for `nkicache run`). Only a worker with the same toolchain (`nkicache
    --version`) takes the jobs; with --wait, a warning on stderr says so when no live worker has it, and
    the jobs keep waiting for one. It prints the batch id, the toolchain and each job's id and file
    (`nkicache job show ID`, `nkicache batch show BATCH`). With --wait it gives up after --timeout seconds
    (default: wait_timeout) with one line saying how many jobs are unfinished, exit 1; they stay queued. It
    rides out a Redis restart or failover of up to 30 s; jobs that Redis lost (their batch is gone: it
    restarted empty) end the wait at once with one line saying so, exit 2, as does a Redis that stays
    unreachable; the batch id is printed either way (with --json, in the object, with `error`).
    Every file is checked before the first job is enqueued: one that cannot be read, is larger than
    max_graph_bytes (16 MiB), is not UTF-8 JSON or is not a valid graph is an error naming it, and nothing is
    submitted.

    --json keys: batch, toolchain, submitted, completed, failed, dead_letter, unfinished, lost, jobs ({id:
    {file, status, error}}), artifacts (with --out), error (when the wait failed or jobs were lost).
    """
    from bridge.errors import NkiCacheError
    from bridge.inputs import shown_path
    from cachestore.backends.redis import redis_errors
    from workers import fleet

    files = expand(graphs, ".json")
    if not files:
        raise click.UsageError(f"no .json graph files in {', '.join(graphs)}")
    settings, client, keys = _fleet(tier, tier_mode)
    refuse_read_only(settings, "submit", "queues jobs")
    submission = fleet.submit(client, keys, files, settings.job_ttl, settings.max_graph_bytes, settings.job_shards)
    report: dict = {
        "batch": submission.batch_id,
        "toolchain": submission.toolchain,
        "submitted": len(submission.job_ids),
        "jobs": {
            job: {"file": submission.names[job], "status": "submitted", "error": None} for job in submission.job_ids
        },
    }
    if not as_json:
        click.echo(
            f"batch {submission.batch_id}: {plural(report['submitted'], 'job')} submitted for toolchain "
            f"{submission.toolchain}"
        )
        for job in submission.job_ids:
            click.echo(f"  {job} {shown_path(submission.names[job])}")
    timeout = settings.wait_timeout if timeout is None else timeout
    if wait:
        tty = not as_json and sys.stderr.isatty()
        next_look, warned = 0.0, False

        def progress(done: int) -> None:
            nonlocal next_look, warned
            if tty:
                click.echo(f"\r{done}/{plural(len(submission.job_ids), 'job')} finished", err=True, nl=False)
            # Only a worker of this toolchain takes these jobs: say once when none is live rather than wait in
            # silence (the jobs still wait, for one that starts later). Heartbeats change once an interval, so
            # looking more often would tell nothing new.
            if warned or done == len(submission.job_ids) or time.monotonic() < next_look:
                return
            next_look = time.monotonic() + settings.heartbeat_interval
            toolchain, interval = submission.toolchain, settings.heartbeat_interval
            if not fleet.retrying(lambda: fleet.serves(client, keys, toolchain, interval)):
                warned = True
                after_progress = "\n" if tty else ""  # off the progress line
                click.echo(
                    f"{after_progress}warning: no live worker has toolchain {submission.toolchain} (this "
                    "compiler's); the jobs wait until one starts",
                    err=True,
                )

        try:
            # The jobs are queued: from here on a failure still reports the batch id (with --json, in the
            # object), so the submitter can find the batch again.
            with redis_errors("the fleet's Redis"):
                waited = fleet.wait_for(client, keys, submission.job_ids, timeout, progress, settings.job_ttl)
                if out_dir:
                    report["artifacts"] = fleet.download_artifacts(client, keys, waited.results, out_dir)
        except NkiCacheError as exc:
            report["error"] = f"{' '.join(str(exc).split())} (batch {submission.batch_id} was submitted)"
            if as_json:
                echo_json(report)
            off_progress = "\n" if tty else ""
            click.echo(f"{off_progress}nkicache: error: {report['error']}", err=True)
            sys.exit(EXIT_PROJECT_ERROR)
        results = waited.results
        statuses = [r.get("status") for r in results.values()]
        report.update(
            completed=statuses.count("completed"),
            dead_letter=statuses.count("dead_letter"),
            failed=sum(_attempts(r) for r in results.values() if r.get("status") == "dead_letter"),
            lost=len(waited.lost),
            unfinished=len(submission.job_ids) - len(results) - len(waited.lost),
            jobs={
                job: {
                    "file": submission.names[job],
                    "error": results.get(job, {}).get("error"),
                    "status": "lost" if job in waited.lost else results.get(job, {}).get("status", "unfinished"),
                }
                for job in submission.job_ids
            },
        )
        if waited.lost:
            report["error"] = (
                f"{report['lost']} of {report['submitted']} jobs are gone from the fleet's Redis "
                f"(it restarted empty or failed over; batch {submission.batch_id} no longer exists): "
                "submit them again"
            )
    if as_json:
        echo_json(report)
    else:
        if wait:
            click.echo(
                f"{report['completed']} completed, {report['dead_letter']} dead-lettered, "
                f"{report['unfinished']} unfinished, {report['lost']} lost"
            )
            for job, info in report["jobs"].items():
                if info["status"] != "completed":
                    click.echo(f"  {job} {shown_path(info['file'])}: {info['status']} {info['error'] or ''}".rstrip())
    if wait and report["lost"]:
        click.echo(f"nkicache: error: {report['error']}", err=True)
        sys.exit(EXIT_PROJECT_ERROR)
    if wait and report["unfinished"]:
        click.echo(
            f"nkicache: error: {report['unfinished']} of {plural(report['submitted'], 'job')} unfinished after "
            f"{timeout:g} s (--timeout, default wait_timeout); they stay queued: nkicache batch show "
            f"{submission.batch_id}",
            err=True,
        )
    if wait and report["completed"] < report["submitted"]:  # dead-lettered, unfinished or unreadable
        sys.exit(EXIT_CHECK_FAILED)


def _attempts(result: dict) -> int:
    """A dead letter's attempts, 0 when its result holds no count (a hand or another tool wrote it)."""
    attempts = result.get("attempts", 0)
    return attempts if isinstance(attempts, int) and not isinstance(attempts, bool) else 0


@click.command("worker")
@tier_options
@click.option("--name", default=None, help="This worker's consumer name. Default: HOST-PID.")
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes on this machine, each its own consumer.",
)
@click.option("--max-jobs", type=click.IntRange(min=1), default=None, help="Exit after this many jobs.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Also write each artifact into this folder (artifacts always go to Redis).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="When the workers exit, print {jobs, workers: [{name, jobs}]} on stdout."
)
@click.pass_context
@_redis_errors
def worker_command(ctx, tier, tier_mode, name, concurrency, max_jobs, out_dir, as_json) -> None:
    """Compile jobs from the fleet's stream until SIGTERM or Ctrl-C.

    Reads with the consumer group, compiles with a fresh codegen loop per job (reading and mirroring the
    tier on the same Redis), stores the artifact and the result and acknowledges, in one script. Jobs
    whose worker went quiet for job_claim_idle seconds are reclaimed (XAUTOCLAIM); a job that fails
    job_max_attempts times goes to the dead-letter stream with its error. SIGTERM finishes the current
    job, then exits 0. Heartbeats every heartbeat_interval seconds show in `nkicache queue`.

    Each job compiles in a child process limited to job_memory bytes and job_timeout seconds: a job that
    raises, exceeds a limit or whose process is killed fails alone, and the worker carries on. Logs one line
    per job (taken, finished or failed, with counts and seconds) at INFO, the default here (`nkicache
    --log-level` or $NKICACHE_LOG_LEVEL to change it).
    """
    import multiprocessing

    log_level = (ctx.find_root().obj or {}).get("log_level")
    base = name or os.environ.get("NKICACHE_WORKER") or f"{socket.gethostname()}-{os.getpid()}"
    try:
        base.encode("utf-8")  # bytes that are not UTF-8 arrive escaped; Redis could not be sent them
    except UnicodeEncodeError:
        raise click.BadParameter("the worker's name is not UTF-8 text", param_hint="--name") from None
    refuse_read_only(
        load_cli_settings(tier=tier, tier_mode=tier_mode),
        "worker",
        "acknowledges jobs and stores their results and entries",
    )
    if concurrency == 1:
        _print_done([(base, _run_worker(tier, tier_mode, base, max_jobs, out_dir, log_level))], as_json)
        return
    # A Redis that is down at start is one error line here, before any process starts, not one per process.
    _settings, client, _keys = _fleet(tier, tier_mode)
    client.ping()
    client.close()
    context = multiprocessing.get_context("spawn")
    done = context.SimpleQueue()  # (name, jobs) from each process that exits cleanly
    processes = [
        context.Process(
            target=_worker_process, args=(tier, tier_mode, f"{base}-{i}", max_jobs, out_dir, log_level, done)
        )
        for i in range(concurrency)
    ]

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
        echo_json(
            {
                "jobs": sum(jobs for _, jobs in finished),
                "workers": [{"name": name, "jobs": jobs} for name, jobs in finished],
            }
        )


def _run_worker(tier, tier_mode, name, max_jobs, out_dir, log_level: str | None = None) -> int:
    from workers.cli_common import configure_logging
    from workers.fleet import Worker

    # A worker says what it does (one line per job) unless told otherwise: INFO by default.
    configure_logging(log_level or "INFO")
    settings = load_cli_settings(tier=tier, tier_mode=tier_mode)
    worker = Worker(settings, name, out_dir=out_dir, max_jobs=max_jobs)
    worker.install_signal_handlers()
    done = worker.run()
    click.echo(f"worker {name}: {plural(done, 'job')}, exiting", err=True)
    return done


def _worker_process(tier, tier_mode, name, max_jobs, out_dir, log_level, done) -> None:
    """One process of `worker --concurrency N`. Its errors are one line and exit 2, as in the command's own
    process: multiprocessing would print the traceback of an error that ends the process."""
    from bridge.errors import NkiCacheError
    from cachestore.backends.redis import redis_errors

    try:
        with redis_errors("the fleet's Redis"):
            done.put((name, _run_worker(tier, tier_mode, name, max_jobs, out_dir, log_level)))
    except NkiCacheError as exc:
        click.echo(f"nkicache: error: {exc}", err=True)
        sys.exit(EXIT_PROJECT_ERROR)


@click.command("queue")
@tier_options
@click.option("--dead-letters", is_flag=True, help="Also list the dead-lettered jobs with their errors.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--live-check",
    is_flag=True,
    help="Exit 0 if worker NAME (or NAME-i) has a fresh heartbeat, else 1: a liveness probe.",
)
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
    click.echo(
        f"pending {status['pending']}, in flight {status['in_flight']}, completed {status['completed']}, "
        f"failed attempts {status['failed']}, dead-lettered {status['dead_letter']}"
    )
    mine = toolchain_id()
    for toolchain, row in status["toolchains"].items():
        click.echo(
            f"toolchain {toolchain}{' (this compiler)' if toolchain == mine else ''}: pending "
            f"{row['pending']}, in flight {row['in_flight']}, "
            f"{plural(row['live_workers'], 'live worker')}"
        )
    for toolchain, waiting in status["unserved"].items():
        click.echo(
            f"warning: {plural(waiting, 'job')} {'waits' if waiting == 1 else 'wait'} for toolchain "
            f"{toolchain}, which no live worker has"
        )
    click.echo(plural(len(status["workers"]), "live worker"))
    for w in status["workers"]:
        age = time.time() - w["time"]
        click.echo(
            f"  {w['name']} on {w['host']} (pid {w['pid']}, toolchain {w['toolchain'] or 'unknown'}): "
            f"{plural(w['done'], 'job')}, {'on ' + w['job'] if w['job'] else 'idle'}, "
            f"seen {age:.1f} s ago"
        )
    for d in status.get("dead_letters", []):
        click.echo(f"  dead: {d['job']}: {d['error']}")


@click.group("job")
def job_group() -> None:
    """One fleet job, by the id `submit` printed."""


@job_group.command("show")
@click.argument("job_id")
@tier_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_redis_errors
def job_show_command(job_id, tier, tier_mode, as_json) -> None:
    """A job's status (completed, dead_letter, in_flight, waiting or unknown), its worker, error and counts.

    Results live job_ttl seconds (7 days by default) after the job finished; an older job is unknown. Exit 1
    when the job is unknown or dead-lettered.

    --json keys: id, status, failed_attempts, and once finished the result's fields (file, graph, worker,
    error, seconds, the pass's counts, artifact_stored).
    """
    from workers import fleet_ops

    _settings, client, keys = _fleet(tier, tier_mode)
    info = fleet_ops.job_info(client, keys, job_id)
    if as_json:
        echo_json(info)
    else:
        line = f"job {job_id}: {info['status']}"
        if info.get("file"):
            line += f", {info['file']}"
        if info.get("worker"):
            line += f", worker {info['worker']}"
        if info["status"] == "completed":
            line += (
                f", {plural(info.get('kernels', 0), 'kernel')}, {plural(info.get('traces', 0), 'trace')}, "
                f"{info['seconds']:.2f} s"
            )
        if info["failed_attempts"]:
            line += f", {plural(info['failed_attempts'], 'failed attempt')}"
        click.echo(line)
        if info.get("error"):
            click.echo(f"  error: {info['error']}")
        if info["status"] == "unknown":
            click.echo("  never submitted, or finished more than job_ttl seconds ago (its result expired)")
    if info["status"] in ("unknown", "dead_letter"):
        sys.exit(EXIT_CHECK_FAILED)


@click.group("batch")
def batch_group() -> None:
    """One fleet batch (one `submit`), by the batch id it printed."""


@batch_group.command("show")
@click.argument("batch_id")
@tier_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@_redis_errors
def batch_show_command(batch_id, tier, tier_mode, as_json) -> None:
    """Every job of a batch with its status and error. Exit 1 while some are unfinished or dead-lettered.

    --json keys: batch, submitted, completed, dead_letter, unfinished, jobs ({id: {status, file, error,
    worker, seconds}}).
    """
    from workers import fleet_ops

    _settings, client, keys = _fleet(tier, tier_mode)
    info = fleet_ops.batch_info(client, keys, batch_id)
    if as_json:
        echo_json(info)
    else:
        click.echo(
            f"batch {batch_id}: {plural(info['submitted'], 'job')}, {info['completed']} completed, "
            f"{info['dead_letter']} dead-lettered, {info['unfinished']} unfinished"
            + (f", {info['unreadable']} unreadable" if info["unreadable"] else "")
        )
        for job, row in info["jobs"].items():
            click.echo(f"  {job} {row['status']} {row['file'] or ''} {row['error'] or ''}".rstrip())
    if info["completed"] < info["submitted"]:  # dead-lettered, unfinished or unreadable
        sys.exit(EXIT_CHECK_FAILED)


@click.command("requeue")
@click.argument("job_ids", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Requeue every dead letter.")
@tier_options
@_redis_errors
def requeue_command(job_ids, everything, tier, tier_mode) -> None:
    """Put dead-lettered jobs back on their toolchain's stream, as new jobs with job_max_attempts attempts.

    Name the jobs (JOB_ID...) or give --all. A dead letter that holds no job (a malformed message) is left
    where it is, with a line saying so. Exit 1 when some could not be requeued.
    """
    from workers import fleet_ops

    if bool(job_ids) == everything:
        raise click.UsageError("name the jobs to requeue, or give --all (not both)")
    settings, client, keys = _fleet(tier, tier_mode)
    refuse_read_only(settings, "requeue", "queues jobs again")
    requeued, problems = fleet_ops.requeue(client, keys, list(job_ids) or None, settings.job_ttl)
    click.echo(f"{plural(len(requeued), 'job')} requeued" + (": " + ", ".join(requeued) if requeued else ""))
    for problem in problems:
        click.echo(f"nkicache: error: {problem}", err=True)
    if problems:
        sys.exit(EXIT_CHECK_FAILED)


@click.command("purge")
@click.option("--dead-letters", is_flag=True, help="Delete every dead letter.")
@click.option("--waiting", is_flag=True, help="Delete this toolchain's jobs that no worker has taken yet.")
@tier_options
@_redis_errors
def purge_command(dead_letters, waiting, tier, tier_mode) -> None:
    """Delete dead letters and/or waiting jobs. Jobs in flight finish; finished results expire by themselves
    (job_ttl)."""
    from workers import fleet_ops

    if not (dead_letters or waiting):
        raise click.UsageError("say what to purge: --dead-letters and/or --waiting")
    settings, client, keys = _fleet(tier, tier_mode)
    refuse_read_only(settings, "purge", "deletes jobs")
    purged = fleet_ops.purge(client, keys, dead_letters, waiting)
    click.echo(f"purged {plural(purged['dead_letters'], 'dead letter')}, {plural(purged['waiting'], 'waiting job')}")
