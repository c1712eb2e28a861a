"""Never a stale binary: a changed compiler never takes the binaries of the one before it from a warm tier,
two compilers share one tier without serving each other's binaries, and a change off the compile path
keeps the tier warm.

The changed compiler is real: a copy of the `bridge` package with the softmax kernel's maths changed,
imported in front of the installed one (PYTHONPATH), whose toolchain id the copy computes from its own
sources.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from helpers_graphs import MIXED_DISTINCT_KEYS, delete_namespace, mixed_graph, unique_namespace, write_graph

from bridge.identity import fingerprint, package_root, toolchain_id
from cachestore.backends.redis import RedisBackend
from cachestore.backends.sqlite import SqliteBackend
from cachestore.keys import KeySpace, partition

SOFTMAX_MATHS = ("e = nl.exp(shifted)", "e = nl.exp(shifted * 0.5)")


@dataclass
class Tier:
    url: str
    namespace: str
    backend: object


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    namespace = unique_namespace()
    if request.param == "local":
        path = tmp_path / "tier.sqlite"
        yield Tier(f"local:{path}", namespace, None)
        return
    url = request.getfixturevalue("redis_url")
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        yield Tier(url, namespace, RedisBackend(client, KeySpace(namespace)))
    finally:
        delete_namespace(client, namespace)
        client.close()


def compiler_copy(tmp_path: Path, name: str, edit: tuple[str, str, str] | None) -> Path:
    """A folder to put in front of PYTHONPATH holding a copy of `bridge`, with `edit` (file, old, new) made."""
    folder = tmp_path / name
    shutil.copytree(package_root(), folder / "bridge", ignore=shutil.ignore_patterns("__pycache__"))
    if edit is not None:
        path, old, new = edit
        source = folder / "bridge" / path
        text = source.read_text()
        assert old in text, f"{old!r} is not in {path} any more: update this test"
        source.write_text(text.replace(old, new, 1))
    return folder


def nkicache(
    folder: Path | None, tier: Tier, graph: Path, out: Path, *, tier_url: str | None = None
) -> subprocess.Popen:
    """`nkicache compile --json` in a process of its own, with the compiler in `folder` (None: the installed)."""
    env = {**os.environ, "NKICACHE_NAMESPACE": tier.namespace}
    if folder is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-c", "from workers.cli import main; main()", "compile", str(graph), "--out", str(out),
               "--tier", tier_url or tier.url, "--json"]  # fmt: skip
    return subprocess.Popen(command, env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(process: subprocess.Popen) -> dict:
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    return json.loads(stdout)


def compile_once(folder: Path | None, tier: Tier, graph: Path, out: Path, **options: str) -> dict:
    return finished(nkicache(folder, tier, graph, out, **options))


def artifact(out: Path) -> bytes:
    (path,) = out.glob("*.nkibb")
    return path.read_bytes()


def test_a_changed_compiler_never_takes_the_old_binaries(tier: Tier, tmp_path: Path) -> None:
    graph = write_graph(tmp_path, mixed_graph())
    changed = compiler_copy(tmp_path, "changed", ("kernels/softmax.py", *SOFTMAX_MATHS))
    assert fingerprint(changed / "bridge") != toolchain_id()

    cold = compile_once(None, tier, graph, tmp_path / "old-cold")
    warm = compile_once(None, tier, graph, tmp_path / "old-warm")
    assert (cold["traces"], warm["remote_hits"], warm["traces"]) == (MIXED_DISTINCT_KEYS, MIXED_DISTINCT_KEYS, 0)

    # The changed compiler on the same warm tier traces everything itself ...
    new = compile_once(changed, tier, graph, tmp_path / "new")
    assert (new["remote_hits"], new["traces"], new["tier_rejected"]) == (0, MIXED_DISTINCT_KEYS, 0)
    # ... and its artifact is byte for byte what it produces with no tier at all, not the old compiler's.
    alone = compile_once(changed, tier, graph, tmp_path / "new-off", tier_url="off")
    assert artifact(tmp_path / "new") == artifact(tmp_path / "new-off")
    assert artifact(tmp_path / "new") != artifact(tmp_path / "old-cold")
    assert alone["traces"] == MIXED_DISTINCT_KEYS

    # Its own second compile is warm: the tier keeps the two compilers' binaries side by side.
    new_warm = compile_once(changed, tier, graph, tmp_path / "new-warm")
    old_again = compile_once(None, tier, graph, tmp_path / "old-again")
    assert (new_warm["remote_hits"], new_warm["traces"]) == (MIXED_DISTINCT_KEYS, 0)
    assert (old_again["remote_hits"], old_again["traces"]) == (MIXED_DISTINCT_KEYS, 0)
    assert artifact(tmp_path / "new-warm") == artifact(tmp_path / "new-off")
    assert artifact(tmp_path / "old-again") == artifact(tmp_path / "old-cold")


def test_a_change_off_the_compile_path_keeps_the_tier_warm(tier: Tier, tmp_path: Path) -> None:
    graph = write_graph(tmp_path, mixed_graph())
    edited = compiler_copy(tmp_path, "references-edited", ("references.py", '"""', '"""Reworded.\n\n'))
    assert fingerprint(edited / "bridge") == toolchain_id()
    compile_once(None, tier, graph, tmp_path / "cold")
    warm = compile_once(edited, tier, graph, tmp_path / "warm")
    assert (warm["remote_hits"], warm["traces"]) == (MIXED_DISTINCT_KEYS, 0)
    assert artifact(tmp_path / "warm") == artifact(tmp_path / "cold")


@pytest.mark.redis
def test_two_toolchains_on_one_redis_at_once_never_serve_each_other(redis_url: str, tmp_path: Path) -> None:
    """A rolling upgrade: the old and the new compiler compile the same graphs on one Redis at the same time."""
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    namespace = unique_namespace()
    tier = Tier(redis_url, namespace, None)
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    for rows in (64, 96, 128):
        write_graph(graphs, mixed_graph(name=f"mixed-{rows}", rows=rows))
    changed = compiler_copy(tmp_path, "changed", ("kernels/softmax.py", *SOFTMAX_MATHS))
    compilers = {"old": None, "new": changed}
    try:
        for round_name in ("cold", "warm", "again"):
            running = {name: nkicache(folder, tier, graphs, tmp_path / f"{name}-{round_name}")
                       for name, folder in compilers.items()}  # fmt: skip
            results = {name: finished(process) for name, process in running.items()}
            for name, result in results.items():
                assert result["tier_rejected"] == 0, (name, round_name)
                if round_name != "cold":
                    assert (result["traces"], result["remote_hits"]) == (0, 3 * MIXED_DISTINCT_KEYS), (name, round_name)
        for name, folder in compilers.items():
            off = tmp_path / f"{name}-off"
            compile_once(folder, tier, graphs, off, tier_url="off")
            for round_name in ("cold", "warm", "again"):
                for path in off.glob("*.nkibb"):
                    assert (tmp_path / f"{name}-{round_name}" / path.name).read_bytes() == path.read_bytes()
        backend = RedisBackend(client, KeySpace(namespace))
        toolchains = (toolchain_id(), fingerprint(changed / "bridge"))
        assert backend.entry_partitions() == sorted(partition(tc) for tc in toolchains)
        old, new = ({raw.cache_key: raw.data for raw in backend.in_partition(partition(tc)).scan_entries()}
                    for tc in toolchains)  # fmt: skip
        # The same variants (the specification's key does not change), each compiler's own binaries.
        assert old.keys() == new.keys() and len(old) >= MIXED_DISTINCT_KEYS
        assert sum(old[key] != new[key] for key in old) == len(old)  # every entry names its own toolchain
    finally:
        delete_namespace(client, namespace)
        client.close()


def test_a_local_tier_of_the_previous_layout_is_upgraded_keeping_its_metrics(tmp_path: Path) -> None:
    """Schema 1 had no toolchain: its entries could never be served again, its metrics are kept."""
    import sqlite3

    path = tmp_path / "tier.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(
        "CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);"
        "INSERT INTO meta VALUES ('schema', '1');"
        "CREATE TABLE entries (cache_key TEXT PRIMARY KEY, data BLOB NOT NULL, digest TEXT NOT NULL, expires REAL);"
        "INSERT INTO entries VALUES ('k', x'00', 'd', 9e18);"
        "CREATE TABLE totals (name TEXT PRIMARY KEY, value REAL NOT NULL);"
        "INSERT INTO totals VALUES ('passes', 7);"
    )
    db.close()
    with pytest.raises(Exception, match="has schema v1; this build uses v4"):
        SqliteBackend(path, create=False)
    backend = SqliteBackend(path)
    assert backend.totals() == {"passes": 7.0}
    assert list(backend.scan_entries()) == [] and backend.entry_partitions() == []
    backend.close()
    assert SqliteBackend(path, create=False).totals() == {"passes": 7.0}
