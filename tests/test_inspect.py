"""`nkicache inspect`: ls, show, du, verify (with entries corrupted directly in the store), explain,
export -> flush -> import round trips, and gc, on the local tier and a real Redis."""

from __future__ import annotations

import collections
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import msgspec
import pytest
from helpers_entries import old_reference
from helpers_graphs import TierView, delete_namespace, mixed_graph, write_graph
from helpers_report import (
    EXPECTED_KERNELS,
    EXPECTED_TOTALS,
    EXPECTED_VARIANTS,
    Tier,
    make_tier,
    nkicache,
    run_known_fleet,
)

from bridge.codegen import cache_key_of_stored as cache_key_of
from bridge.identity import toolchain_id
from cachestore.api import WriteItem
from cachestore.backends.sqlite import SqliteBackend
from cachestore.entry import Entry, SignaturePolicy, decode_entry, encode_entry
from cachestore.inspect import collect_garbage
from cachestore.keys import partition
from cachestore.stores import open_backend, open_tier
from workers.verify import rebuild_op

KEY = b"fleet-signing-key-for-tests-0001"
OTHER_KEY = b"someone-elses-signing-key-00002"
ANY = SignaturePolicy(require_signed=False)


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
    yield from make_tier(request, tmp_path)


@pytest.fixture
def fleet(tier: Tier) -> Tier:
    run_known_fleet(tier)
    return tier


def cli_json(tier: Tier, *args: str, code: int = 0, env: dict | None = None) -> object:
    result = nkicache(tier, "inspect", *args, "--json", env=env)
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def entries(tier: Tier) -> dict[str, Entry]:
    reader = open_backend(tier.settings(), reading=True)
    try:
        return {raw.cache_key: decode_entry(raw.data, ANY) for raw in reader.scan_entries()}
    finally:
        reader.close()


def raw_values(tier: Tier) -> dict[str, bytes]:
    reader = open_backend(tier.settings(), reading=True)
    try:
        return {raw.cache_key: raw.data for raw in reader.scan_entries()}
    finally:
        reader.close()


def key_of(tier: Tier, kernel: str, operand_shapes: list) -> str:
    for key, entry in entries(tier).items():
        kc = entry.key_components
        duplicate = "alias" in (kc.get("attrs") or {})  # add_duplicate's, of the same kernel and shapes
        if kc["kernel_name"] == kernel and kc["operands"]["shapes"] == operand_shapes and not duplicate:
            return key
    raise AssertionError(f"no {kernel} {operand_shapes}")


def add_duplicate(tier: Tier, source_key: str) -> str:
    """Publish the binary of `source_key` under another key (other attrs): the tier stores it whole again."""
    entry = entries(tier)[source_key]
    duplicate = msgspec.structs.replace(entry, key_components={**entry.key_components, "attrs": {"alias": 1}})
    key = cache_key_of(duplicate.key_components)
    client = open_tier(tier.settings(host="hostZ", worker="w0"))
    client.publish(key, duplicate)
    assert client.flush(timeout=10)
    client.close(timeout=10)
    assert entries(tier)[key].binary == entry.binary
    return key


# -- ls / show / du -------------------------------------------------------------------------------------
def test_ls_lists_every_entry_with_shapes_usage_and_filters(fleet: Tier) -> None:
    rows = cli_json(fleet, "ls")
    assert len(rows) == EXPECTED_VARIANTS
    assert {row["kernel_name"] for row in rows} == set(EXPECTED_KERNELS)
    assert sum(row["usage"] for row in rows) == EXPECTED_TOTALS["kernels"]
    softmax = [row for row in rows if row["operand_shapes"] == [[32, 48]] and row["kernel_name"] == "softmax"]
    assert softmax[0]["usage"] == 6 and softmax[0]["result_shapes"] == [[32, 48]]
    assert all(row["target"] == "Trn2" and row["error"] is None and row["bytes"] > 0 and row["binary_bytes"] > 0
               for row in rows)  # fmt: skip

    assert len(cli_json(fleet, "ls", "--kernel", "matmul_tiled")) == 4
    assert cli_json(fleet, "ls", "--target", "Trn1") == []
    text = nkicache(fleet, "inspect", "ls", "--kernel", "softmax")
    assert text.exit_code == 0 and len(text.stdout.splitlines()) == 2
    assert "[32,48] -> [32,48] float32" in text.stdout and "usage 6" in text.stdout


def test_show_gives_components_sizes_producer_usage_and_hosts(fleet: Tier) -> None:
    key = key_of(fleet, "softmax", [[32, 48]])
    shown = cli_json(fleet, "show", key[:10])
    assert shown["key"] == key
    assert shown["key_components"]["operands"] == {"shapes": [[32, 48]], "dtypes": ["float32"]}
    assert shown["key_components"]["target"] == "Trn2" and shown["key_components"]["num_neuroncores"] == 2
    assert shown["usage"] == 6 and shown["hosts"] == ["hostA", "hostB"]
    assert shown["first_use"] <= shown["last_use"] <= time.time()
    assert shown["producer_host"] == "hostA" and shown["producer_worker"] == "w1"
    assert 0 < shown["bytes"] < shown["binary_bytes"]  # stored compressed
    assert shown["verified"] is True and shown["signature"] == "none" and "ref" not in shown
    assert shown["compile_seconds"] > 0 and shown["format"] == "bir"
    text = nkicache(fleet, "inspect", "show", key[:12]).stdout
    assert f"key: {key}" in text and "hosts: hostA, hostB" in text
    # Issue 34: as a person reads them, not as Python spells them.
    assert not re.search(r"\b(None|True|False)\b", text), text
    for line in ("verified: yes", "problem: none", "writer: none"):
        assert line in text.splitlines(), (line, text)

    missing = nkicache(fleet, "inspect", "show", "0123456789")
    assert missing.exit_code == 2 and "no entry starts with 0123456789" in missing.stderr
    assert nkicache(fleet, "inspect", "show", "not-hex").exit_code == 2


def test_du_counts_storage_by_kernel(fleet: Tier) -> None:
    source = key_of(fleet, "softmax", [[32, 48]])
    duplicate = add_duplicate(fleet, source)
    old = cache_key_of({**entries(fleet)[source].key_components, "attrs": {"old": 1}})
    TierView.of(fleet.backend).put_raw(old, old_reference(entries(fleet)[source], source))  # an older build's
    usage = cli_json(fleet, "du")
    softmax = usage["kernels"]["softmax"]
    stored = entries_but(fleet, old)
    binaries = sum(len(e.binary) for e in stored.values() if e.key_components["kernel_name"] == "softmax")
    assert softmax == {"entries": 3, "bytes": softmax["bytes"], "binary_bytes": binaries}
    assert usage["total"]["entries"] == EXPECTED_VARIANTS + 1  # the old reference is no kernel's entry
    assert usage["unreadable"] == {"entries": 1, "bytes": len(raw_values(fleet)[old])}
    assert usage["total"]["bytes"] + usage["unreadable"]["bytes"] == sum(len(v) for v in raw_values(fleet).values())
    assert usage["kernels"]["matmul_tiled"]["entries"] == 4
    du = nkicache(fleet, "inspect", "du").stdout
    assert "softmax" in du and "dedupe" not in du and "references" not in du
    assert "| softmax" in du and not any(c in du for c in "│┃━")  # piped: an ASCII table
    assert cli_json(fleet, "show", duplicate)["binary_bytes"] == len(stored[source].binary)


def entries_but(tier: Tier, *keys: str) -> dict[str, Entry]:
    """`entries` of the keys that decode (all but `keys`)."""
    reader = open_backend(tier.settings(), reading=True)
    try:
        return {
            raw.cache_key: decode_entry(raw.data, ANY) for raw in reader.scan_entries() if raw.cache_key not in keys
        }
    finally:
        reader.close()


# -- verify ---------------------------------------------------------------------------------------------
def test_verify_names_every_corrupted_entry_with_its_reason(fleet: Tier) -> None:
    view = TierView.of(fleet.backend)
    good = entries(fleet)
    keys = sorted(good)
    flipped, truncated, forged, wrong_sig, broken_frame = keys[:5]
    signed_ok = keys[5]

    data = bytearray(view.raw(flipped))
    data[len(data) // 2] ^= 0xFF  # inside the compressed payload, the bulk of the entry
    view.put_raw(flipped, bytes(data))
    view.put_raw(truncated, view.raw(truncated)[: len(view.raw(truncated)) // 2])
    evil = Entry(**{**good[forged]._fields(), "binary": b"\x00evil binary", "digest": good[forged].digest})
    view.put_raw(forged, encode_entry(evil))
    view.put_raw(wrong_sig, encode_entry(good[wrong_sig], OTHER_KEY))
    view.put_raw(broken_frame, b"\xc1" + view.raw(broken_frame)[1:])
    view.put_raw(signed_ok, encode_entry(good[signed_ok], KEY))
    misplaced = "ab" * 32  # a valid entry copied under a key its components do not hash to
    view.put_raw(misplaced, view.raw(keys[6]))
    reference = cache_key_of({**good[keys[7]].key_components, "attrs": {"reference": 1}})
    old = msgspec.structs.replace(
        good[keys[7]], key_components={**good[keys[7]].key_components, "attrs": {"reference": 1}}
    )
    view.put_raw(reference, old_reference(old, keys[7]))  # an older build's, to an entry that holds the binary

    env = {"NKICACHE_HMAC_KEY": KEY.decode(), "NKICACHE_REQUIRE_SIGNED": "false"}
    report = cli_json(fleet, "verify", code=1, env=env)
    reasons = {item["key"]: item["reason"] for item in report["bad"]}
    assert report["checked"] == EXPECTED_VARIANTS + 2
    assert set(reasons) == {flipped, truncated, forged, wrong_sig, broken_frame, misplaced, reference}
    assert report["ok"] == report["checked"] - 7
    assert reasons[flipped] == "stored bytes do not match their digest"
    assert reasons[truncated] == "stored bytes do not match their digest"
    assert reasons[forged] == "binary does not match its digest"  # a body whose digest lies: verify hashes binaries
    assert reasons[wrong_sig] == "signature does not verify with this reader's key"
    assert reasons[broken_frame] == "not an nkicache entry"
    assert reasons[misplaced].startswith("key components hash to") and "not to the key" in reasons[misplaced]
    assert "reference to another key's binary" in reasons[reference]

    # Without the key the signed entries are accepted on their digest, unless unverifiable ones are refused.
    relaxed = cli_json(fleet, "verify", code=1)
    assert wrong_sig not in {item["key"] for item in relaxed["bad"]}
    strict = cli_json(fleet, "verify", code=1, env={"NKICACHE_REJECT_UNVERIFIABLE": "true"})
    assert {wrong_sig, signed_ok} <= {item["key"] for item in strict["bad"]}
    # With the key and signatures required, every unsigned entry is bad.
    required = cli_json(fleet, "verify", code=1, env={"NKICACHE_HMAC_KEY": KEY.decode()})
    assert required["ok"] == 1

    text = nkicache(fleet, "inspect", "verify", env=env)
    assert text.exit_code == 1
    assert f"checked {EXPECTED_VARIANTS + 2} entries: {EXPECTED_VARIANTS - 5} ok, 7 problems" in text.stdout
    for key in reasons:
        assert key in text.stdout
    listing = cli_json(fleet, "ls")
    # ls decodes as a hit does (the stored bytes' digest, not the binary's): the lying body is verify's to find.
    assert {row["key"] for row in listing if row["error"]} == {flipped, truncated, broken_frame, reference}


def test_verify_recompiles_and_executes_a_sample(fleet: Tier) -> None:
    clean = cli_json(fleet, "verify", "--recompile", "20", "--execute", "20")
    assert clean == {"checked": 8, "ok": 8, "bad": [], "recompiled": 8, "executed": 8}

    # A self-consistent forgery: another kernel's binary, with its digest, under this key. Only re-tracing
    # or running it shows that it is not what the key says.
    view = TierView.of(fleet.backend)
    good = entries(fleet)
    target = key_of(fleet, "softmax", [[32, 48]])
    donor = good[key_of(fleet, "softmax", [[32, 96]])]
    forged = Entry(**{**good[target]._fields(), "binary": donor.binary, "digest": donor.digest})
    view.put_raw(target, encode_entry(forged))
    assert cli_json(fleet, "verify")["bad"] == []
    recompiled = cli_json(fleet, "verify", "--recompile", "8", code=1)
    assert recompiled["bad"] == [{"key": target, "reason": recompiled["bad"][0]["reason"]}]
    assert recompiled["bad"][0]["reason"].startswith("recompiled binary differs")
    executed = cli_json(fleet, "verify", "--execute", "8", code=1)
    assert [item["key"] for item in executed["bad"]] == [target]
    assert executed["bad"][0]["reason"].startswith("execution")


def test_rebuild_op_maps_kernel_names_back_to_func_names(fleet: Tier) -> None:
    func_names = {rebuild_op(entry.key_components).func_name for entry in entries(fleet).values()}
    assert func_names == {"Matmul", "Softmax", "RMSNorm"}
    conv = {"kernel_name": "conv2d_pbp_1x1", "operands": {"shapes": [[1, 8, 6, 6], [16, 8, 1, 1]],
            "dtypes": ["float32", "float32"]}, "results": {"shapes": [[1, 16, 6, 6]], "dtypes": ["float32"]},
            "attrs": {"stride": [1, 1], "padding": [[0, 0], [0, 0]], "dilation": [1, 1]},
            "target": "Trn2", "num_neuroncores": 2}  # fmt: skip
    assert rebuild_op(conv).func_name == "Conv2d"


# -- explain --------------------------------------------------------------------------------------------
def test_explain_says_hit_or_miss_and_which_components_differ(fleet: Tier, tmp_path: Path) -> None:
    graph = mixed_graph("mixed-64", rows=64)
    path = write_graph(tmp_path, graph)
    hit = cli_json(fleet, "explain", "--graph", str(path), "--op", "6")  # Softmax on n0 [32, 48]
    assert hit["present"] is True and hit["nearest"][0]["distance"] == 0
    assert hit["key"] == key_of(fleet, "softmax", [[32, 48]])

    graph["ops"][4]["attrs"] = {"eps": 1e-4}  # RMSNorm with an eps no pass used
    path = write_graph(tmp_path, graph)
    miss = cli_json(fleet, "explain", "--graph", str(path), "--op", "4")
    assert miss["present"] is False
    nearest = miss["nearest"][0]
    assert nearest["distance"] == 1
    [differs] = nearest["differs"]
    assert differs["component"] == "attrs.eps" and differs["wanted"] == 1e-4 and differs["existing"] in (1e-5, 1e-6)

    trn1 = cli_json(fleet, "explain", "--graph", str(path), "--op", "6", "--target", "Trn1")
    assert trn1["present"] is False
    assert {d["component"] for d in trn1["nearest"][0]["differs"]} == {"target", "num_neuroncores"}

    components = {"kernel_name": "softmax", "operands": {"shapes": [[32, 50]], "dtypes": ["float32"]},
                  "results": {"shapes": [[32, 50]], "dtypes": ["float32"]}}  # fmt: skip
    result = nkicache(fleet, "inspect", "explain", "-", "--json", input=json.dumps(components))
    answer = json.loads(result.stdout)
    assert answer["present"] is False
    assert {d["component"] for d in answer["nearest"][0]["differs"]} == {"operands.shapes", "results.shapes"}
    text = nkicache(fleet, "inspect", "explain", json.dumps(components)).stdout
    assert "not in the tier: a lookup misses" in text and "operands.shapes: wanted [[32, 50]]" in text

    assert nkicache(fleet, "inspect", "explain").exit_code == 2
    assert nkicache(fleet, "inspect", "explain", "--graph", str(path), "--op", "5").exit_code == 2  # an Add


# -- export / import ------------------------------------------------------------------------------------
def test_export_flush_import_verify_round_trips_everything(fleet: Tier, tmp_path: Path) -> None:
    add_duplicate(fleet, key_of(fleet, "softmax", [[32, 48]]))
    before = raw_values(fleet)
    snapshot = tmp_path / "tier.snapshot"
    result = nkicache(fleet, "inspect", "export", str(snapshot))
    assert result.exit_code == 0 and f"exported {len(before)} entries" in result.stdout

    # The snapshot alone answers inspection offline.
    offline = cli_json(None, "--snapshot", str(snapshot), "ls")
    assert {row["key"] for row in offline} == set(before)
    assert sum(row["usage"] for row in offline) == EXPECTED_TOTALS["kernels"]
    assert cli_json(None, "verify", "--snapshot", str(snapshot))["ok"] == len(before)
    shown = cli_json(None, "show", "--snapshot", str(snapshot), key_of(fleet, "softmax", [[32, 48]]))
    assert shown["usage"] == 6 and shown["hosts"] == ["hostA", "hostB"]

    flush(fleet)
    assert raw_values(fleet) == {}
    imported = nkicache(fleet, "inspect", "import", str(snapshot), "--json")
    assert imported.exit_code == 0, imported.output
    assert json.loads(imported.stdout) == {"imported": len(before), "rejected": []}
    assert raw_values(fleet) == before  # byte for byte
    assert cli_json(fleet, "verify") == {"checked": len(before), "ok": len(before), "bad": [], "recompiled": 0,
                                          "executed": 0}  # fmt: skip
    # And compiles hit what was imported.
    client = open_tier(fleet.settings(host="hostD", worker="w4"))
    assert all(client.lookup(key) is not None for key in before)
    client.close(timeout=10)


def flush(tier: Tier) -> None:
    """Empty the tier: only this test's namespace on the shared Redis; a new file for the local tier."""
    if tier.kind == "redis":
        delete_namespace(tier.client, tier.namespace)
    else:
        tier.backend.close()
        tier.backend.path.unlink()
        for suffix in ("-wal", "-shm"):
            Path(str(tier.backend.path) + suffix).unlink(missing_ok=True)
        tier.backend = SqliteBackend(tier.backend.path)


def test_import_verifies_each_entry_before_writing(fleet: Tier, tmp_path: Path) -> None:
    view = TierView.of(fleet.backend)
    good = entries(fleet)
    keys = sorted(good)
    view.put_raw(keys[0], view.raw(keys[0])[:-7])
    view.put_raw(keys[1], encode_entry(good[keys[1]], OTHER_KEY))
    snapshot = tmp_path / "mixed.snapshot"
    assert nkicache(fleet, "inspect", "export", str(snapshot)).exit_code == 0

    into = tmp_path / "fresh.sqlite"
    SqliteBackend(into).close()
    env = {"NKICACHE_HMAC_KEY": KEY.decode(), "NKICACHE_REQUIRE_SIGNED": "false"}
    result = nkicache(None, "inspect", "import", str(snapshot), "--tier", f"local:{into}", "--json", env=env)
    assert result.exit_code == 1
    answer = json.loads(result.stdout)
    assert answer["imported"] == EXPECTED_VARIANTS - 2
    assert {item["key"] for item in answer["rejected"]} == {keys[0], keys[1]}
    fresh = open_backend(fleet.settings().replace(tier=f"local:{into}"), reading=True)
    assert {raw.cache_key for raw in fresh.scan_entries()} == set(keys[2:])
    fresh.close()


def test_a_truncated_snapshot_is_refused(fleet: Tier, tmp_path: Path) -> None:
    snapshot = tmp_path / "cut.snapshot"
    assert nkicache(fleet, "inspect", "export", str(snapshot)).exit_code == 0
    snapshot.write_bytes(snapshot.read_bytes()[:-40])
    result = nkicache(None, "inspect", "--snapshot", str(snapshot), "verify")
    assert result.exit_code == 2
    assert "snapshot is truncated" in result.stderr or "snapshot is corrupt" in result.stderr
    not_one = tmp_path / "other.snapshot"
    not_one.write_bytes(msgpack.packb({"something": "else"}))
    assert "not an nkicache snapshot" in nkicache(None, "inspect", "--snapshot", str(not_one), "ls").stderr


# -- gc -------------------------------------------------------------------------------------------------
def test_gc_evicts_by_value_within_a_byte_budget_and_never_metrics(fleet: Tier) -> None:
    before = raw_values(fleet)
    total = sum(len(v) for v in before.values())
    report_before = json.loads(nkicache(fleet, "report", "--json").stdout)

    dry = cli_json(fleet, "gc", "--dry-run", "--max-bytes", "0")
    assert dry["dry_run"] is True and dry["evicted"] == len(before) and dry["kept_bytes"] == 0
    assert raw_values(fleet) == before

    usage = {row["key"]: row["usage"] for row in cli_json(fleet, "ls")}
    stored = entries(fleet)

    def value(key: str) -> float:
        """Compile seconds saved per stored byte."""
        return max(stored[key].compile_seconds, 1e-3) * usage[key] / len(before[key])

    budget = total // 2
    done = cli_json(fleet, "gc", "--max-bytes", str(budget))
    after = raw_values(fleet)
    assert done["evicted"] > 0 and set(done["keys"]) == set(before) - set(after)
    assert sum(len(v) for v in after.values()) == done["kept_bytes"] <= budget
    assert done["reasons"] == {"over budget": done["evicted"]}
    # What goes is the least valuable: compile seconds saved per stored byte.
    assert max(value(key) for key in done["keys"]) <= min(value(key) for key in after)
    report_after = json.loads(nkicache(fleet, "report", "--json").stdout)
    assert report_after["totals"] == report_before["totals"]
    assert report_after["per_kernel"] == report_before["per_kernel"]


def test_gc_evicts_unused_and_unreadable_entries(fleet: Tier) -> None:
    view = TierView.of(fleet.backend)
    keys = sorted(raw_values(fleet))
    view.put_raw(keys[0], b"garbage")
    reader = open_backend(fleet.settings(), reading=True)
    try:
        kept = collect_garbage(reader, ANY, unused_for=3600, dry_run=True)
        assert kept["reasons"] == {"unreadable": 1}
        later = collect_garbage(reader, ANY, unused_for=3600, now=time.time() + 7200)
        assert later["evicted"] == EXPECTED_VARIANTS
        assert later["reasons"] == {"unreadable": 1, "unused": EXPECTED_VARIANTS - 1}
    finally:
        reader.close()
    assert raw_values(fleet) == {}
    assert json.loads(nkicache(fleet, "report", "--json").stdout)["totals"]["kernels"] == 24


def test_gc_evicts_an_older_builds_reference_entries_whatever_they_name(fleet: Tier) -> None:
    source = key_of(fleet, "softmax", [[32, 48]])
    old = msgspec.structs.replace(
        entries(fleet)[source], key_components={"kernel_name": "softmax", "attrs": {"old": 1}}
    )
    TierView.of(fleet.backend).put_raw("ab" * 32, old_reference(old, source))
    done = cli_json(fleet, "gc")
    assert done["keys"] == ["ab" * 32] and done["reasons"] == {"unreadable": 1}
    assert source in raw_values(fleet)  # the entry it named is an entry like any other


def test_gc_purges_expired_local_entries(tmp_path: Path) -> None:
    from helpers_graphs import unique_namespace

    path = tmp_path / "tier.sqlite"
    tier = Tier("local", f"local:{path}", unique_namespace(), SqliteBackend(path))
    run_known_fleet(tier)
    view = TierView.of(tier.backend)
    view.set_ttl(sorted(raw_values(tier))[0], -10)
    done = cli_json(tier, "gc")
    assert done["expired_purged"] == 1 and done["evicted"] == 0 and done["entries"] == EXPECTED_VARIANTS - 1
    tier.backend.close()


def test_gc_refuses_a_snapshot(tmp_path: Path) -> None:
    snapshot = tmp_path / "s.snapshot"
    snapshot.write_bytes(b"")
    result = nkicache(None, "inspect", "--snapshot", str(snapshot), "gc")
    assert result.exit_code == 2 and "read-only" in result.output


# -- toolchains -----------------------------------------------------------------------------------------
def copy_into_toolchain(tier: Tier, toolchain: str, traced_by: str | None = None) -> list[str]:
    """Every entry of this compiler, re-encoded as traced by `traced_by` (default: `toolchain`) and written
    into `toolchain`'s partition: another compiler's view of the same variants."""
    reader = open_backend(tier.settings(), reading=True)
    try:
        items = []
        for raw in reader.scan_entries():
            entry = decode_entry(raw.data, ANY)
            entry.toolchain = traced_by or toolchain
            items.append(WriteItem(raw.cache_key, encode_entry(entry), entry.digest, 3600))
        reader.in_partition(partition(toolchain)).put_entries(items)
        return sorted(item.cache_key for item in items)
    finally:
        reader.close()


def test_each_toolchain_is_listed_measured_verified_and_collected_apart(fleet: Tier) -> None:
    other = "0" * 16
    keys = copy_into_toolchain(fleet, other)
    rows = cli_json(fleet, "ls")
    assert len(rows) == 2 * EXPECTED_VARIANTS
    assert collections.Counter(row["toolchain"] for row in rows) == {toolchain_id(): len(keys), other: len(keys)}
    assert cli_json(fleet, "du")["toolchains"].keys() == {toolchain_id(), other}
    mine = cli_json(fleet, "verify")
    theirs = json.loads(nkicache(fleet, "inspect", "--toolchain", other, "verify", "--json").stdout)
    assert (mine["checked"], mine["ok"], theirs["checked"], theirs["ok"]) == (len(keys),) * 4
    shown = json.loads(nkicache(fleet, "inspect", "--toolchain", other, "show", keys[0], "--json").stdout)
    assert (shown["toolchain"], shown["traced_by"], shown["problem"]) == (other, other, None)
    # Recompiling another compiler's entries with this one proves nothing: refused with a reason.
    refused = nkicache(fleet, "inspect", "--toolchain", other, "verify", "--recompile", "1")
    assert refused.exit_code == 2 and "traced by another" in refused.stderr

    report_before = json.loads(nkicache(fleet, "report", "--json").stdout)
    dry = cli_json(fleet, "gc", "--other-toolchains", "--dry-run")
    assert (dry["evicted"], dry["reasons"], dry["evicted_by_toolchain"]) == (
        len(keys),
        {"other toolchain": len(keys)},
        {other: len(keys)},
    )
    assert [(item["key"], item["toolchain"], item["reason"]) for item in dry["evictions"]] == [
        (key, other, "other toolchain") for key in keys
    ]
    # Issue 34: the text says which entries would go, one line each, not only how many.
    text = nkicache(fleet, "inspect", "gc", "--other-toolchains", "--dry-run").stdout
    listed = [line for line in text.splitlines() if line.startswith("  would evict ")]
    assert [line.split()[2:4] for line in listed] == [[key[:16], other[:8]] for key in keys], text
    assert all(line.endswith(" bytes: other toolchain") for line in listed), text
    assert len(cli_json(fleet, "ls")) == 2 * EXPECTED_VARIANTS
    cli_json(fleet, "gc", "--other-toolchains")
    assert {row["toolchain"] for row in cli_json(fleet, "ls")} == {toolchain_id()}
    assert json.loads(nkicache(fleet, "report", "--json").stdout)["totals"] == report_before["totals"]


def test_an_entry_in_another_toolchains_partition_fails_verify(fleet: Tier) -> None:
    """This compiler's entries copied, unchanged, into a partition of another toolchain."""
    other = "1" * 16
    keys = copy_into_toolchain(fleet, other, traced_by=toolchain_id())
    result = json.loads(nkicache(fleet, "inspect", "--toolchain", other, "verify", "--json").stdout)
    assert result["ok"] == 0 and {item["key"] for item in result["bad"]} == set(keys)
    assert all("but stored in toolchain 1111111111111111's partition" in item["reason"] for item in result["bad"])


def test_export_and_import_keep_each_toolchain_apart(fleet: Tier, tmp_path: Path) -> None:
    other = "2" * 16
    keys = copy_into_toolchain(fleet, other)
    snapshot = tmp_path / "two.snapshot"
    assert nkicache(fleet, "inspect", "export", str(snapshot)).exit_code == 0
    into = tmp_path / "into.sqlite"
    SqliteBackend(into).close()
    imported = json.loads(nkicache(None, "inspect", "import", str(snapshot), "--tier", f"local:{into}", "--json",
                                   env={"NKICACHE_NAMESPACE": fleet.namespace}).stdout)  # fmt: skip
    assert (imported["imported"], imported["rejected"]) == (2 * len(keys), [])
    fresh = SqliteBackend(into, create=False)
    assert fresh.entry_partitions() == sorted([partition(toolchain_id()), partition(other)])
    assert sorted(raw.cache_key for raw in fresh.in_partition(partition(other)).scan_entries()) == keys
    fresh.close()


def test_import_into_a_new_local_file_creates_the_tier(fleet: Tier, tmp_path: Path) -> None:
    """A fresh machine seeded from a snapshot: the local tier file does not exist yet, and import makes it."""
    snapshot = tmp_path / "seed.snapshot"
    exported = nkicache(fleet, "inspect", "export", str(snapshot), "--json")
    assert json.loads(exported.stdout) == {"exported": EXPECTED_VARIANTS, "file": str(snapshot)}
    into = tmp_path / "new" / "tier.sqlite"
    result = nkicache(None, "inspect", "import", str(snapshot), "--tier", f"local:{into}", "--json",
                      env={"NKICACHE_NAMESPACE": fleet.namespace})  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"imported": EXPECTED_VARIANTS, "rejected": []}
    fresh = SqliteBackend(into, create=False)
    assert len(list(fresh.scan_entries())) == EXPECTED_VARIANTS
    fresh.close()
    # gc still never creates a tier it was pointed at by mistake.
    assert nkicache(None, "inspect", "gc", "--tier", f"local:{tmp_path / 'typo.sqlite'}").exit_code == 2
    assert not (tmp_path / "typo.sqlite").exists()
