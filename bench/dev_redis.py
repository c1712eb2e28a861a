"""A development and benchmark utility, not part of the cache: starts a throwaway redis-server.

The server listens on a free loopback port, persists nothing (no RDB, no AOF; its own temp dir, removed on
cleanup) and never touches a shared Redis such as the machine's 6379. `nkicache bench` measures against
one, and the tests use it for servers of their own that they may fill, kill or restart (tests/conftest.py,
the cluster, ACL, TLS and fault tests); bench/report_scale.py starts one too. Development tooling of the source
checkout (the bench package), never shipped; nothing in bridge, cachestore or workers imports it.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence

import redis

START_TIMEOUT_SECONDS = 10.0
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that started it exits


def die_with_parent() -> None:
    """Run in a child between fork and exec (Popen's preexec_fn): on Linux, the child is SIGKILLed when the
    process that started it dies, however it dies (kill -9 included), so a killed test run or bench leaves no
    throwaway server running, stopped or not. Elsewhere, nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pings(client: redis.Redis, *, close: bool = True) -> bool:
    """Whether `client`'s server answers PING (any Redis error is a no); closes the client unless told not to."""
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        if close:
            client.close()


def answers_ping(url: str, timeout: float = 1.0) -> bool:
    return pings(redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout))


class RedisServer:
    """redis-server on a loopback port, without persistence unless `extra_args` ask for it.

    `stop()` shuts it down gracefully, `kill()` sends SIGKILL, `start()` (re)starts it on the same port.
    """

    def __init__(self, port: int | None = None, extra_args: Sequence[str] = ()) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed")
        self.port = port or free_loopback_port()
        self.extra_args = list(extra_args)
        self.dir = tempfile.mkdtemp(prefix="nkicache-redis-")
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> RedisServer:
        if self.running:
            return self
        command = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.dir,
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.process.returncode}")
            if answers_ping(self.url, timeout=0.2):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {START_TIMEOUT_SECONDS} s")

    def stop(self) -> None:
        if self.running:
            self.process.terminate()
            try:
                self.process.wait(timeout=START_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.running:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def start_private_server(attempts: int = 3, extra_args: Sequence[str] = ()) -> RedisServer:
    """Start a server on a free port; retry when another process grabs the port before redis binds it."""
    last_error: Exception | None = None
    for _ in range(attempts):
        server = RedisServer(extra_args=extra_args)
        try:
            return server.start()
        except RuntimeError as exc:
            server.cleanup()
            last_error = exc
    raise RuntimeError(f"could not start a private redis-server: {last_error}")
