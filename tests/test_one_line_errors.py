"""Bad input and a Redis that is down give one line on stderr (`nkicache: error: ...`) and exit code 2 (or the
command's documented code), never a traceback: each case of issue 15 run through the real command line, in a
process of its own, so that what is checked is exactly what a user sees."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest
import redis
from helpers_graphs import delete_namespace, metrics_shards, mixed_graph, unique_namespace, write_graph

from bench.dev_redis import RedisServer
from cachestore.entry import SignaturePolicy, decode_entry
from cachestore.settings import load_settings

NKICACHE = str(Path(sys.executable).with_name("nkicache"))
PROCESS_TIMEOUT = 120
BINARY_KEY = bytes(range(256))[-32:]  # not UTF-8 (bytes >= 0x80), as a key from /dev/urandom usually is


def nkicache(*args: object, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([NKICACHE, *map(str, args)], capture_output=True, text=True, timeout=PROCESS_TIMEOUT,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})}, cwd=cwd)  # fmt: skip


def one_line_error(result: subprocess.CompletedProcess, code: int = 2) -> str:
    """The one error line of a command that failed as it should: exit `code`, that line alone on stderr."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nkicache: error: "), result.stderr
    return lines[0]


# -- settings ---------------------------------------------------------------------------------------------
def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "nkicache.toml"
    config.write_bytes(b'tier = "off"\n# caf\xe9\n')  # Latin-1, as an editor may save it
    line = one_line_error(nkicache("compile", write_graph(tmp_path, mixed_graph()), "--out", tmp_path / "out",
                                   env={"NKICACHE_CONFIG": str(config)}))  # fmt: skip
    assert str(config) in line and "UTF-8" in line


def test_a_binary_hmac_key_file_is_the_key_s_raw_bytes(tmp_path: Path) -> None:
    """A random key is binary: a key file that is not text is taken whole, as bytes, and signs and verifies."""
    key_file = tmp_path / "hmac.key"
    key_file.write_bytes(BINARY_KEY)
    assert load_settings(environ={"NKICACHE_HMAC_KEY_FILE": str(key_file)}).hmac_key == BINARY_KEY
    tier = tmp_path / "tier.sqlite"
    env = {"NKICACHE_HMAC_KEY_FILE": str(key_file), "NKICACHE_TIER": f"local:{tier}"}
    compiled = nkicache("compile", write_graph(tmp_path, mixed_graph()), "--out", tmp_path / "out", env=env)
    assert compiled.returncode == 0 and "Traceback" not in compiled.stderr, compiled.stderr
    verified = nkicache("inspect", "verify", env=env)
    assert verified.returncode == 0 and verified.stderr == "" and ": 6 ok, 0 problems" in verified.stdout, verified

    from cachestore.backends.sqlite import SqliteBackend

    backend = SqliteBackend(tier, create=False)
    try:
        stored = [raw.data for raw in backend.scan_entries()]
    finally:
        backend.close()
    assert stored and all(decode_entry(data, SignaturePolicy(BINARY_KEY)).signed for data in stored)
    key_file.write_text("  text-key\n")  # a text key file is still its text, without the newline
    assert load_settings(environ={"NKICACHE_HMAC_KEY_FILE": str(key_file)}).hmac_key == b"text-key"


def test_a_redis_password_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_bytes(BINARY_KEY)
    line = one_line_error(nkicache("report", env={"NKICACHE_REDIS_PASSWORD_FILE": str(password_file)}))
    assert str(password_file) in line and "UTF-8" in line


# -- the fleet with its Redis down --------------------------------------------------------------------------
@pytest.fixture
def down_redis_url(private_redis_server: Callable[[], RedisServer]) -> str:
    """The URL of a Redis that was there and is stopped: nothing listens on its port."""
    server = private_redis_server()
    server.stop()
    return server.url


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_a_worker_started_while_redis_is_down_is_one_line(down_redis_url: str, concurrency: str) -> None:
    result = nkicache("worker", "--tier", down_redis_url, "--max-jobs", "1", "--concurrency", concurrency)
    assert "ConnectionError" in one_line_error(result)


# -- submit: every graph is checked before any is enqueued ----------------------------------------------------
def submit_problems(folder: Path) -> dict[str, Path]:
    """A graph file for each way `submit` must refuse one: too large, not UTF-8, not JSON, not a graph."""
    folder.mkdir(parents=True, exist_ok=True)
    from workers.fleet import MAX_GRAPH_BYTES

    graph = mixed_graph("oversized")
    problems = {
        "oversized": json.dumps(graph) + " " * MAX_GRAPH_BYTES,  # valid JSON, valid graph: only too large
        "not-utf8": json.dumps(mixed_graph("latin")).replace('"latin"', '"caf\xe9"').encode("latin-1"),
        "not-json": '{"name": "broken", "ops": [}',
        "not-a-graph": json.dumps({"name": "no-ops", "tensors": {}}),
        "missing": None,
    }
    paths = {}
    for name, content in problems.items():
        paths[name] = folder / f"{name}.json"
        if isinstance(content, str):
            paths[name].write_text(content)
        elif content is not None:
            paths[name].write_bytes(content)
    return paths


@pytest.fixture
def namespace(redis_client: redis.Redis) -> Iterator[str]:
    """A key namespace of this test's own on the shared Redis, deleted afterwards."""
    name = unique_namespace()
    yield name
    delete_namespace(redis_client, name)


@pytest.mark.parametrize("problem", ["oversized", "not-utf8", "not-json", "not-a-graph", "missing"])
def test_submit_enqueues_nothing_when_one_graph_is_bad(
    problem: str, tmp_path: Path, redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """Good graphs before and after the bad one: none of them is enqueued, and the error names the bad file."""
    good = [write_graph(tmp_path, mixed_graph(f"good-{i}")) for i in range(2)]
    bad = submit_problems(tmp_path / "bad")[problem]
    result = nkicache("submit", good[0], bad, good[1], "--tier", redis_url, env={"NKICACHE_NAMESPACE": namespace})
    line = one_line_error(result)
    assert str(bad) in line and str(good[0]) not in line
    for pattern in (f"{namespace}:*", f"{{{namespace}:*"):
        assert list(redis_client.scan_iter(match=pattern)) == []  # nothing enqueued, nothing written at all


# -- inspect ------------------------------------------------------------------------------------------------
def snapshot_with_ttl(tmp_path: Path, ttl: float) -> Path:
    """An exported snapshot of a compiled graph's entries, its first record's TTL set to `ttl`."""
    tier = f"local:{tmp_path / 'source.sqlite'}"
    assert (
        nkicache("compile", write_graph(tmp_path, mixed_graph()), "--tier", tier, "--out", tmp_path / "out").returncode
        == 0
    )
    exported = tmp_path / "exported.snapshot"
    assert nkicache("inspect", "export", exported, "--tier", tier).returncode == 0
    objects = list(msgpack.Unpacker(exported.open("rb"), raw=False))
    objects[1]["ttl"] = ttl  # objects[0] is the header
    edited = tmp_path / "edited.snapshot"
    edited.write_bytes(b"".join(msgpack.packb(o, use_bin_type=True) for o in objects))
    return edited


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def import_tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """(tier URL, environment) of an empty tier to import into."""
    if request.param == "local":
        from cachestore.backends.sqlite import SqliteBackend

        SqliteBackend(tmp_path / "target.sqlite").close()  # created: a command reading a tier needs it to exist
        yield f"local:{tmp_path / 'target.sqlite'}", {}
        return
    client = request.getfixturevalue("redis_client")
    name = unique_namespace()
    try:
        yield request.getfixturevalue("redis_url"), {"NKICACHE_NAMESPACE": name}
    finally:
        delete_namespace(client, name)


@pytest.mark.parametrize("ttl", [math.inf, math.nan, -math.inf])
def test_inspect_import_of_a_snapshot_with_a_non_finite_ttl_is_one_line(
    tmp_path: Path, import_tier: tuple[str, dict[str, str]], ttl: float
) -> None:
    snapshot = snapshot_with_ttl(tmp_path, ttl)
    url, env = import_tier
    line = one_line_error(nkicache("inspect", "import", snapshot, "--tier", url, env=env))
    assert str(snapshot) in line and "ttl" in line and "finite" in line
    assert nkicache("inspect", "ls", "--json", "--tier", url, env=env).stdout.strip() == "[\n]"  # nothing imported


def test_inspect_import_keeps_a_snapshot_ttl_within_the_entry_ttl(
    tmp_path: Path, import_tier: tuple[str, dict[str, str]]
) -> None:
    """A TTL past any expiry Redis takes is imported as the tier's entry_ttl, the longest it keeps an entry."""
    snapshot = snapshot_with_ttl(tmp_path, 1e300)
    url, env = import_tier
    env = {**env, "NKICACHE_ENTRY_TTL": "3600"}
    done = nkicache("inspect", "import", snapshot, "--tier", url, "--json", env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads(done.stdout)["imported"] == 6
    rows = json.loads(nkicache("inspect", "ls", "--json", "--tier", url, env=env).stdout)
    assert len(rows) == 6 and all(0 < row["ttl"] <= 3600 for row in rows), rows


MALFORMED_COMPONENTS = {
    "operands-not-a-map": {"kernel_name": "softmax", "operands": [[32, 48]]},
    "shapes-not-a-list": {"kernel_name": "softmax", "operands": {"shapes": 5, "dtypes": ["float32"]}},
    "shape-of-strings": {"kernel_name": "softmax", "results": {"shapes": [["a"]], "dtypes": ["float32"]}},
    "kernel-name-a-map": {"kernel_name": {"a": 1}, "target": "Trn2"},
    "kernel-name-bytes": {"kernel_name": b"softmax"},
    "attrs-a-list": {"kernel_name": "softmax", "attrs": [1, 2]},
    "deeply-nested": {"kernel_name": "softmax", "attrs": {"x": json.loads("[" * 40 + "]" * 40)}},
}


def tier_with_malformed_entries(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """A local tier holding a compiled graph's 6 entries and one entry per MALFORMED_COMPONENTS, each intact
    (its digest matches) with key components no loop would build; (tier URL, {case: cache key})."""
    from bridge.identity import toolchain_id
    from cachestore.api import KeyUsage, MetricsBatch, WriteItem
    from cachestore.backends.sqlite import SqliteBackend
    from cachestore.entry import Entry, encode_entry

    url = f"local:{tmp_path / 'tier.sqlite'}"
    assert (
        nkicache("compile", write_graph(tmp_path, mixed_graph()), "--tier", url, "--out", tmp_path / "out").returncode
        == 0
    )
    backend = SqliteBackend(tmp_path / "tier.sqlite")
    keys = {}
    try:
        for i, (case, components) in enumerate(MALFORMED_COMPONENTS.items()):
            entry = Entry(binary=b"binary %d" % i, input_names=["x"], output_names=["out"], format="bir",
                          version_identifier="bir-1", key_components=components, toolchain=toolchain_id())  # fmt: skip
            keys[case] = f"{i:x}" * 64
            backend.put_entries([WriteItem(keys[case], encode_entry(entry), entry.digest, 3600)])
        # The most used keys of all, so that the report's top variants read their components.
        now = time.time()
        usage = {key: KeyUsage("softmax", 100, now, now) for key in keys.values()}
        assert backend.apply_metrics(MetricsBatch("malformed", "host", "worker", keys=usage))
    finally:
        backend.close()
    return url, keys


def test_inspect_ls_lists_an_entry_with_malformed_components_with_its_error_and_goes_on(tmp_path: Path) -> None:
    url, keys = tier_with_malformed_entries(tmp_path)
    listed = nkicache("inspect", "ls", "--json", "--tier", url)
    assert listed.returncode == 0 and listed.stderr == "", listed.stderr
    rows = {row["key"]: row for row in json.loads(listed.stdout)}
    assert len(rows) == 6 + len(keys)
    for case, key in keys.items():
        assert rows[key]["error"].startswith("key components are malformed: "), (case, rows[key])
    assert sum(row["error"] is None and row["kernel_name"] in ("softmax", "rmsnorm", "matmul_tiled")
               for row in rows.values()) == 6  # fmt: skip

    text = nkicache("inspect", "ls", "--tier", url)
    assert text.returncode == 0 and text.stderr == f"{6 + len(keys)} entries\n", text.stderr
    assert text.stdout.count("UNREADABLE (key components are malformed") == len(keys)
    assert len(text.stdout.splitlines()) == 6 + len(keys)
    filtered = nkicache("inspect", "ls", "--json", "--kernel", "softmax", "--tier", url)
    assert filtered.returncode == 0 and len(json.loads(filtered.stdout)) == 2  # the good softmax entries only


def test_other_readers_of_key_components_take_a_malformed_one_in_their_stride(tmp_path: Path) -> None:
    """explain skips it, show shows it, the report lists its usage without shapes, and explain refuses such
    components given on its command line in one line."""
    url, keys = tier_with_malformed_entries(tmp_path)
    explained = nkicache("inspect", "explain", '{"kernel_name": "softmax"}', "--json", "--tier", url)
    assert explained.returncode == 0 and "Traceback" not in explained.stderr, explained.stderr
    assert {near["key"] for near in json.loads(explained.stdout)["nearest"]}.isdisjoint(keys.values())
    for key in keys.values():
        shown = nkicache("inspect", "show", key, "--json", "--tier", url)
        assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    for output in ([], ["--json"], ["--prometheus"], ["--html", tmp_path / "report.html"]):
        report = nkicache("report", "--tier", url, *output)
        assert report.returncode == 0 and report.stderr == "", (output, report.stderr)
    one_line_error(nkicache("inspect", "explain", '{"kernel_name": "softmax", "operands": {"shapes": 5}}',
                            "--tier", url))  # fmt: skip


# -- report -------------------------------------------------------------------------------------------------
def local_tier_with_metrics(tmp_path: Path, kernel_calls: dict[str, int]) -> str:
    """A local tier that one pass told about these kernels (names as the fleet may have recorded them)."""
    from cachestore.api import KeyUsage, MetricsBatch
    from cachestore.backends.sqlite import SqliteBackend

    backend = SqliteBackend(tmp_path / "metrics.sqlite")
    now = time.time()
    keys = {f"{i:x}" * 64: KeyUsage(name, calls, now, now) for i, (name, calls) in enumerate(kernel_calls.items())}
    totals = {"passes": 1, "kernels": sum(kernel_calls.values()), "cache_misses": sum(kernel_calls.values())}
    record = {"pass_id": "p1", "graph": "g", "finished": now, **totals}
    try:
        assert backend.apply_metrics(MetricsBatch("p1", "host", "worker", totals, kernel_calls, keys, record))
    finally:
        backend.close()
    return f"local:{tmp_path / 'metrics.sqlite'}"


def test_report_html_draws_kernel_names_as_plain_text_not_mathtext(tmp_path: Path) -> None:
    names = {"a$\\frac{$b": 3, "$x^2$": 2, "softmax": 1}  # a mathtext parse error, a formula, a plain name
    url = local_tier_with_metrics(tmp_path, names)
    page = tmp_path / "report.html"
    done = nkicache("report", "--tier", url, "--html", page)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    html = page.read_text()
    usage_plot = html[html.index('<figure id="plot-kernel-usage">') :]
    for name in names:
        assert re.search(rf"<text [^>]*>{re.escape(name)}</text>", usage_plot), name  # drawn as the text it is
        assert f"<td>{name}</td>" in html  # and the per-kernel table


def corrupt_redis_metrics(client: redis.Redis, namespace: str) -> None:
    """One field of each metrics hash set to a word or a NaN, as a hand or an older build may have left it."""
    from cachestore.keys import KeySpace

    keys = KeySpace(namespace)
    shards = metrics_shards(client, keys)
    home = next(shard for shard in shards if client.exists(shard.totals))  # the pass's own counts
    [worker] = list(client.smembers(home.workers))
    host, _, name = worker.decode().partition(":")
    client.hset(home.totals, "passes", "abc")
    client.hset(home.worker_metrics(host, name), "kernels", "nan")
    client.hset(home.kernel_calls, client.hkeys(home.kernel_calls)[0], "abc")
    for shard in shards:  # a variant's own counts
        for hash_name in (shard.kernel_variants, shard.key_usage, shard.key_first, shard.key_last):
            if client.exists(hash_name):
                client.hset(hash_name, client.hkeys(hash_name)[0], "abc")


@pytest.mark.redis
def test_a_non_numeric_metrics_value_counts_as_zero_in_every_report(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    env = {"NKICACHE_NAMESPACE": namespace, "NKICACHE_TIER": redis_url}
    assert nkicache("compile", write_graph(tmp_path, mixed_graph()), "--out", tmp_path / "out", env=env).returncode == 0
    corrupt_redis_metrics(redis_client, namespace)
    for output in ([], ["--json"], ["--prometheus"], ["--html", tmp_path / "report.html"]):
        report = nkicache("report", *output, env=env)
        assert report.returncode == 0 and report.stderr == "", (output, report.stderr)
        if output == ["--json"]:
            totals = json.loads(report.stdout)["totals"]
            assert (totals["passes"], totals["kernels"]) == (0, 8)  # the word counts 0, the rest as it was
    for command in (["ls"], ["gc", "--dry-run"], ["du"]):
        done = nkicache("inspect", *command, env=env)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)


def test_a_text_value_in_sqlite_metrics_counts_as_zero_in_every_report(tmp_path: Path) -> None:
    import sqlite3

    url = f"local:{tmp_path / 'tier.sqlite'}"
    assert (
        nkicache("compile", write_graph(tmp_path, mixed_graph()), "--tier", url, "--out", tmp_path / "out").returncode
        == 0
    )
    db = sqlite3.connect(tmp_path / "tier.sqlite")
    for table, column in (("totals", "value"), ("worker_totals", "value"), ("kernels", "call_count"),
                          ("kernels", "variants"), ("key_usage", "usage"), ("key_usage", "last_use")):  # fmt: skip
        db.execute(f"UPDATE {table} SET {column} = 'abc' WHERE rowid = (SELECT min(rowid) FROM {table})")
    db.commit()
    db.close()
    for output in ([], ["--json"], ["--prometheus"], ["--html", tmp_path / "report.html"]):
        report = nkicache("report", "--tier", url, *output)
        assert report.returncode == 0 and report.stderr == "", (output, report.stderr)
    for command in (["ls"], ["gc", "--dry-run"], ["show", "0"]):
        done = nkicache("inspect", *command, "--tier", url)
        assert "Traceback" not in done.stderr, (command, done.stderr)


@pytest.mark.redis
def test_serve_metrics_scrapes_a_tier_holding_a_non_numeric_value(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    import urllib.request

    env = {"NKICACHE_NAMESPACE": namespace, "NKICACHE_TIER": redis_url}
    assert nkicache("compile", write_graph(tmp_path, mixed_graph()), "--out", tmp_path / "out", env=env).returncode == 0
    corrupt_redis_metrics(redis_client, namespace)
    server = subprocess.Popen([NKICACHE, "serve-metrics", "--port", "0"], env={**os.environ, **env},
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        started = server.stderr.readline()
        port = started.split("http://127.0.0.1:")[1].split("/")[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            assert response.status == 200
            scraped = response.read().decode()
    finally:
        server.terminate()
        rest = server.communicate(timeout=10)[1]
    assert "nkicache_tier_up 1.0" in scraped and "nkicache_kernels_total 8.0" in scraped
    assert server.returncode == 0 and rest == "", rest


def test_a_scrape_whose_report_fails_unexpectedly_is_tier_up_0_not_http_500(caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import generate_latest

    from cachestore.report_render import prometheus_registry

    def unexpected() -> None:
        raise ValueError("could not convert string to float: b'abc'")

    scraped = generate_latest(prometheus_registry(unexpected)).decode()
    assert "nkicache_tier_up 0.0" in scraped and "nkicache_passes_total" not in scraped
    assert "ValueError: could not convert string to float" in caplog.text


# -- found going through every command with bad input ---------------------------------------------------------
@pytest.mark.parametrize("command", ["compile", "workload", "quickstart"])
def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path: Path, command: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folder = blocker / "out"  # inside a regular file: no folder can be made there, root or not
    args = {
        "compile": ["compile", write_graph(tmp_path, mixed_graph()), "--out", folder, "--tier", "off"],
        "workload": ["workload", "--out", folder, "--models", "1"],
        "quickstart": ["quickstart", "--dir", folder, "--models", "1"],
    }[command]
    line = one_line_error(nkicache(*args))
    assert str(folder) in line and "cannot" in line


def usage_error(result: subprocess.CompletedProcess) -> str:
    """click's usage error, the documented form for a bad option (exit 2): the usage, a hint, one error line."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and result.stderr.startswith("Usage: "), result.stderr
    return errors[0]


@pytest.mark.parametrize("command", [["demo"], ["run", "out"], ["workload", "--out", "graphs"],
                                     ["quickstart"], ["inspect", "verify", "--execute", "1"]])  # fmt: skip
def test_a_negative_seed_is_a_usage_error(tmp_path: Path, command: list[str]) -> None:
    """numpy takes no negative seed: it failed deep inside each command (or every executed entry of verify)."""
    env = {"NKICACHE_TIER": f"local:{tmp_path / 'tier'}"}
    line = usage_error(nkicache(*command, "--seed", "-1", env=env, cwd=tmp_path))  # relative paths land in tmp_path
    assert "'--seed'" in line


DIGITS_400 = "9" * 400  # read as a float: infinity


@pytest.mark.parametrize(
    ("command", "option", "value"),
    [
        (["report"], "--since", "99999999999999999999"),  # Unix seconds past any date the platform can show
        (["report"], "--since", "99999999999999999999d"),  # as long ago
        (["report"], "--since", DIGITS_400),
        (["report"], "--bucket", DIGITS_400),
        (["inspect", "gc", "--dry-run"], "--max-bytes", DIGITS_400),
        (["inspect", "gc", "--dry-run"], "--unused-for", DIGITS_400 + "d"),
    ],
)
def test_a_time_duration_or_size_out_of_range_is_a_usage_error(
    tmp_path: Path, command: list[str], option: str, value: str
) -> None:
    url = local_tier_with_metrics(tmp_path, {"softmax": 1})
    line = usage_error(nkicache(*command, option, value, "--tier", url))
    assert option in line and ("range" in line or "too" in line), line


@pytest.mark.parametrize("via", ["file", "stdin"])
def test_inspect_explain_of_components_that_are_not_utf8_is_a_usage_error(tmp_path: Path, via: str) -> None:
    components = tmp_path / "components.json"
    components.write_bytes('{"kernel_name": "caf\xe9"}'.encode("latin-1"))
    url = local_tier_with_metrics(tmp_path, {"softmax": 1})
    if via == "file":
        result = nkicache("inspect", "explain", components, "--tier", url)
    else:
        result = subprocess.run([NKICACHE, "inspect", "explain", "-", "--tier", url], capture_output=True, text=True,
                                timeout=PROCESS_TIMEOUT, stdin=components.open("rb"))  # fmt: skip
    assert "is not valid JSON" in usage_error(result)


NOT_UTF8 = "a\udcffb"  # how Python hands over the bytes a\xffb from the environment or the command line


@pytest.mark.parametrize("setting", ["NKICACHE_HOST", "NKICACHE_WORKER", "NKICACHE_NAMESPACE", "NKICACHE_TIER"])
def test_a_setting_that_is_not_utf8_is_one_line(tmp_path: Path, setting: str, redis_url: str, namespace: str) -> None:
    """A host, worker, namespace or Redis URL that is not UTF-8 failed every write to the tier, in a background
    thread (a traceback, exit 0) or as an internal error of every graph."""
    env = {"NKICACHE_TIER": redis_url, "NKICACHE_NAMESPACE": namespace, setting: NOT_UTF8}
    if setting == "NKICACHE_TIER":
        env[setting] = f"redis://{NOT_UTF8}:6379/0"
    line = one_line_error(nkicache("compile", write_graph(tmp_path, mixed_graph()), "--out", tmp_path / "out",
                                   env=env))  # fmt: skip
    assert f"${setting}" in line and "UTF-8" in line


def test_a_worker_name_that_is_not_utf8_is_a_usage_error(down_redis_url: str) -> None:
    assert "--name" in usage_error(nkicache("worker", "--name", NOT_UTF8, "--tier", down_redis_url))


@pytest.mark.parametrize("url", ["down", "bogus", "redis+cluster://127.0.0.1:1"])
def test_bench_against_a_redis_that_is_down_or_no_redis_url_is_one_line(down_redis_url: str, url: str) -> None:
    """Checked before measuring: the bench failed on it only after the first measurements and many warnings."""
    url = down_redis_url if url == "down" else url
    assert url.partition("://")[0] in one_line_error(nkicache("bench", "--quick", "--redis-url", url))


@pytest.mark.redis
def test_queue_and_its_liveness_probe_skip_a_heartbeat_that_is_not_one(
    redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """A heartbeat (or a count) written by hand or corrupt failed every `queue`, and every `queue --live-check`
    liveness probe with it: each worker would be restarted for one bad field."""
    from cachestore.keys import KeySpace

    keys = KeySpace(namespace)
    beats = {"w-good": json.dumps({"time": time.time(), "host": "h", "pid": 1, "job": None, "done": 0}),
             "w-not-json": "garbage", "w-list": "[1]", "w-no-time": '{"host": "h"}', "w-word-time": '{"time": "x"}',
             "w-nan-time": '{"time": NaN}', "w-partial": json.dumps({"time": time.time()})}  # fmt: skip
    redis_client.hset(keys.worker_heartbeats, mapping=beats)
    redis_client.hset(keys.job_shard(0).counts, mapping={"completed": "abc", "failed": "2"})
    env = {"NKICACHE_NAMESPACE": namespace}
    done = nkicache("queue", "--tier", redis_url, "--json", env=env)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    status = json.loads(done.stdout)
    assert [w["name"] for w in status["workers"]] == ["w-good", "w-partial"]
    assert (status["completed"], status["failed"]) == (0, 2)
    text = nkicache("queue", "--tier", redis_url, env=env)
    assert text.returncode == 0 and text.stderr == "" and "2 live workers" in text.stdout, text.stderr
    for name, code in (("w-good", 0), ("w-not-json", 1)):
        # Beaten again just before: the commands above can outlast a heartbeat's freshness on a loaded machine.
        fresh = json.dumps({"time": time.time(), "host": "h", "pid": 1, "job": None, "done": 0})
        redis_client.hset(keys.worker_heartbeats, "w-good", fresh)
        probe = nkicache("queue", "--tier", redis_url, "--live-check", "--name", name, env=env)
        assert probe.returncode == code and probe.stderr == "", probe.stderr


def test_report_html_that_cannot_be_written_and_a_port_in_use_are_one_line_exit_2(tmp_path: Path) -> None:
    """Project errors like any other (they were click's `Error:` with exit 1, the code of a failed check)."""
    import socket

    url = local_tier_with_metrics(tmp_path, {"softmax": 1})
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "cannot write" in one_line_error(nkicache("report", "--tier", url, "--html", blocker / "report.html"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert "cannot listen" in one_line_error(nkicache("serve-metrics", "--tier", url, "--port", port))


@pytest.mark.parametrize(("field", "value"), [("last_use", "abc"), ("last_use", 1e300), ("first_use", math.nan),
                                              ("usage", "abc"), ("hosts", "abc")])  # fmt: skip
def test_a_snapshot_whose_usage_holds_a_non_number_lists_and_shows(tmp_path: Path, field: str, value: object) -> None:
    """A snapshot's usage is read as a tier's metrics are: what is not a number counts 0, and a time no date
    is printed as such, instead of a traceback in ls and show."""
    snapshot = snapshot_with_ttl(tmp_path, 60.0)
    objects = list(msgpack.Unpacker(snapshot.open("rb"), raw=False))
    objects[1]["usage"][field] = value
    snapshot.write_bytes(b"".join(msgpack.packb(o, use_bin_type=True) for o in objects))
    key = objects[1]["key"]
    for command in (["ls"], ["ls", "--json"], ["show", key], ["show", key, "--json"]):
        done = nkicache("inspect", *command, "--snapshot", snapshot)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)
        assert done.stderr in ("", "6 entries\n"), (command, done.stderr)
    shown = json.loads(nkicache("inspect", "show", key, "--json", "--snapshot", snapshot).stdout)
    expected = {field: {"usage": 0, "hosts": []}.get(field, value if value == 1e300 else 0.0)}
    assert {name: shown[name] for name in expected} == expected  # a list of hosts, numbers: never the word


@pytest.mark.redis
def test_a_last_use_that_is_no_date_is_printed_as_such(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    from cachestore.keys import KeySpace

    env = {"NKICACHE_NAMESPACE": namespace, "NKICACHE_TIER": redis_url}
    assert nkicache("compile", write_graph(tmp_path, mixed_graph()), "--out", tmp_path / "out", env=env).returncode == 0
    keys = KeySpace(namespace)
    for shard in metrics_shards(redis_client, keys):
        if redis_client.exists(shard.key_last):
            redis_client.hset(shard.key_last, mapping=dict.fromkeys(redis_client.hkeys(shard.key_last), "1e300"))
    for command in (["report"], ["report", "--html", tmp_path / "report.html"], ["inspect", "ls"]):
        done = nkicache(*command, env=env)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (command, done.stderr)
    assert "1e+300 (not a date)" in nkicache("inspect", "ls", env=env).stdout


@pytest.mark.parametrize("finished", [1e300, -1e300, 1e15])
def test_a_pass_that_says_it_finished_centuries_away_is_placed_when_it_was_logged(
    tmp_path: Path, finished: float
) -> None:
    """A batch's numbers only need to be finite: a host whose clock is wrong can log such a pass. It broke the
    timeline (an IndexError) or the HTML plot (no year 10000); the pass is placed when the tier logged it."""
    from cachestore.api import MetricsBatch
    from cachestore.backends.sqlite import SqliteBackend

    url = local_tier_with_metrics(tmp_path, {"softmax": 1})
    backend = SqliteBackend(tmp_path / "metrics.sqlite")
    try:
        record = {"pass_id": "p2", "graph": "g", "finished": finished, "passes": 1, "kernels": 1}
        assert backend.apply_metrics(MetricsBatch("p2", "host", "worker", {"passes": 1}, pass_record=record))
    finally:
        backend.close()
    for output in ([], ["--html", tmp_path / "report.html"]):
        done = nkicache("report", "--tier", url, *output)
        assert done.returncode == 0 and done.stderr == "", (output, done.stderr)
    timeline = json.loads(nkicache("report", "--tier", url, "--json").stdout)["timeline"]
    assert sum(bucket["passes"] for bucket in timeline) == 2
    assert all(abs(bucket["start"] - time.time()) < 86400 for bucket in timeline)


@pytest.mark.redis
def test_a_stream_message_that_is_no_job_is_dead_lettered_and_the_worker_goes_on(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """A message written by hand or corrupt killed the worker with a traceback, and then every worker that
    reclaimed it: it is dead-lettered under its message id, and the next job is compiled."""
    from bridge.identity import toolchain_id
    from cachestore.keys import KeySpace

    keys = KeySpace(namespace)
    stream = keys.job_shard(0).stream(toolchain_id())
    malformed = [{"job": "garbage"}, {"other": "x"}, {"job": '{"file": "x.json", "graph": "{}"}'}, {"job": "[1]"},
                 {"job": json.dumps({"id": "j", "file": "x.json", "graph": {"name": "not text"}})}]  # fmt: skip
    message_ids = [redis_client.xadd(stream, fields).decode() for fields in malformed]
    # One shard: the worker meets the messages in the order they were queued, the real job last.
    env = {"NKICACHE_NAMESPACE": namespace, "NKICACHE_TIER": redis_url, "NKICACHE_JOB_SHARDS": "1"}
    submitted = nkicache("submit", write_graph(tmp_path, mixed_graph()), "--json", env=env)
    assert submitted.returncode == 0, submitted.stderr
    worker = nkicache("worker", "--max-jobs", "1", "--name", "w1", env=env)
    assert worker.returncode == 0 and "Traceback" not in worker.stderr, worker.stderr
    assert worker.stderr.count("dead-lettered") == len(malformed) and "w1: 1 job, exiting" in worker.stderr
    status = json.loads(nkicache("queue", "--dead-letters", "--json", env=env).stdout)
    assert (status["completed"], status["dead_letter"], status["pending"], status["in_flight"]) == (1, 5, 0, 0)
    assert [letter["job"] for letter in status["dead_letters"]] == message_ids
    assert "no job field" in status["dead_letters"][1]["error"] and "'id'" in status["dead_letters"][2]["error"]


# -- issue 35 item 9 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["compile", "g.json", "--out", "out"], ["report"], ["inspect", "ls"], ["queue"]])
def test_a_malformed_tier_url_is_one_line(tmp_path: Path, command: list[str]) -> None:
    write_graph(tmp_path, {**mixed_graph(), "name": "g"})
    line = one_line_error(nkicache(*command, "--tier", "redis://[::1", cwd=tmp_path))
    assert "'redis://[::1'" in line and "is not a valid URL" in line


def test_a_malformed_tier_url_never_shows_its_password(tmp_path: Path) -> None:
    line = one_line_error(nkicache("report", env={"NKICACHE_TIER": "redis://u:hunter2@[::1?password=hunter3"}))
    assert "hunter" not in line and "is not a valid URL" in line


def test_workers_100000_is_a_usage_error_not_a_traceback(tmp_path: Path) -> None:
    graph = write_graph(tmp_path, mixed_graph())
    line = usage_error(nkicache("compile", graph, "--out", tmp_path / "out", "--tier", "off", "--workers", 100000))
    assert "--workers" in line and "1<=x<=256" in line


def graph_with_attrs(tmp_path: Path, name: str, attrs_json: str) -> Path:
    graph = {"name": name, "tensors": {"x": {"shape": [4, 8], "dtype": "float32"}, "g": {"shape": [8],
             "dtype": "float32"}, "y": {"shape": [4, 8], "dtype": "float32"}},
             "ops": [{"type": "InternalNkiKernel", "func_name": "RMSNorm", "kernel_name": "rmsnorm",
                      "operands": ["x", "g"], "results": ["y"], "attrs": {}}]}  # fmt: skip
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(graph).replace('"attrs": {}', f'"attrs": {attrs_json}'))
    return path


def test_a_5000_digit_integer_in_a_graph_is_one_line(tmp_path: Path) -> None:
    graph = graph_with_attrs(tmp_path, "digits", '{"eps": ' + "9" * 5000 + "}")
    compiled = nkicache("compile", graph, "--out", tmp_path / "out", "--tier", "off")
    line = one_line_error(compiled, code=1)  # a bad graph fails its pass (exit 1), as every bad graph does
    assert line == f"nkicache: error: {graph}: holds an integer of more than 4300 digits"
    submitted = one_line_error(nkicache("submit", graph, "--tier", "redis://127.0.0.1:1/0"))  # exit 2
    assert submitted == line


@pytest.mark.parametrize("value", ["NaN", "Infinity", "[1, -Infinity]"])
def test_nan_or_infinity_in_graph_attrs_is_refused_naming_file_and_op(tmp_path: Path, value: str) -> None:
    graph = graph_with_attrs(tmp_path, "nan", '{"eps": ' + value + "}")
    line = one_line_error(nkicache("compile", graph, "--out", tmp_path / "out", "--tier", "off"), code=1)
    assert line.startswith(f"nkicache: error: {graph}: op 0 (RMSNorm): attr 'eps' is ") and "finite" in line


def test_a_newline_in_a_file_name_is_printed_escaped(tmp_path: Path) -> None:
    forged = tmp_path / "evil\n2024-01-01 00:00:00 INFO forged: line.json"
    forged.write_text(json.dumps(mixed_graph("evil")))
    broken = tmp_path / "bad\nname.json"
    broken.write_text("{")
    done = nkicache("compile", forged, broken, "--out", tmp_path / "out", "--tier", "off")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert not any(line.startswith("2024-01-01") for line in (done.stdout + done.stderr).splitlines())
    assert "evil\\n2024-01-01 00:00:00 INFO forged: line.json -> " in done.stdout
    assert done.stderr.splitlines() == [
        f"nkicache: error: {tmp_path}/bad\\nname.json: not valid JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    ]


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "1e999"])
@pytest.mark.parametrize("command", [["submit", "GRAPHS", "--wait"], ["warm", "--fleet"]])
def test_a_timeout_that_is_not_a_finite_number_is_a_usage_error(tmp_path: Path, command: list[str], value: str) -> None:
    """Issue 45 F16 N9: `--timeout nan` or `1e999` would wait for ever; refused before anything runs."""
    write_graph(tmp_path, mixed_graph())
    argv = [str(tmp_path) if word == "GRAPHS" else word for word in command]
    line = usage_error(nkicache(*argv, "--timeout", value, "--tier", "redis://127.0.0.1:1"))
    assert "--timeout" in line, line


def test_a_workload_of_more_models_than_any_disk_takes_is_a_usage_error(tmp_path: Path) -> None:
    """Issue 45 F16 N8: `workload --models 10^23` wrote 755,017 files before it was killed."""
    line = usage_error(nkicache("workload", "--out", tmp_path / "w", "--models", 10**23))
    assert "--models" in line and "range" in line and not (tmp_path / "w").exists(), line


def test_a_reader_that_closes_stdout_early_is_no_redis_error(redis_url: str) -> None:
    """Issue 45 F16: `nkicache queue | head -1` blamed Redis for the closed pipe. Now it exits 1 quietly, as a
    program whose reader went away does."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line
    try:
        done = subprocess.run([NKICACHE, "queue", "--tier", redis_url], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=PROCESS_TIMEOUT)  # fmt: skip
    finally:
        os.close(write_end)
    assert done.returncode == 1 and done.stderr == "", done.stderr


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB file system of its own (tmpfs; mounting needs root, as the suite runs here), to fill up."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_gc_on_a_full_disk_is_one_line_naming_the_disk(full_disk: Path, tmp_path: Path) -> None:
    """Issue 45 F13: SQLite says only "disk I/O error" when it cannot grow its files on a full disk."""
    write_graph(tmp_path, mixed_graph())
    tier = f"local:{full_disk / 'tier.sqlite'}"
    assert nkicache("compile", tmp_path, "--tier", tier, "--out", tmp_path / "out").returncode == 0
    with open(full_disk / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(b"\0" * 65536)
    line = one_line_error(nkicache("inspect", "gc", "--tier", tier))
    assert f"the disk is full: the file system mounted at {full_disk} has" in line, line
