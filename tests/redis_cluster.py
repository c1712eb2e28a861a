"""Real Redis servers of our own for the deployment tests: a 3-master Redis Cluster, and single servers
started with extra arguments (an ACL file, TLS) whose readiness is not a plain PING.

Every process runs on free loopback ports in a temporary directory, without persistence, and is killed by
`cleanup()`. Nothing here touches the shared server on 6379.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import redis

from bench.dev_redis import die_with_parent, pings

START_TIMEOUT_SECONDS = 15.0
MASTERS = 3
# Failure detection: a killed master is marked FAIL by the others after this many milliseconds. With
# cluster-require-full-coverage off, the surviving masters keep serving their own slots meanwhile.
NODE_TIMEOUT_MS = 2000


def unavailable(reason: str) -> None:
    """Skip locally, fail under CI=true: the deployment tests must not be skipped in CI."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: Redis tests must not be skipped)", pytrace=False)
    pytest.skip(reason)


def free_loopback_ports(count: int) -> list[int]:
    """`count` distinct ports that were free a moment ago (all held open together, so none repeats)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class ServerProcess:
    """One redis-server process with the given arguments, its files in a temporary directory."""

    def __init__(self, args: Sequence[str], port: int, directory: Path | None = None) -> None:
        self.port = port
        self.dir = Path(directory or tempfile.mkdtemp(prefix="nkicache-redis-"))
        self.args = ["redis-server", *args, "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log")]
        self.process: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, ready: Callable[[], bool], timeout: float = START_TIMEOUT_SECONDS) -> ServerProcess:
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"redis-server on port {self.port} exited with {self.process.returncode}: {self.log()}"
                )
            if ready():
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server on port {self.port} was not ready in {timeout} s: {self.log()}")

    def log(self, lines: int = 5) -> str:
        try:
            return " | ".join((self.dir / "redis.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        if self.running:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_server(args: Sequence[str], ready: Callable[[int], bool], attempts: int = 3) -> ServerProcess:
    """A redis-server with `args`, in which "{port}" stands for a free loopback port; `ready(port)` says when
    it answers. Retries on another port when the chosen one was taken before redis bound it."""
    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed")
    last_error: Exception | None = None
    for _ in range(attempts):
        (port,) = free_loopback_ports(1)
        server = ServerProcess([arg.replace("{port}", str(port)) for arg in args], port)
        try:
            return server.start(lambda port=port: ready(port))
        except RuntimeError as exc:
            server.cleanup()
            last_error = exc
            if "in use" not in str(exc):  # a bad configuration fails the same way on any port
                break
    raise RuntimeError(f"could not start redis-server {' '.join(args)}: {last_error}")


def _client(port: int, timeout: float = 0.5, ca_file: str | None = None) -> redis.Redis:
    tls = {"ssl": True, "ssl_ca_certs": ca_file} if ca_file else {}
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout, **tls)


def _answers(port: int, ca_file: str | None = None) -> bool:
    return pings(_client(port, 0.2, ca_file))


class LocalCluster:
    """A Redis Cluster of `MASTERS` masters and no replicas on loopback ports.

    With `tls` ({"ca": ..., "cert": ..., "key": ...} file paths) every node speaks only TLS, the cluster bus
    included, and `url` is a rediss+cluster:// URL that names the CA."""

    def __init__(self, tls: dict[str, str] | None = None) -> None:
        self.nodes: list[ServerProcess] = []
        self.tls = tls
        self._ca = tls["ca"] if tls else None

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"rediss+cluster://{nodes}?ssl_ca_certs={self._ca}" if self.tls else f"redis+cluster://{nodes}"

    def _node_args(self, port: int, bus_port: int) -> list[str]:
        args = [
            "--bind", "127.0.0.1", "--cluster-enabled", "yes",
            "--cluster-port", str(bus_port), "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
            "--save", "", "--appendonly", "no", "--daemonize", "no",
        ]  # fmt: skip
        if not self.tls:
            return ["--port", str(port), *args]
        return ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes", "--tls-auth-clients", "no",
                "--tls-cert-file", self.tls["cert"], "--tls-key-file", self.tls["key"],
                "--tls-ca-cert-file", self.tls["ca"], *args]  # fmt: skip

    def start(self) -> LocalCluster:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server and redis-cli are needed for a Redis Cluster")
        ports = free_loopback_ports(2 * MASTERS)  # a client port and a cluster bus port per master
        for port, bus_port in zip(ports[:MASTERS], ports[MASTERS:], strict=True):
            node = ServerProcess(self._node_args(port, bus_port), port)
            self.nodes.append(node)
            node.start(lambda port=port: _answers(port, self._ca))
        if self.tls:
            self._create_by_hand(ports[MASTERS:])
        else:
            create = subprocess.run(
                ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            if create.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout[-500:]} {create.stderr[-500:]}")
        self.wait_until_ok()
        return self

    def _create_by_hand(self, bus_ports: list[int]) -> None:
        """What `redis-cli --cluster create` does, done here: redis-cli 7.0 waits forever for a TLS-only cluster
        (client port 0) to join, although the nodes agree within seconds."""
        per_master = 16384 // MASTERS
        for i, port in enumerate(self.ports):
            client = _client(port, 5.0, self._ca)
            try:
                last = 16383 if i == MASTERS - 1 else (i + 1) * per_master - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per_master, last)
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                if i:
                    client.execute_command("CLUSTER", "MEET", "127.0.0.1", self.ports[0], bus_ports[0])
            finally:
                client.close()

    def wait_until_ok(self, timeout: float = START_TIMEOUT_SECONDS) -> None:
        """Every master reports cluster_state:ok and knows every other master."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._node_ok(port) for port in self.ports):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the cluster on ports {self.ports} did not reach cluster_state:ok in {timeout} s")

    def _node_ok(self, port: int) -> bool:
        client = _client(port, ca_file=self._ca)
        try:
            info = client.cluster("info")
        except redis.RedisError:
            return False
        finally:
            client.close()
        return info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == MASTERS

    def port_of_slot(self, slot: int) -> int:
        """The port of the master serving `slot`."""
        client = _client(self.ports[0], ca_file=self._ca)
        try:
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        finally:
            client.close()
        raise LookupError(f"slot {slot} is not served")

    def node(self, port: int) -> ServerProcess:
        return next(node for node in self.nodes if node.port == port)

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()


def start_cluster(attempts: int = 3, tls: dict[str, str] | None = None) -> LocalCluster:
    last_error: Exception | None = None
    for _ in range(attempts):
        cluster = LocalCluster(tls)
        try:
            return cluster.start()
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            cluster.cleanup()
            last_error = exc
    raise RuntimeError(f"could not start a Redis Cluster: {last_error}")
