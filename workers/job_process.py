"""A fleet worker's compiling process: jobs are compiled here, never in the worker itself.

Whatever a job does to the process compiling it (an exception, a RecursionError, a MemoryError at the
address-space limit, an out-of-memory kill, a hang past `job_timeout`) costs that job only: the worker sees
the process's answer, or its death, and fails the job with one line saying which; the next job gets a fresh
process. The process is long-lived otherwise (the compiler is imported once, the tier client keeps its
connections and breaker), and is limited to `job_memory` bytes of address space (RLIMIT_AS).

Protocol, over the child's stdin and stdout as `multiprocessing.connection` byte messages (never pickles):
the worker sends the settings once, then one job at a time; the child answers each with a JSON header (the
PassResult's fields) and the artifact's bytes. The child exits as soon as its stdin closes: a worker that
dies (SIGKILL included) takes its compiling process with it, mid-compile or not.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec

from bridge.errors import NkiCacheError
from cachestore.settings import Settings
from workers.blas import ONE_BLAS_THREAD
from workers.own_code import own_code_environment
from workers.passes import PassResult

if TYPE_CHECKING:
    from bridge.limits import Limits
    from bridge.port import KernelStore

logger = logging.getLogger(__name__)


class CompileProcessError(NkiCacheError):
    """The compiling process cannot be started at all (a worker's problem, not a job's)."""


READY = b"ready"
STARTUP_TIMEOUT = 120.0  # seconds for a compiling process to import the compiler and open its tier


class CompileProcess:
    """The worker's side: one child at a time, started on the first job and after each one that killed it."""

    def __init__(self, settings: Settings, out_dir: str | None = None, log_level: int | None = None):
        self.settings = settings
        self.out_dir = out_dir
        self.log_level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        self._process: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._receive: Connection | None = None
        self.started = 0  # child processes started so far (a fresh one after each death)

    @property
    def pid(self) -> int | None:
        process = self._process  # read once: the heartbeat thread asks while the worker may be replacing it
        return process.pid if process is not None else None

    def start(self) -> None:
        """Start the child now (a worker does, before its first job): a process that cannot start at all is
        the worker's problem, to be told before any job is failed for it."""
        try:
            self._ensure_started()
        except (EOFError, OSError):
            raise CompileProcessError(f"cannot start a compiling process: {self._death()}") from None

    def compile(self, job: dict) -> tuple[PassResult, bytes | None]:
        """Compile one job in the child; any failure, the child's death included, is the job's error."""
        try:
            self._ensure_started()
            message = {key: job[key] for key in ("id", "file", "graph", "streams", "trace") if key in job}
            self._send.send_bytes(json.dumps(message).encode())
            if not self._receive.poll(self.settings.job_timeout):
                self._kill()
                limit = self.settings.job_timeout
                error = f"{job['file']}: compiling took longer than the limit job_timeout = {limit:g} s; killed"
                return PassResult(job["file"], error=error), None
            header = json.loads(self._receive.recv_bytes())
            artifact = self._receive.recv_bytes() if header.pop("artifact") else None
        except (EOFError, OSError):
            return PassResult(job["file"], error=f"{job['file']}: {self._death()}"), None
        if header.pop("exit", False):  # it ran out of memory: its heap is suspect, start the next job afresh
            self._reap()
        return PassResult(**header), artifact

    def _ensure_started(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self._reap()
        # The worker's own code, whatever its current directory holds (workers.own_code); and one BLAS thread
        # whatever the worker's environment says: each reserves address space, which job_memory bounds.
        env = {**own_code_environment(), **ONE_BLAS_THREAD}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "workers.job_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )
        self._send = Connection(os.dup(self._process.stdin.fileno()), readable=False)
        self._receive = Connection(os.dup(self._process.stdout.fileno()), writable=False)
        self._process.stdin.close()
        self._process.stdout.close()
        self.started += 1
        hello = {"settings": _settings_json(self.settings), "out_dir": self.out_dir, "log_level": self.log_level}
        self._send.send_bytes(json.dumps(hello).encode())
        # job_timeout bounds a job's compile, not the start of a process (imports, the tier's connection).
        if not self._receive.poll(STARTUP_TIMEOUT) or self._receive.recv_bytes() != READY:
            raise OSError("the compiling process did not start")

    def _death(self) -> str:
        """Why the child stopped answering, once it has exited (it is killed if it has not)."""
        process = self._process
        if process is not None:
            # It closed its end of the pipe: most likely it is exiting; give it a moment to say with what.
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=1)
        self._kill()
        code = process.returncode if process is not None else None
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            hint = " (the out-of-memory killer, or an operator)" if -code == signal.SIGKILL else ""
            return f"the compiling process was killed by {name}{hint}"
        return f"the compiling process exited with code {code} before answering"

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        self._reap()

    def _reap(self) -> None:
        for connection in (self._send, self._receive):
            if connection is not None:
                connection.close()
        self._send = self._receive = None
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def close(self) -> None:
        """Let the child close its tier client (flushing what it mirrors) and exit; kill it if it will not."""
        if self._send is not None:
            self._send.close()
            self._send = None
        if self._process is not None:
            try:
                self._process.wait(timeout=self.settings.final_flush_timeout + 5)
            except subprocess.TimeoutExpired:
                self._process.kill()
        self._reap()


def _settings_json(settings: Settings) -> dict[str, Any]:
    values = msgspec.structs.asdict(settings)
    if values["hmac_key"] is not None:
        values["hmac_key"] = base64.b64encode(values["hmac_key"]).decode()
    return values


def _settings_from_json(values: dict[str, Any]) -> Settings:
    if values.get("hmac_key") is not None:
        values["hmac_key"] = base64.b64decode(values["hmac_key"])
    known = set(Settings.__struct_fields__)
    return Settings(**{k: v for k, v in values.items() if k in known})


# -- the child ----------------------------------------------------------------------------------------
def _child() -> None:
    import resource

    from cachestore.stores import open_tier
    from workers.cli_common import configure_logging

    # The protocol owns the real stdout; anything the compiler prints goes to stderr, not into a message.
    receive = Connection(os.dup(0), writable=False)
    send = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    # A terminal's Ctrl-C and a supervisor's SIGTERM to the whole group are for the worker, which finishes the
    # current job and then closes our stdin: that, not a signal, ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hello = json.loads(receive.recv_bytes())
    settings = _settings_from_json(hello["settings"])
    configure_logging(hello["log_level"])
    resource.setrlimit(resource.RLIMIT_AS, (settings.job_memory, settings.job_memory))
    jobs: queue.Queue = queue.Queue()
    busy, gone = threading.Event(), threading.Event()

    def read() -> None:
        # The worker closing our stdin (or dying) is the end: idle, finish cleanly; with a job taken or still
        # queued (a worker killed just after sending it), exit at once: the job is no longer ours to finish,
        # and another worker will take it over. `gone` is set before `busy` is read here, and `busy` before
        # `gone` is read by the main loop, so one of the two sees the other.
        try:
            while True:
                jobs.put(receive.recv_bytes())
        except (EOFError, OSError):
            gone.set()
            if busy.is_set() or not jobs.empty():
                os._exit(1)
            jobs.put(None)

    threading.Thread(target=read, name="nkicache-job-reader", daemon=True).start()
    tier = open_tier(settings)
    queue_for = _trace_task_queue(settings)
    limits = settings.limits()
    send.send_bytes(READY)
    try:
        while (message := jobs.get()) is not None:
            busy.set()
            if gone.is_set():
                os._exit(1)
            result, artifact = answer_job(json.loads(message), tier, limits, hello["out_dir"], queue_for)
            out_of_memory = result.error is not None and "out of memory" in result.error
            header = {**msgspec.structs.asdict(result), "artifact": artifact is not None, "exit": out_of_memory}
            send.send_bytes(json.dumps(header).encode())
            if artifact is not None:
                send.send_bytes(artifact)
            busy.clear()
            if out_of_memory:
                break
    finally:
        if tier is not None:
            tier.close()


def answer_job(
    job: dict, tier: KernelStore | None, limits: Limits, out_dir: str | None, queue_for: Any
) -> tuple[PassResult, bytes | None]:
    """What the compiling process answers for one job message (a job, or another job's trace task), once the
    job's writes are stored: its traced entries and its pass's metrics batch. The pass hands them to the tier
    without waiting, and the worker acknowledges the job on this answer: a process killed after answering with
    them still queued would lose the batch of a job the fleet counts as done. The wait is bounded
    (final_flush_timeout); while the tier is down they stay queued, as any write does, and the job is answered."""
    from bridge.graph import GraphError, parse_graph_json
    from workers.trace_tasks import compile_job, run_task

    if "trace" in job:  # another job's trace task (workers/trace_tasks.py)
        result, artifact = run_task(job["trace"], tier, limits), None
    else:
        try:
            graph = parse_graph_json(job["graph"], job["file"])
        except GraphError as exc:
            result, artifact = PassResult(job["file"], error=str(exc)), None
        else:
            result, artifact = compile_job(
                graph, job, tier=tier, limits=limits, out_dir=out_dir, enqueue=queue_for(job)
            )
    if tier is not None:
        tier.flush()
    return result, artifact


def _trace_task_queue(settings: Settings) -> Any:
    """queue_for(job): how a job's trace tasks go onto its stream (None: the job names none), over one Redis
    connection opened on the first job that has tasks to share."""
    from functools import partial

    from bridge.identity import toolchain_id
    from cachestore.keys import KeySpace
    from workers.fleet_wakeups import wake_workers
    from workers.trace_tasks import enqueue_tasks

    clients: list[Any] = []

    def enqueue(streams: list[str], job_id: str, tasks: Any) -> Any:
        if not clients:
            from workers.fleet_connection import fleet_client

            clients.append(fleet_client(settings))
        keys = KeySpace(settings.namespace)
        wake = partial(wake_workers, clients[0], keys, toolchain_id(), ttl=settings.job_ttl)
        return enqueue_tasks(clients[0], streams, job_id, tasks, keys.job_traced(job_id), wake)

    def queue_for(job: dict) -> Any:
        streams = job.get("streams")
        if not isinstance(streams, list) or not streams or not all(isinstance(s, str) for s in streams):
            return None
        return partial(enqueue, streams, job["id"])

    return queue_for


if __name__ == "__main__":
    _child()
