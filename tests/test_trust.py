"""Per-writer Ed25519 signatures (issue 22): `nkicache keygen`, the trust policy file, the entry's writer
section, and a reader that accepts only trusted writers' entries. Scopes are in test_scopes.py."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from helpers_entries import body_of, compress
from helpers_trust import fresh_tier, trust_of, trusting
from test_entry import make_entry, rejected

import cachestore.entry as entry_module
from cachestore.client import TierClient
from cachestore.credentials import load_credentials
from cachestore.entry import (
    MAGIC,
    Entry,
    SignaturePolicy,
    decode_entries,
    decode_entry,
    encode_entry,
    writer_of,
)
from cachestore.settings import Settings, SettingsError, load_settings
from cachestore.signatures import signed_message
from cachestore.stores import open_tier
from cachestore.trust import (
    TrustedWriter,
    TrustError,
    TrustPolicy,
    WriterKey,
    load_trust_policy,
    load_writer_key,
)
from workers.cli import main as nkicache

KEY = "a" * 64
OTHER = "b" * 64


@pytest.fixture
def policy_file(tmp_path: Path, ci: WriterKey) -> Path:
    path = tmp_path / "trust.toml"
    path.write_text((tmp_path / "ci.key.pub").read_text())
    return path


# -- keygen and the files ------------------------------------------------------------------------------------
def test_keygen_writes_a_private_key_only_its_owner_reads_and_the_policy_table(tmp_path: Path) -> None:
    path = tmp_path / "w.key"
    result = CliRunner().invoke(nkicache, ["keygen", str(path), "--name", 'ci "main"', "--json"])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    policy = load_trust_policy(f"{path}.pub")
    key = load_writer_key(path)
    assert list(policy.writers) == [key.key_id]
    assert policy.name_of(key.key_id) == 'ci "main"'
    assert key.key_id_hex in result.output and len(key.key_id_hex) == 32
    again = CliRunner().invoke(nkicache, ["keygen", str(path)])
    assert again.exit_code != 0 and "not overwritten" in again.output
    assert load_writer_key(path).key_id == key.key_id


def test_a_writer_key_others_can_read_is_refused(tmp_path: Path, ci: WriterKey) -> None:
    path = tmp_path / "ci.key"
    os.chmod(path, 0o644)
    with pytest.raises(TrustError, match="readable or writable by others"):
        load_writer_key(path)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[[writer]]\nname = 'x'\npublic_key = 'not base64!'\n", "not the base64"),
        ("[[writer]]\nname = 'x'\npublic_key = 'AAAA'\n", "not the base64"),
        ("[[writer]]\nname = 'x'\nkey_id = '00'\npublic_key = '{pub}'\n", "is not the id of its public_key"),
        ("[[writer]]\nname = 'x'\npublic_key = '{pub}'\nscope = 'a'\n", "name, public_key and key_id only"),
        ("writers = 1\n", "unknown trust policy key"),
        ("[[writer]\n", "not valid TOML"),
    ],
)
def test_a_bad_trust_policy_is_one_clear_error_naming_the_file(
    tmp_path: Path, ci: WriterKey, text: str, problem: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text.replace("{pub}", ci.public_base64()))
    with pytest.raises(TrustError, match=problem) as info:
        load_trust_policy(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_open_tier_names_a_missing_policy_file_as_a_settings_error(tmp_path: Path) -> None:
    settings = Settings(tier=f"local:{tmp_path / 't.sqlite'}", trust_policy=str(tmp_path / "missing.toml"))
    with pytest.raises(SettingsError, match=r"missing\.toml: cannot read the trust policy"):
        open_tier(settings)


def test_distrust_removes_a_writer_in_one_command(policy_file: Path, ci: WriterKey, laptop: WriterKey) -> None:
    policy_file.write_text(policy_file.read_text() + "\n" + laptop.policy_entry("laptop"))
    assert set(load_trust_policy(policy_file).writers) == {ci.key_id, laptop.key_id}
    env = {"NKICACHE_TRUST_POLICY": str(policy_file)}
    result = CliRunner().invoke(nkicache, ["trust", "distrust", ci.key_id_hex], env=env)
    assert result.exit_code == 0, result.output
    assert set(load_trust_policy(policy_file).writers) == {laptop.key_id}
    shown = CliRunner().invoke(nkicache, ["trust", "show", "--policy", str(policy_file)])
    assert shown.output.split() == [laptop.key_id_hex, "laptop"]
    again = CliRunner().invoke(nkicache, ["trust", "distrust", ci.key_id_hex, "--policy", str(policy_file)])
    assert again.exit_code != 0 and "no writer" in again.output
    unset = CliRunner().invoke(nkicache, ["trust", "distrust", ci.key_id_hex], env={"NKICACHE_TRUST_POLICY": ""})
    assert unset.exit_code != 0 and "no --policy" in unset.output


# -- the entry's writer section ------------------------------------------------------------------------------
def test_a_trusted_writers_entry_round_trips_and_names_its_writer(ci: WriterKey) -> None:
    entry = make_entry()
    data = encode_entry(entry, writer=ci, cache_key=KEY)
    decoded = decode_entry(data, trusting(ci), cache_key=KEY)
    assert decoded == entry and decoded.signed and not decoded.unverified
    assert decoded.writer == ci.key_id_hex == writer_of(data)


def test_hmac_and_writer_signature_together(ci: WriterKey) -> None:
    data = encode_entry(make_entry(), hmac_key=b"k" * 32, writer=ci, cache_key=KEY)
    both = SignaturePolicy(hmac_key=b"k" * 32, trust=trusting(ci).trust)
    assert decode_entry(data, both, cache_key=KEY).writer == ci.key_id_hex
    assert "does not verify" in rejected(data, SignaturePolicy(hmac_key=b"o" * 32, trust=both.trust), cache_key=KEY)


def test_an_untrusted_writers_entry_is_rejected_by_its_key_id(ci: WriterKey, laptop: WriterKey) -> None:
    data = encode_entry(make_entry(), writer=laptop, cache_key=KEY)
    reason = rejected(data, trusting(ci), cache_key=KEY)
    assert laptop.key_id_hex in reason and "does not trust" in reason


def test_an_entry_without_a_writer_signature_is_rejected_by_a_reader_with_a_trust_policy(ci: WriterKey) -> None:
    """Entries from before writer signatures (and HMAC-only ones) are misses for such a reader: traced again."""
    assert "no writer signature" in rejected(encode_entry(make_entry()), trusting(ci), cache_key=KEY)
    hmac_only = encode_entry(make_entry(), hmac_key=b"k" * 32)
    policy = SignaturePolicy(hmac_key=b"k" * 32, trust=trusting(ci).trust)
    assert "no writer signature" in rejected(hmac_only, policy, cache_key=KEY)


def test_the_signature_binds_the_cache_key_a_transplanted_entry_does_not_verify(ci: WriterKey) -> None:
    data = encode_entry(make_entry(), writer=ci, cache_key=KEY)
    assert "does not verify" in rejected(data, trusting(ci), cache_key=OTHER)


def test_forged_headers_are_rejected_with_a_reason(ci: WriterKey, laptop: WriterKey) -> None:
    good = encode_entry(make_entry(), writer=laptop, cache_key=KEY)
    section = len(MAGIC) + 2 + 32
    claims_ci = good[:section] + ci.key_id + good[section + 16 :]  # the laptop's signature under ci's key id
    assert "does not verify" in rejected(claims_ci, trusting(ci), cache_key=KEY)
    flipped = bytearray(encode_entry(make_entry(), writer=ci, cache_key=KEY))
    flipped[section + 20] ^= 1  # a bit of the signature
    assert "does not verify" in rejected(bytes(flipped), trusting(ci), cache_key=KEY)
    stripped = bytearray(good)
    stripped[len(MAGIC) + 1] = 0  # flag cleared: the 80 writer bytes are read as the payload
    assert "digest" in rejected(bytes(stripped), trusting(ci), cache_key=KEY)
    truncated = good[: section + 40]
    assert "truncated" in rejected(truncated, trusting(ci), cache_key=KEY)
    assert "cache key" in rejected(encode_entry(make_entry(), writer=ci, cache_key=KEY), trusting(ci))


def test_without_a_trust_policy_a_writer_signed_entry_is_unverified_or_rejected_as_configured(ci: WriterKey) -> None:
    data = encode_entry(make_entry(), writer=ci, cache_key=KEY)
    decoded = decode_entry(data, SignaturePolicy(hmac_key=None))
    assert decoded.unverified and not decoded.signed and decoded.writer == ci.key_id_hex
    assert "no trust policy" in rejected(data, SignaturePolicy(hmac_key=None, reject_unverifiable=True))


# -- the client --------------------------------------------------------------------------------------------
def tier_settings(tmp_path: Path, **changes: object) -> Settings:
    return Settings(tier=f"local:{tmp_path / 'tier.sqlite'}", host="h", flush_interval=0.05, **changes)


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def base(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    yield from fresh_tier(request, tmp_path)


def test_a_reader_counts_untrusted_entries_as_rejected_and_accepts_trusted_ones(
    base: Settings, tmp_path: Path, ci: WriterKey, laptop: WriterKey, policy_file: Path
) -> None:
    """Both writers write the trusted scope here (scope=trusted set by hand): the policy alone decides."""
    for name in ("ci", "laptop"):
        writer = open_tier(base.replace(writer_key_file=str(tmp_path / f"{name}.key"), scope="trusted"))
        writer.publish(KEY if name == "ci" else OTHER, make_entry(binary=name.encode() * 100))
        writer.close(timeout=10)
    reader = open_tier(base.replace(trust_policy=str(policy_file), tier_mode="read-only"))
    try:
        found, held = reader.find_many([KEY, OTHER])
        assert set(found) == {KEY} and held == {KEY, OTHER}
        assert found[KEY].writer == ci.key_id_hex and found[KEY].binary == b"ci" * 100
        assert reader.counts()["tier_rejected"] == 1
    finally:
        reader.close()


def test_settings_scope_is_validated_and_credentials_resolve_it(
    tmp_path: Path, ci: WriterKey, laptop: WriterKey, policy_file: Path
) -> None:
    with pytest.raises(SettingsError, match="scope"):
        load_settings({"scope": "a:b"}, environ={})
    ci_file, laptop_file = str(tmp_path / "ci.key"), str(tmp_path / "laptop.key")
    assert load_credentials(ci_file, str(policy_file), "auto", writes=True).scope == ""
    assert load_credentials(laptop_file, str(policy_file), "auto", writes=True).scope == f"w-{laptop.key_id_hex}"
    assert load_credentials(laptop_file, str(policy_file), "auto", writes=False).scope == ""
    assert load_credentials("", str(policy_file), "auto", writes=True).scope == "unsigned"
    assert load_credentials("", "", "auto", writes=True).scope == ""  # no per-writer keys: as before
    assert load_credentials(laptop_file, "", "pr", writes=True).scope == "pr"
    own = load_credentials(laptop_file, str(policy_file), "auto", writes=True).trust
    assert own.trusts(laptop.key_id) and own.trusts(ci.key_id)  # it reads what it wrote in its own scope


def test_a_writing_client_with_a_policy_and_no_key_is_told_once_it_reads_nothing_it_trusts(
    tmp_path: Path, ci: WriterKey, laptop: WriterKey, policy_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Such a client works in the `unsigned` scope, where its own policy refuses everything it stores: one
    warning per process says so and names the settings that make it useful; a read-only one, one with a key and
    one without a policy are not warned."""
    from cachestore.credentials import _warn_unsigned_with_policy

    _warn_unsigned_with_policy.cache_clear()
    caplog.set_level("WARNING", logger="cachestore.credentials")
    load_credentials("", str(policy_file), "auto", writes=False)
    load_credentials(str(tmp_path / "laptop.key"), str(policy_file), "auto", writes=True)
    load_credentials("", "", "auto", writes=True)
    assert caplog.records == []
    for _ in range(3):
        assert load_credentials("", str(policy_file), "auto", writes=True).scope == "unsigned"
    (record,) = caplog.records
    assert "without a writer_key_file" in record.getMessage() and "--tier-mode read-only" in record.getMessage()
    assert repr(str(policy_file)) in record.getMessage()


def test_tier_client_built_directly_loads_credentials(tmp_path: Path, ci: WriterKey) -> None:
    settings = tier_settings(tmp_path, writer_key_file=str(tmp_path / "ci.key"))
    client = TierClient(lambda: None, settings)  # type: ignore[arg-type, return-value]
    assert client.writer is not None and client.writer.key_id == ci.key_id


def test_a_reference_entry_a_trusted_writer_signed_is_rejected(ci: WriterKey) -> None:
    """An older build's dedupe reference is refused for what it is, whoever signed it."""
    payload = compress(body_of(make_entry(), binary=b"", ref=OTHER))
    digest = hashlib.sha256(payload).digest()
    flags = 0x02  # a writer's signature
    signature = ci.sign(signed_message(entry_module.SCHEMA_VERSION, flags, ci.key_id, KEY, digest))
    data = MAGIC + bytes((entry_module.SCHEMA_VERSION, flags)) + digest + ci.key_id + signature + payload
    with pytest.raises(entry_module.EntryRejected, match="reference to another key"):
        decode_entry(data, trusting(ci), cache_key=KEY)
    assert decode_entry(encode_entry(make_entry(), writer=ci, cache_key=KEY), trusting(ci), cache_key=KEY).signed


def test_signatures_verify_through_libsodium_and_a_malformed_one_is_a_reason(ci: WriterKey) -> None:
    """Keys and signatures are cryptography's (OpenSSL), verifies libsodium's: one RFC 8032, both ways. A
    signature of the wrong length, or a small-order public key, is a refusal with a reason, never an
    exception out of the check."""
    trust = trust_of(ci)
    message = b"an entry's message"
    signature = ci.sign(message)
    assert trust.check(ci.key_id, message, signature) is None
    for bad in (signature[:-1], signature + b"\0", b"", bytes(64)):
        assert "does not verify" in trust.check(ci.key_id, message, bad)
    flipped = bytes([signature[0] ^ 1]) + signature[1:]
    assert "does not verify" in trust.check(ci.key_id, message, flipped)
    # A policy listing a small-order key (the identity point, by mistake or planted): OpenSSL accepts the
    # signature R = identity, S = 0 under it for every message, a universal forgery; libsodium refuses it.
    identity = b"\x01" + bytes(31)
    weak = TrustPolicy([TrustedWriter("weak", b"\x01" * 16, Ed25519PublicKey.from_public_bytes(identity))])
    assert "does not verify" in weak.check(b"\x01" * 16, message, identity + bytes(32))


# -- a read of several entries (a pass's prefetch) -------------------------------------------------------------
KEYS = [hashlib.sha256(b"trust %d" % n).hexdigest() for n in range(100)]


def sealed(writer: WriterKey, keys: list[str]) -> dict[str, bytes]:
    """Entries stored by `writer` under `keys`, each signed."""
    return {key: encode_entry(make_entry(binary=key.encode()), writer=writer, cache_key=key) for key in keys}


def verdicts_one_by_one(entries: dict[str, bytes], policy: SignaturePolicy) -> dict[str, str]:
    """cache key -> "ok" or the reason decode_entry rejected the entry."""
    result = {}
    for key, data in entries.items():
        try:
            decode_entry(data, policy, cache_key=key)
            result[key] = "ok"
        except entry_module.EntryRejected as exc:
            result[key] = exc.reason
    return result


def verdicts_at_once(entries: dict[str, bytes], policy: SignaturePolicy) -> dict[str, str]:
    results = decode_entries(entries, policy)
    assert list(results) == list(entries)
    return {key: "ok" if isinstance(result, Entry) else result.reason for key, result in results.items()}


def scenario(case: str, ci: WriterKey, laptop: WriterKey) -> tuple[dict[str, bytes], list[str]]:
    """Six honest entries of ci's and, but for "honest", entries a trusted reader must refuse (their keys)."""
    entries = {**sealed(ci, KEYS[0:4]), **sealed(ci, KEYS[4:6])}
    section = len(MAGIC) + 2 + 32
    if case == "forged":  # the laptop's signature under ci's key id
        forged = sealed(laptop, KEYS[20:21])[KEYS[20]]
        entries[KEYS[20]] = forged[:section] + ci.key_id + forged[section + 16 :]
        return entries, [KEYS[20]]
    if case == "untrusted":
        entries.update(sealed(laptop, KEYS[30:33]))
        return entries, KEYS[30:33]
    if case == "transplanted":  # ci's honest entry of KEYS[0] copied under KEYS[40]
        entries[KEYS[40]] = entries[KEYS[0]]
        return entries, [KEYS[40]]
    if case == "corrupt":
        entries[KEYS[1]] = entries[KEYS[1]][:-3] + b"bad"  # the digest no longer matches
        return entries, [KEYS[1]]
    return entries, []


@pytest.mark.parametrize("case", ["honest", "forged", "untrusted", "transplanted", "corrupt"])
def test_a_reads_entries_checked_together_get_the_verdicts_and_verifies_of_one_by_one(
    ci: WriterKey, laptop: WriterKey, case: str
) -> None:
    """A prefetch's entries are accepted and rejected as lookups of each would be, for the same reasons, with
    one Ed25519 verify an entry signed by a trusted key id either way (none for an untrusted writer's, none for an
    entry whose digest is wrong)."""
    entries, refused = scenario(case, ci, laptop)
    one_by_one = trusting(ci)
    expected = verdicts_one_by_one(entries, one_by_one)
    at_once = trusting(ci)
    assert verdicts_at_once(entries, at_once) == expected
    verifies = {"honest": 6, "forged": 7, "untrusted": 6, "transplanted": 7, "corrupt": 5}[case]
    assert at_once.trust.verifies == one_by_one.trust.verifies == verifies
    assert [key for key, verdict in expected.items() if verdict != "ok"] == refused


def test_a_hundred_crafted_entries_of_an_untrusted_key_read_at_once_are_refused_before_any_decompression(
    ci: WriterKey, laptop: WriterKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    crafted: dict[str, bytes] = {}
    for first in range(0, 100, 10):
        crafted.update(sealed(laptop, KEYS[first : first + 10]))
    decompressed: list[bytes] = []
    inner = entry_module._decompress
    monkeypatch.setattr(entry_module, "_decompress", lambda *args: decompressed.append(args[0]) or inner(*args))
    policy = trusting(ci)
    results = verdicts_at_once(crafted, policy)
    assert len(results) == 100 and all("does not trust" in reason for reason in results.values())
    assert decompressed == [] and policy.trust.verifies == 0
