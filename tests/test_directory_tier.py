"""The shared-directory tier (`--tier dir:PATH`, cachestore.backends.directory) end to end: cold and warm
compiles, two compiles of different workloads at once into one directory, inspection and reports on it, a lease
holder killed, files a killed writer left, hostile names and bad paths. The store contract runs on it in
tests/test_store_contract.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from helpers_tier_cli import GRAPHS, artifacts, cli, compile_json, compile_process, listed_keys

from cachestore.api import StoreRequest, WriteItem
from cachestore.backends import directory
from cachestore.backends.directory import folder_tier
from cachestore.blob import tier as blob_tier
from cachestore.settings import Settings
from cachestore.stores import open_backend
from cachestore.tier_urls import redact_url, tier_levels, tier_url_problem
from workers.cli import main
from workers.workload import generate_workload

TTL = 3600


def test_the_store_module_is_at_most_200_lines() -> None:
    assert len(Path(directory.__file__).read_text().splitlines()) <= 200


# -- done when ------------------------------------------------------------------------------------------
def test_a_cold_then_a_warm_compile_into_a_directory_match_a_compile_without_a_tier(tmp_path: Path) -> None:
    tier = f"dir:{tmp_path / 'shared' / 'cache'}"  # not there yet: the compile makes it
    off = compile_json(GRAPHS, "off", tmp_path / "off")
    cold = compile_json(GRAPHS, tier, tmp_path / "cold")
    warm = compile_json(GRAPHS, tier, tmp_path / "warm")
    assert cold["traces"] == off["traces"] > 0 and cold["tier_errors"] == 0
    assert warm["traces"] == 0 and warm["remote_hits"] == warm["tier_lookups"] == cold["traces"]
    assert (warm["tier_errors"], warm["tier_rejected"], warm["tier_dropped"]) == (0, 0, 0)
    assert artifacts(tmp_path / "cold") == artifacts(tmp_path / "off") == artifacts(tmp_path / "warm")
    assert len(listed_keys(tier)) == cold["traces"]
    report = json.loads(cli("report", "--tier", tier, "--json"))
    assert report["totals"]["passes"] == cold["passes"] + warm["passes"]
    assert report["totals"]["traces"] == cold["traces"]


@pytest.mark.slow
def test_two_compiles_of_different_workloads_at_once_share_one_directory(tmp_path: Path) -> None:
    workloads = [tmp_path / "workload-a", tmp_path / "workload-b"]
    generate_workload(workloads[0], 3, 0)
    generate_workload(workloads[1], 3, 1)
    shared = f"dir:{tmp_path / 'shared'}"
    processes = [compile_process(graphs, shared, tmp_path / f"out-{graphs.name}") for graphs in workloads]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        results.append(json.loads(out))
    for result in results:
        assert (result["tier_errors"], result["tier_timeouts"], result["tier_rejected"]) == (0, 0, 0), result
    # What each workload alone stores, compiled one after the other into a local tier: the directory holds it all.
    local = f"local:{tmp_path / 'alone.sqlite'}"
    for graphs in workloads:
        compile_json(graphs, local, tmp_path / f"alone-{graphs.name}")
    assert listed_keys(shared) == listed_keys(local) and listed_keys(shared)
    assert "0 problems" in cli("inspect", "verify", "--tier", shared)
    report = json.loads(cli("report", "--tier", shared, "--json"))
    assert report["totals"]["passes"] == sum(result["passes"] for result in results)
    for graphs, result in zip(workloads, results, strict=True):  # warm now, both of them
        again = compile_json(graphs, shared, tmp_path / f"again-{graphs.name}")
        assert again["traces"] == 0 and again["passes"] == result["passes"]
        assert artifacts(tmp_path / f"again-{graphs.name}") == artifacts(tmp_path / f"out-{graphs.name}")


# -- dying holders and writers ----------------------------------------------------------------------------
HOLDER = """
import sys, time
from cachestore.backends.directory import folder_tier
store = folder_tier(sys.argv[1], partition="tc")
assert store.acquire_lease("the-key", "doomed", float(sys.argv[2]))
print("held", flush=True)
time.sleep(600)
"""

TAKER = """
import sys
from cachestore.backends.directory import folder_tier
print(folder_tier(sys.argv[1], partition="tc").acquire_lease("the-key", "next", 30))
"""


def test_a_lease_whose_holder_is_killed_expires_and_another_process_takes_it(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "d"), "1.5"], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    store = folder_tier(tmp_path / "d", partition="tc")
    assert store.lease_holder("the-key") == "doomed"
    assert store.acquire_lease("the-key", "next", 30) is False  # not expired yet
    deadline = time.monotonic() + 10
    while store.lease_holder("the-key") is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    taker = subprocess.run([sys.executable, "-c", TAKER, str(tmp_path / "d")], capture_output=True, text=True,
                           timeout=60)  # fmt: skip
    assert taker.stdout.strip() == "True", taker.stderr
    assert store.lease_holder("the-key") == "next"
    assert not [p for p in (tmp_path / "d" / "leases").rglob(".*")]  # the stale file moved aside is gone


WRITER = """
import json, sys
from cachestore.api import MetricsBatch, WriteItem
from cachestore.backends.directory import folder_tier
store, me = folder_tier(sys.argv[1], partition="tc"), int(sys.argv[2])
applied = 0
for i in range(40):
    store.put_entries([WriteItem("contested", bytes([me]) * 300_000, None, 3600)])
    applied += store.apply_metrics(MetricsBatch(f"batch-{i}", "h", f"w{me}", {"passes": 1}))
print(json.dumps(applied))
"""


def test_processes_writing_one_key_and_one_batch_id_at_once(tmp_path: Path) -> None:
    """Four processes write the same key over and over, and send the same 40 batch ids: a reader meanwhile
    only ever reads one writer's whole entry, and each batch is applied once."""
    folder_tier(tmp_path / "d").close()
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "d"), str(n)], stdout=subprocess.PIPE,
                                text=True) for n in range(1, 5)]  # fmt: skip
    store, seen = folder_tier(tmp_path / "d", partition="tc"), set()
    while any(writer.poll() is None for writer in writers):
        data = store.get_entries(["contested"]).get("contested")
        if data is not None:
            assert isinstance(data, bytes) and len(data) == 300_000 and data == data[:1] * 300_000
            seen.add(data[0])
    applied = [json.loads(writer.communicate(timeout=60)[0]) for writer in writers]
    assert all(writer.returncode == 0 for writer in writers)
    assert sum(applied) == 40 and store.totals() == {"passes": 40}
    assert seen and seen <= {1, 2, 3, 4}
    assert not list((tmp_path / "d").rglob(".tmp-*"))  # every temp file was renamed or deleted


def test_a_partial_temp_file_is_never_read_and_gc_deletes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = f"dir:{tmp_path / 'd'}"
    compile_json(GRAPHS, tier, tmp_path / "out")
    store = folder_tier(tmp_path / "d")
    folder = next((tmp_path / "d" / "entries").iterdir())
    partial = folder / ".tmp-0123456789abcdef"
    partial.write_bytes(b"NKIC half an entry")  # a writer killed before its rename
    keys = [raw.cache_key for raw in store.scan_entries()]
    assert len(keys) == len(listed_keys(tier)) and all(not key.startswith(".") for key in keys)
    assert "0 problems" in cli("inspect", "verify", "--tier", tier)
    assert store.expired_count() == (0, 0)  # a temp file this young may be a write in progress
    monkeypatch.setattr(directory, "STALE_TEMP_SECONDS", 0.0)
    assert store.expired_count() == (1, partial.stat().st_size)
    done = json.loads(cli("inspect", "gc", "--tier", tier, "--json"))
    assert done["expired_purged"] == 1 and done["evicted"] == 0
    assert not partial.exists() and sorted(raw.cache_key for raw in store.scan_entries()) == sorted(keys)


def test_a_temp_file_renamed_away_while_its_folder_is_listed_hides_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer's temp file can go between the listing of a folder and the stat of its files. Had the
    folder then read as empty, a contender for an expired lease would have found no generation, claimed the
    first again and won beside the real winner."""
    store = folder_tier(tmp_path / "d", partition="tc")
    assert store.acquire_lease("the-key", "w1", 30)
    folder = next((tmp_path / "d" / "leases").rglob("1")).parent
    listing = os.scandir

    def renamed_meanwhile(path: Any) -> Any:
        (folder / ".tmp-renamed").write_bytes(b"")
        with listing(path) as entries:
            found = list(entries)
        (folder / ".tmp-renamed").unlink()
        return contextlib.nullcontext(found)

    monkeypatch.setattr(os, "scandir", renamed_meanwhile)
    assert store.lease_holder("the-key") == "w1"
    assert store.acquire_lease("the-key", "w2", 30) is False


def test_a_truncated_entry_is_rejected_and_counted_not_served(tmp_path: Path) -> None:
    tier = f"dir:{tmp_path / 'd'}"
    cold = compile_json(GRAPHS, tier, tmp_path / "cold")
    victim = sorted(next((tmp_path / "d" / "entries").iterdir()).iterdir())[0]
    expires = victim.stat().st_mtime
    victim.write_bytes(victim.read_bytes()[:40])
    os.utime(victim, (time.time(), expires))  # still live: only its bytes are cut
    assert "1 problem\n" in cli("inspect", "verify", "--tier", tier, expect=1)
    again = compile_json(GRAPHS, tier, tmp_path / "again")
    assert again["tier_rejected"] >= 1 and again["traces"] == 1 and again["remote_hits"] == cold["traces"] - 1
    assert artifacts(tmp_path / "again") == artifacts(tmp_path / "cold")
    assert "0 problems" in cli("inspect", "verify", "--tier", tier)  # the trace stored it whole again


# -- names and paths ---------------------------------------------------------------------------------------
def test_hostile_keys_and_kernel_names_stay_inside_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "d"
    store = folder_tier(root, partition="../../partition")
    hostile = ["../../../outside", "/etc/passwd", "..", ".", "a\x00b", "\\..\\x"]
    store.store([StoreRequest(key, "d", key.encode(), "../../kernel", index_fields={b"../f": b"v"})
                 for key in hostile], TTL)  # fmt: skip
    store.put_entries([WriteItem(key + "-put", b"p", None, TTL) for key in hostile])
    assert store.acquire_lease("../../lease", "me", 30)
    assert sorted(tmp_path.iterdir()) == [root]
    assert store.get_entries(hostile) == {key: key.encode() for key in hostile}
    assert store.read_variant_index([("../../kernel", [b"../f"])]) == [[b"v"]]
    assert store.entry_partitions() == ["../../partition"]
    with pytest.raises(Exception, match="bytes"):  # a key too long for a file name is refused, not cut
        store.put_entries([WriteItem("k" * 200, b"p", None, TTL)])
    assert store.fetch(["k" * 200], TTL) == {}


def test_a_path_that_is_a_file_a_missing_one_and_a_foreign_directory_are_clear_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("not a directory")
    done = compile_json(GRAPHS, f"dir:{tmp_path / 'file'}", tmp_path / "out")  # compiled all the same, tier off
    assert done["tier_errors"] >= 1 and done["traces"] > 0
    assert f"dir tier {tmp_path / 'file'} is a file, not a directory" in caplog.text
    missing = tmp_path / "missing"
    result = CliRunner().invoke(main, ["inspect", "ls", "--tier", f"dir:{missing}"])
    assert result.exit_code != 0 and f"no dir tier at {missing}" in result.output and not missing.exists()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / blob_tier.MARKER).write_text("someone else's")
    with pytest.raises(Exception, match="is no nkicache tier"):
        folder_tier(tmp_path / "foreign")
    (tmp_path / "clash").mkdir()
    (tmp_path / "clash" / "entries").write_text("a file where a folder goes")
    with pytest.raises(Exception, match="entries"):
        folder_tier(tmp_path / "clash")
    reader = open_backend(Settings(tier=f"dir:{missing}"), writable=False)  # a read-only client: empty, not made
    assert reader.fetch(["k"], None) == {} and not missing.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to any directory")
def test_a_directory_that_is_not_writable_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "ro").mkdir()
    folder_tier(tmp_path / "ro").close()
    (tmp_path / "ro" / "entries").chmod(0o555)
    try:
        with pytest.raises(Exception, match="not writable"):
            folder_tier(tmp_path / "ro")
    finally:
        (tmp_path / "ro" / "entries").chmod(0o755)


def test_dir_urls_are_accepted_wherever_a_tier_url_is() -> None:
    assert tier_url_problem("dir:/shared/cache") is None
    assert tier_url_problem("dir:") == "dir: needs a path (dir:PATH)"
    assert tier_url_problem("local:/tmp/l.sqlite dir:/mnt/fsx/nkicache") is None
    assert tier_levels("local:/tmp/a b.sqlite dir:/mnt/my cache") == ["local:/tmp/a b.sqlite", "dir:/mnt/my cache"]
    assert tier_levels("dir:/mnt/a redis://h:6379") == ["dir:/mnt/a", "redis://h:6379"]
    assert redact_url("dir:/mnt/user:secret@x") == "dir:/mnt/user:secret@x"  # a path, nothing hidden or mangled
    assert "dir:PATH" in (tier_url_problem("gs://bucket") or "")


def test_gc_deletes_spent_lease_generations_and_the_folders_they_leave(tmp_path: Path) -> None:
    """A lease generation lives lease_ttl from its creation at most: gc deletes it after that, held or released,
    and the key's folder with it; a key whose lease is younger keeps it."""
    store = folder_tier(tmp_path / "d", lease_ttl=0.2)
    released, held, young = "ab" * 32, "cd" * 32, "ef" * 32
    assert store.acquire_lease(released, "w1", 60) and store.acquire_lease(held, "w1", 60)
    store.release_lease(released, "w1")
    assert store.expired_count() == (0, 0)  # younger than lease_ttl: maybe in use
    time.sleep(0.3)  # lease_ttl passes
    assert store.acquire_lease(young, "w2", 60)
    assert store.expired_count()[0] == 2
    store.purge_expired()
    partition = next((tmp_path / "d" / "leases").iterdir())
    assert len(list(partition.iterdir())) == 1  # the young lease's folder
    assert store.expired_count() == (0, 0) and store.lease_holder(young) == "w2"
    assert store.acquire_lease(held, "w2", 60)  # its spent lease was gone: taken afresh
