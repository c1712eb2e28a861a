"""Issue 45: a shared `dir:` tier that anyone can write to cannot hang, crash or steer nkicache outside it, and no
lease lasts for ever (dir or Redis).

Each plant is made in a tier beside a folder `outside` holding bait: files named 1, 2 and 3 (what a lease's
older generations are called) and expired-looking files (what gc deletes). Compile, report, `inspect verify`
and `inspect gc` then run as processes with a time limit: they must finish, leave `outside` as it was, count
what they skipped, and compile exactly what `--tier off` compiles.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers_graphs import mixed_graph, write_graph

from bridge.codegen import kernel_cache_key
from bridge.graph import load_graph
from bridge.identity import toolchain_id
from bridge.ir import InternalNkiKernel
from cachestore.blob import tier as blob_tier
from cachestore.keys import KeySpace
from workers.cli import main as nkicache

NKICACHE = str(Path(sys.executable).with_name("nkicache"))
COMMAND_SECONDS = 60  # each command takes a second or two; a hang is caught well before pytest's own timeout
EPOCH = 1_000_000.0  # an mtime long past: what gc takes for an expired file


def run(*args: object, env: dict[str, str] | None = None, expect: tuple[int, ...] = (0,)) -> str:
    done = subprocess.run([NKICACHE, *map(str, args)], capture_output=True, text=True, timeout=COMMAND_SECONDS,
                          env={**os.environ, **(env or {})})  # fmt: skip
    assert done.returncode in expect, done.stdout + done.stderr
    return done.stdout


def artifacts(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("*.nkibb"))}


def contents(folder: Path) -> dict[str, tuple[bytes, float]]:
    return {path.name: (path.read_bytes(), path.stat().st_mtime) for path in sorted(folder.iterdir())}


def graph_keys() -> list[str]:
    ops = [op for op in load_graph(mixed_graph()).ops if isinstance(op, InternalNkiKernel)]
    return sorted({kernel_cache_key(op)[0] for op in ops})


class Tier:
    """A dir tier under tmp_path, the graphs to compile into it, and the bait outside it."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "tier"
        self.url = f"dir:{self.root}"
        self.graphs = tmp_path / "graphs"
        self.graphs.mkdir()
        write_graph(self.graphs, mixed_graph())
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        for name in ("1", "2", "3", "expired.bin"):
            (self.outside / name).write_bytes(f"bait {name}".encode())
            os.utime(self.outside / name, (EPOCH, EPOCH))
        self.bait = contents(self.outside)
        self.tmp_path = tmp_path
        self.partition = self.root / "entries" / toolchain_id().encode().hex()

    def compile(self, out: str, *, env: dict[str, str] | None = None) -> dict:
        return json.loads(run("compile", self.graphs, "--tier", self.url, "--out", self.tmp_path / out, "--json",
                              env=env))  # fmt: skip

    def entry(self, cache_key: str) -> Path:
        return self.partition / cache_key.encode().hex()

    def lease_folder(self, cache_key: str) -> Path:
        return self.root / "leases" / toolchain_id().encode().hex() / cache_key.encode().hex()


def plant_fifo_entry(tier: Tier) -> None:
    victim = tier.entry(graph_keys()[0])
    victim.unlink()
    os.mkfifo(victim)


def plant_fifo_batch(tier: Tier) -> None:
    os.mkfifo(tier.root / "batches" / "planted")


def plant_symlinked_partition(tier: Tier) -> None:
    for path in tier.partition.iterdir():
        path.unlink()
    tier.partition.rmdir()
    tier.partition.symlink_to(tier.outside, target_is_directory=True)


def plant_symlinked_lease_folders(tier: Tier) -> None:
    for key in graph_keys():
        folder = tier.lease_folder(key)
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.symlink_to(tier.outside, target_is_directory=True)


def plant_strange_lease_names(tier: Tier) -> None:
    for key in graph_keys():
        folder = tier.lease_folder(key)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "²").write_text('{"owner": "mallory", "expires": 1e308}')
        (folder / "٣").write_text("not json")


def plant_symlinked_entry(tier: Tier) -> None:
    victim = tier.entry(graph_keys()[0])
    victim.unlink()
    victim.symlink_to(tier.outside / "1")


def plant_folder_entry(tier: Tier) -> None:
    victim = tier.entry(graph_keys()[0])
    victim.unlink()
    (victim / "empty").mkdir(parents=True)  # a folder where the entry goes, holding only an empty folder


def plant_folder_variants(tier: Tier) -> None:
    ops = [op for op in load_graph(mixed_graph()).ops if isinstance(op, InternalNkiKernel)]
    for name in {name for op in ops for name in (op.kernel_name, op.func_name)}:  # where the compile writes them
        blob = tier.root / "variants" / hashlib.sha256(name.encode()).hexdigest()
        blob.mkdir(parents=True)
        (blob / "inside").write_text("planted")


# plant -> (made in a warm tier, so entries are there to replace), and the entries it spoils
PLANTS: dict[str, tuple[Callable[[Tier], None], bool, int]] = {
    "fifo-entry": (plant_fifo_entry, True, 1),
    "fifo-batch": (plant_fifo_batch, True, 0),
    "folder-entry": (plant_folder_entry, True, 1),
    "folder-variants": (plant_folder_variants, False, 0),
    "symlinked-entry": (plant_symlinked_entry, True, 1),
    "symlinked-partition": (plant_symlinked_partition, True, len(graph_keys())),
    "symlinked-lease-folders": (plant_symlinked_lease_folders, False, 0),
    "lease-named-superscript-two": (plant_strange_lease_names, False, 0),
}


@pytest.fixture(scope="module")
def off_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """What `--tier off` compiles from the graphs every Tier holds."""
    graphs = tmp_path_factory.mktemp("graphs")
    write_graph(graphs, mixed_graph())
    out = tmp_path_factory.mktemp("off")
    run("compile", graphs, "--tier", "off", "--out", out)
    return artifacts(out)


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_a_planted_file_hangs_crashes_and_steers_nothing(
    plant: str, tmp_path: Path, off_artifacts: dict[str, bytes]
) -> None:
    make, warm, spoiled = PLANTS[plant]
    tier = Tier(tmp_path)
    if warm:
        tier.compile("first")
    make(tier)
    done = tier.compile("planted")
    assert artifacts(tmp_path / "planted") == off_artifacts
    assert done["tier_rejected"] == spoiled and done["tier_errors"] == 0 and done["tier_timeouts"] == 0
    assert done["tier_dropped"] == 0  # what stands where a file goes is replaced by the write
    assert done["traces"] == (spoiled if warm else len(graph_keys()))
    run("report", "--tier", tier.url, "--json")
    verify = run("inspect", "verify", "--tier", tier.url, expect=(0, 1))
    run("inspect", "gc", "--tier", tier.url, "--json")
    assert contents(tier.outside) == tier.bait
    again = tier.compile("again")  # what the compile after the plant stored (and gc cleaned) serves whole
    assert again["traces"] == 0 and again["tier_rejected"] == 0 and again["remote_hits"] == len(graph_keys())
    assert artifacts(tmp_path / "again") == off_artifacts
    assert "0 problems" in run("inspect", "verify", "--tier", tier.url), verify
    folders = [
        path for path in tier.root.rglob("*") if path.is_dir() and path.parent != tier.root and not any(path.iterdir())
    ]
    assert folders == [], "gc leaves no empty folder below the layout's own"


def test_a_fifo_in_place_of_the_marker_turns_the_tier_off_without_a_hang(tmp_path: Path) -> None:
    tier = Tier(tmp_path)
    tier.compile("first")
    (tier.root / blob_tier.MARKER).unlink()
    os.mkfifo(tier.root / blob_tier.MARKER)
    done = tier.compile("planted")
    assert done["tier_errors"] >= 1 and done["traces"] == len(graph_keys())
    result = subprocess.run([NKICACHE, "inspect", "verify", "--tier", tier.url], capture_output=True, text=True,
                            timeout=COMMAND_SECONDS)  # fmt: skip
    assert result.returncode != 0 and "is no nkicache tier" in result.stderr + result.stdout


def test_unreadable_entries_are_rejected_one_by_one_not_a_dead_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's entry files (NFS, umask 077): each is one rejected entry; the rest are served and verify
    reports the three. The suite runs as root, who reads anything, so the refusal is the kernel's answer to a
    user who may not read them, simulated at os.open."""
    tier = Tier(tmp_path)
    tier.compile("first")
    unreadable = {str(tier.entry(key)) for key in graph_keys()[:3]}
    real_open = os.open

    def refusing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path) in unreadable:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    done = CliRunner().invoke(nkicache, ["compile", str(tier.graphs), "--tier", tier.url, "--workers", "1",
                                         "--out", str(tmp_path / "planted"), "--json"])  # fmt: skip
    assert done.exit_code == 0, done.output
    counts = json.loads(done.output)
    assert counts["tier_rejected"] == 3 and counts["tier_errors"] == 0
    assert counts["remote_hits"] == len(graph_keys()) - 3 and counts["traces"] == 3
    monkeypatch.setattr(os, "open", refusing_open)
    verify = CliRunner().invoke(nkicache, ["inspect", "verify", "--tier", tier.url])
    assert verify.exit_code == 1 and "3 problems" in verify.output and "may not be read" in verify.output


# -- no lease lasts for ever ---------------------------------------------------------------------------
LEASE_ENV = {"NKICACHE_LEASE_TTL": "1", "NKICACHE_LEASE_WAIT": "30"}


def test_a_planted_eternal_dir_lease_costs_at_most_lease_ttl(tmp_path: Path) -> None:
    tier = Tier(tmp_path)
    for key in graph_keys():
        folder = tier.lease_folder(key)
        folder.mkdir(parents=True)
        (folder / "1").write_text(json.dumps({"owner": "mallory:w:1", "expires": 1e308}))
    started = time.monotonic()
    done = tier.compile("planted", env=LEASE_ENV)
    assert time.monotonic() - started < 15  # lease_ttl (1 s) of waiting, not lease_wait (30 s)
    assert done["traces"] == len(graph_keys())


def test_a_planted_redis_lease_without_a_ttl_costs_at_most_lease_ttl_and_gets_one(
    redis_url: str, redis_client: Any, tmp_path: Path
) -> None:
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    write_graph(graphs, mixed_graph())
    namespace = f"hostile-{uuid.uuid4().hex[:12]}"
    keys = KeySpace(namespace)
    leases = [keys.lease(toolchain_id(), key) for key in graph_keys()]
    for lease in leases:
        redis_client.set(lease, "mallory:w:1")  # no TTL
    assert all(redis_client.ttl(lease) == -1 for lease in leases)
    started = time.monotonic()
    done = json.loads(run("compile", graphs, "--tier", redis_url, "--out", tmp_path / "out", "--json",
                          env={**LEASE_ENV, "NKICACHE_NAMESPACE": namespace}))  # fmt: skip
    try:
        assert time.monotonic() - started < 15
        assert done["traces"] == len(graph_keys())
        assert all(redis_client.ttl(lease) != -1 for lease in leases)  # cut to lease_ttl, then gone
    finally:
        for key in redis_client.scan_iter(match=f"{namespace}:*"):
            redis_client.delete(key)
