"""A password given in the tier URL, in any form redis-py takes, is never printed: not by compile (text and
JSON), report (text, JSON, Prometheus, HTML), serve-metrics (its start-up line and its scrapes), errors,
warnings or logs, whether the password is right or wrong."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from helpers_graphs import mixed_graph, unique_namespace, write_graph

from cachestore.tier_urls import redact_url
from workers.cli import main

SECRET = "s3cret-Pa55word-7d41"
URL_FORMS = {
    "user-info": "redis://default:{password}@127.0.0.1:{port}/0",
    "password-only": "redis://:{password}@127.0.0.1:{port}/0",
    "query": "redis://127.0.0.1:{port}/0?password={password}",
    "query-and-more": "redis://127.0.0.1:{port}/0?socket_keepalive=true&password={password}",
}


@pytest.fixture
def protected_port(private_redis_server) -> int:
    """A private redis-server that asks for SECRET (set once it runs: the launcher pings without one)."""
    server = private_redis_server()
    redis.Redis.from_url(server.url).config_set("requirepass", SECRET)
    return server.port


def test_redaction_of_every_form() -> None:
    for form in URL_FORMS.values():
        url = form.format(password=SECRET, port=6379)
        assert SECRET not in redact_url(url) and "127.0.0.1:6379" in redact_url(url), url
    assert redact_url("rediss+cluster://u:" + SECRET + "@a:1,b:2/0?ssl_password=" + SECRET) == (
        "rediss+cluster://u@a:1,b:2/0"
    )
    assert redact_url("unix:///run/redis.sock?db=1&password=" + SECRET) == "unix:///run/redis.sock?db=1"
    assert redact_url("local:/tmp/tier.sqlite") == "local:/tmp/tier.sqlite"


def run(*args: str, env: dict[str, str]) -> str:
    result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return result.output + (result.stderr if result.stderr_bytes is not None else "")


@pytest.mark.parametrize("password", [SECRET, "wrong-" + SECRET], ids=["right", "wrong"])
@pytest.mark.parametrize("form", sorted(URL_FORMS))
def test_no_output_prints_the_password(
    protected_port: int, tmp_path: Path, caplog: pytest.LogCaptureFixture, form: str, password: str
) -> None:
    caplog.set_level(logging.DEBUG)
    url = URL_FORMS[form].format(password=password, port=protected_port)
    env = {"NKICACHE_NAMESPACE": unique_namespace(), "NKICACHE_TIER": url}
    graph = write_graph(tmp_path, mixed_graph())
    outputs = {
        "compile --json": run("compile", str(graph), "--out", str(tmp_path / "a"), "--json", env=env),
        "compile": run("compile", str(graph), "--out", str(tmp_path / "b"), env=env),
        "report": run("report", env=env),
        "report --json": run("report", "--json", env=env),
        "report --prometheus": run("report", "--prometheus", env=env),
        "report --html": run("report", "--html", str(tmp_path / "report.html"), env=env),
        "inspect ls": run("inspect", "ls", env=env),
    }
    if (tmp_path / "report.html").exists():
        outputs["report.html"] = (tmp_path / "report.html").read_text()
    outputs["serve-metrics"] = serve_metrics(url, env)
    outputs["logs"] = caplog.text
    assert "127.0.0.1" in outputs["compile --json"]  # the outputs do name the tier
    for name, text in outputs.items():
        assert password not in text and SECRET not in text, f"{name} printed the password:\n{text}"


def serve_metrics(url: str, env: dict[str, str]) -> str:
    """The start-up line and one scrape of `nkicache serve-metrics`, run as its own process."""
    command = [sys.executable, "-c", "from workers.cli import main; main()", "serve-metrics", "--tier", url,
               "--port", "0"]  # fmt: skip
    process = subprocess.Popen(command, env={**_environ(), **env}, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stderr.readline()
        address = line.split("serving ", 1)[1].split(" ", 1)[0]
        deadline = time.monotonic() + 10
        scrape = ""
        while time.monotonic() < deadline and not scrape:
            try:
                scrape = urllib.request.urlopen(address, timeout=5).read().decode()
            except OSError:
                time.sleep(0.1)
        return line + scrape
    finally:
        process.terminate()
        rest = process.communicate(timeout=10)[1]
        assert SECRET not in rest


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)
