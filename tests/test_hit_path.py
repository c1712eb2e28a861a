"""The remote hit's path (issue 16): one GETRANGE a hit on Redis, its TTL refreshed afterwards by the flusher,
batched, and every check of the entry kept (bounded read, digest over the stored bytes, signatures)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from helpers_graphs import local_or_fake_backend

from cachestore.backends.redis import FIRST_READ_BYTES
from cachestore.client import TierClient
from cachestore.entry import Entry, encode_entry
from cachestore.settings import Settings

BASE_TTL = 3600


class Commands:
    """The commands a redis-py client sends, by name, alone or in pipelines."""

    def __init__(self, client: Any) -> None:
        self.alone: list[str] = []
        self.piped: list[list[str]] = []
        execute, pipeline = client.execute_command, client.pipeline

        def alone(*args: Any, **options: Any) -> Any:
            self.alone.append(str(args[0]).upper())
            return execute(*args, **options)

        def piped(*args: Any, **options: Any) -> Any:
            pipe = pipeline(*args, **options)
            run = pipe.execute

            def execute_pipe(*a: Any, **o: Any) -> Any:
                self.piped.append([str(command[0][0]).upper() for command in pipe.command_stack])
                return run(*a, **o)

            pipe.execute = execute_pipe
            return pipe

        client.execute_command, client.pipeline = alone, piped

    def clear(self) -> None:
        self.alone.clear()
        self.piped.clear()


@pytest.fixture
def backend(tmp_path: Path) -> Any:
    backend = local_or_fake_backend("fakeredis", tmp_path)
    yield backend
    backend.close()


def client_of(backend: Any, **changes: Any) -> TierClient:
    settings = Settings(**{"tier": "redis://127.0.0.1:1/0", "entry_ttl": BASE_TTL, "flush_interval": 0.01, **changes})
    return TierClient(lambda: backend, settings, "redis")


def entry(key: str, size: int = 2000) -> Entry:
    return Entry(os.urandom(size), ["x"], ["out"], "bir", "bir-1", {"kernel_name": "k", "key": key})


def stored(backend: Any, key: str, size: int = 2000) -> Entry:
    writer = client_of(backend)
    made = entry(key, size)
    writer.publish(key, made)
    writer.close(timeout=10)
    return made


def test_a_hit_is_one_getrange_and_its_ttl_is_refreshed_in_the_background(backend: Any) -> None:
    made = stored(backend, "k")
    redis_key = backend._entry("k")
    backend.client.expire(redis_key, 100)
    reader = client_of(backend)
    commands = Commands(backend.client)
    for _ in range(5):
        found = reader.lookup("k")
        assert found is not None and found.binary == made.binary
    assert commands.alone == ["GETRANGE"] * 5 and commands.piped == []  # no EXPIRE, no pipeline on the hit
    assert backend.client.ttl(redis_key) <= 100
    assert reader.flush(timeout=10)
    # Five reads of one key: one EXPIRE, sent by the flusher.
    assert [command for batch in commands.piped for command in batch] == ["EXPIRE"]
    assert BASE_TTL - 60 < backend.client.ttl(redis_key) <= BASE_TTL
    reader.close(timeout=10)


def test_a_read_only_hit_sends_getrange_alone_and_refreshes_nothing(backend: Any) -> None:
    stored(backend, "k")
    backend.client.expire(backend._entry("k"), 100)
    reader = client_of(backend, tier_mode="read-only")
    commands = Commands(backend.client)
    assert reader.lookup("k") is not None
    reader.close(timeout=10)
    assert commands.alone == ["GETRANGE"] and commands.piped == []
    assert backend.client.ttl(backend._entry("k")) <= 100


def test_a_rejected_entry_gets_no_ttl_refresh(backend: Any) -> None:
    made = stored(backend, "k")
    redis_key = backend._entry("k")
    data = backend.client.get(redis_key)
    backend.client.set(redis_key, data[:-1] + bytes([data[-1] ^ 1]), ex=100)  # one bit of the payload flipped
    reader = client_of(backend)
    commands = Commands(backend.client)
    assert reader.lookup("k") is None and reader.counts()["tier_rejected"] == 1
    reader.close(timeout=10)
    assert commands.piped == [] and backend.client.ttl(redis_key) <= 100
    assert made.binary  # (the entry was a real one before the flip)


def test_an_empty_value_is_a_miss(backend: Any) -> None:
    backend.client.set(backend._entry("k"), b"")
    reader = client_of(backend)
    assert reader.find_many(["k"]) == ({}, set())
    reader.close(timeout=10)


def test_a_long_entry_is_read_whole_and_one_over_the_limit_not_at_all(backend: Any) -> None:
    made = stored(backend, "long", size=3 * FIRST_READ_BYTES)  # random bytes: it stays longer than a head
    assert len(backend.client.get(backend._entry("long"))) > FIRST_READ_BYTES
    reader = client_of(backend)
    found = reader.lookup("long")
    assert found is not None and found.binary == made.binary
    reader.close(timeout=10)

    backend.max_entry_bytes = FIRST_READ_BYTES  # as RedisBackend.open sets it from the settings
    small = client_of(backend, max_entry_bytes=FIRST_READ_BYTES)
    commands = Commands(backend.client)
    assert small.lookup("long") is None and small.counts()["tier_rejected"] == 1
    small.close(timeout=10)
    # The head, then the size (STRLEN); the value itself is never downloaded.
    assert commands.alone == ["GETRANGE"] and commands.piped == [["STRLEN"]]


def test_a_hit_still_checks_the_hmac(backend: Any) -> None:
    key = b"k" * 32
    redis_key = backend._entry("k")
    backend.client.set(redis_key, encode_entry(entry("k"), b"another key" * 3, None, "k"))
    reader = client_of(backend, hmac_key=key)
    assert reader.lookup("k") is None and reader.counts()["tier_rejected"] == 1
    reader.close(timeout=10)


def test_a_body_shape_checked_once_still_refuses_a_bool_or_a_wrong_type_later() -> None:
    """Field types are checked once per shape (the exact types of the fields): a body of a new shape is checked
    in full, whatever bodies came before it."""
    from cachestore.entry import EntryRejected, SignaturePolicy, decode_entry

    policy = SignaturePolicy(None, False)
    good = Entry(b"bin", ["x"], ["out"], "bir", "bir-1", {}, created=1, compile_seconds=2)  # ints: a shape
    assert decode_entry(encode_entry(good), policy).created == 1
    assert decode_entry(encode_entry(good), policy).created == 1  # (now known)
    for changes in ({"created": True}, {"compile_seconds": False}, {"format": 7}, {"producer_host": None}):
        fields = {**good.__dict__, **changes}
        hostile = Entry(**{name: fields[name] for name in ("binary", "input_names", "output_names", "format",
                                                           "version_identifier", "key_components", "producer_host",
                                                           "producer_worker", "created", "compile_seconds",
                                                           "digest", "ref", "toolchain")})  # fmt: skip
        with pytest.raises(EntryRejected, match="wrong type"):
            decode_entry(encode_entry(hostile), policy)
        with pytest.raises(EntryRejected, match="wrong type"):  # and again: a refused shape is not remembered
            decode_entry(encode_entry(hostile), policy)
