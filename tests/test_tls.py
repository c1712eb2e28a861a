"""The Redis tier over TLS (rediss://) against a redis-server with a self-signed CA and certificate made here.

A compile that trusts the CA (`?ssl_ca_certs=` in the URL) gets remote hits on its second pass; a client that
does not trust it fails the handshake, which is counted as tier errors while the compile still succeeds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from helpers_graphs import MIXED_DISTINCT_KEYS, mixed_graph, unique_namespace, write_graph
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_cluster import start_cluster, start_server, unavailable

from bench.dev_redis import pings
from cachestore.backends.redis import connect
from workers.cli import main as nkicache

pytestmark = pytest.mark.redis


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> dict[str, Path]:
    """A self-signed CA, and a certificate for 127.0.0.1 and localhost signed by it (EC P-256, 1 day). It also
    serves as a client certificate: cluster nodes authenticate each other on the TLS cluster bus."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=nkicache test CA",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=directory)  # fmt: skip
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=directory)
    (directory / "server.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.crt", "-days", "1", "-extfile", "server.ext", cwd=directory)  # fmt: skip
    return {name: directory / f"{name.replace('_', '.')}" for name in ("ca_crt", "server_crt", "server_key")}


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """(port, CA file) of a redis-server that speaks only TLS."""
    if shutil.which("openssl") is None:
        unavailable("the openssl command is needed to make the test certificates")
    directory = tmp_path_factory.mktemp("tls")
    files = make_certificates(directory)

    def answers(port: int) -> bool:
        return pings(redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(files["ca_crt"]),
                                 socket_timeout=0.5, socket_connect_timeout=0.5))  # fmt: skip

    args = ["--port", "0", "--tls-port", "{port}", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--tls-cert-file", str(files["server_crt"]), "--tls-key-file", str(files["server_key"]),
            "--tls-ca-cert-file", str(files["ca_crt"]), "--tls-auth-clients", "no"]  # fmt: skip
    try:
        server = start_server(args, answers)
    except RuntimeError as exc:
        unavailable(f"redis-server with TLS: {exc}")
        raise AssertionError("unreachable") from exc
    try:
        yield server.port, files["ca_crt"]
    finally:
        server.cleanup()


def compile_json(tier: str, *args: str) -> dict:
    result = CliRunner().invoke(nkicache, ["compile", "--workers", "1", "--json", "--tier", tier, *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


def test_the_server_speaks_only_tls(tls_server: tuple[int, Path]) -> None:
    port, ca = tls_server
    plain = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5, socket_connect_timeout=0.5,
                        retry=Retry(NoBackoff(), 0))  # fmt: skip
    try:
        with pytest.raises(redis.ConnectionError):
            plain.ping()
    finally:
        plain.close()
    client = connect(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}", connect_timeout=1, op_timeout=1)
    try:
        assert client.ping() is True
        assert client.connection_pool.connection_kwargs["ssl_ca_certs"] == str(ca)  # from the URL's query
    finally:
        client.close()


def test_compile_over_tls_hits_on_the_second_pass(
    tls_server: tuple[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port, ca = tls_server
    monkeypatch.setenv("NKICACHE_NAMESPACE", unique_namespace())
    tier = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
    graph = write_graph(tmp_path, mixed_graph("tls"))
    first = compile_json(tier, str(graph), "--out", str(tmp_path / "a"))
    assert first["traces"] == MIXED_DISTINCT_KEYS and first["tier_errors"] == first["tier_timeouts"] == 0
    second = compile_json(tier, str(graph), "--out", str(tmp_path / "b"))
    assert second["remote_hits"] == MIXED_DISTINCT_KEYS and second["traces"] == 0
    assert second["tier_errors"] == second["tier_timeouts"] == second["tier_rejected"] == 0
    assert (tmp_path / "a" / "tls.nkibb").read_bytes() == (tmp_path / "b" / "tls.nkibb").read_bytes()


def test_a_client_that_does_not_trust_the_ca_is_counted_and_the_compile_succeeds(
    tls_server: tuple[int, Path], tmp_path: Path
) -> None:
    port, _ = tls_server
    graph = write_graph(tmp_path, mixed_graph("tls-untrusted"))
    started = time.monotonic()
    run = compile_json(f"rediss://127.0.0.1:{port}/0", str(graph), "--out", str(tmp_path / "out"))  # system CAs
    assert time.monotonic() - started < 10
    assert run["compiled"] == 1 and run["traces"] == MIXED_DISTINCT_KEYS and run["remote_hits"] == 0
    assert run["tier_errors"] >= 1  # CERTIFICATE_VERIFY_FAILED, counted apart from misses
    assert (tmp_path / "out" / "tls-untrusted.nkibb").exists()


def test_a_tls_cluster_url_carries_its_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """rediss+cluster://h:p,h:p?ssl_ca_certs=... reaches every node over TLS with that CA."""
    files = make_certificates(tmp_path)
    try:
        cluster = start_cluster(tls={"ca": str(files["ca_crt"]), "cert": str(files["server_crt"]),
                                     "key": str(files["server_key"])})  # fmt: skip
    except RuntimeError as exc:
        unavailable(f"a Redis Cluster with TLS: {exc}")
        raise AssertionError("unreachable") from exc
    try:
        monkeypatch.setenv("NKICACHE_NAMESPACE", unique_namespace())
        graph = write_graph(tmp_path, mixed_graph("tls-cluster"))
        first = compile_json(cluster.url, str(graph), "--out", str(tmp_path / "a"))
        second = compile_json(cluster.url, str(graph), "--out", str(tmp_path / "b"))
        assert first["tier_errors"] == second["tier_errors"] == 0, first
        assert first["traces"] == second["remote_hits"] == MIXED_DISTINCT_KEYS
    finally:
        cluster.cleanup()
