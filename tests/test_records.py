"""What the records promised as dataclasses and keep as msgspec Structs: no secret in a repr, and an entry
equal to another by what it says, not by how a reader came by it."""

from __future__ import annotations

import msgspec

from cachestore.entry import Entry
from cachestore.settings import Settings
from cachestore.trust import WriterKey


def test_settings_never_print_a_secret() -> None:
    settings = Settings(tier="off", hmac_key=b"hmac-secret-bytes", redis_password="redis-secret")
    shown = repr(settings)
    assert "hmac-secret" not in shown and "redis-secret" not in shown
    assert "hmac_key=<secret>" in shown and "tier='off'" in shown
    assert "redis-secret" not in repr(settings.replace(namespace="team"))


def test_a_writer_key_prints_its_id_not_its_private_key() -> None:
    key = WriterKey.generate()
    assert repr(key) == f"WriterKey(key_id={key.key_id.hex()})"


def test_entries_compare_by_what_they_say() -> None:
    entry = Entry(b"bin", ["x"], ["out"], "bir", "bir-1", {"kernel_name": "k"}, created=1.0)
    read = msgspec.structs.replace(entry, signed=True, writer="ab" * 16, stored=b"stored bytes")
    assert read == entry and "stored bytes" not in repr(read)
    assert msgspec.structs.replace(entry, binary=b"other") != entry
    assert entry.digest == Entry(b"bin", [], [], "bir", "bir-1", {}).digest  # made from the binary when not given
