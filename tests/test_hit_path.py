"""The remote hit's path (issue 16): one GETRANGE a hit on Redis, its TTL refreshed afterwards by the flusher,
batched, and every check of the entry kept (bounded read, digest over the stored bytes, signatures)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers_graphs import local_or_fake_backend

from cachestore.backends.redis import FIRST_READ_BYTES
from cachestore.entry import Entry, encode_entry
from cachestore.settings import Settings
from cachestore.stores import tier_client

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


def client_of(backend: Any, **changes: Any) -> Any:
    settings = Settings(**{"tier": "redis://127.0.0.1:1/0", "entry_ttl": BASE_TTL, "flush_interval": 0.01, **changes})
    return tier_client(lambda: backend, settings, "redis")


def entry(key: str, size: int = 2000) -> Entry:
    return Entry(os.urandom(size), ["x"], ["out"], "bir", "bir-1", {"kernel_name": "k", "key": key})


def stored(backend: Any, key: str, size: int = 2000) -> Entry:
    writer = client_of(backend)
    made = entry(key, size)
    writer.publish(key, made)
    writer.close(timeout=10)
    return made


def test_a_hit_is_one_getrange_and_its_ttl_is_refreshed_in_the_background(backend: Any) -> None:
    """One round trip of one command a hit (in a pipeline of one: one key is a batch of one)."""
    made = stored(backend, "k")
    redis_key = backend._entry("k")
    backend.client.expire(redis_key, 100)
    reader = client_of(backend, flush_interval=30)  # the flusher sends when flushed (below), not between the reads
    commands = Commands(backend.client)
    for _ in range(5):
        found = reader.lookup("k")
        assert found is not None and found.binary == made.binary
    assert commands.alone == [] and commands.piped == [["GETRANGE"]] * 5  # no EXPIRE on the hit
    assert backend.client.ttl(redis_key) <= 100
    commands.clear()
    assert reader.flush(timeout=10)
    # Five reads of one key: one EXPIRE, sent by the flusher.
    assert [command for batch in commands.piped for command in batch] == ["EXPIRE"]
    assert BASE_TTL - 60 < backend.client.ttl(redis_key) <= BASE_TTL
    reader.close(timeout=10)


def test_a_read_only_hit_sends_one_getrange_and_refreshes_nothing(backend: Any) -> None:
    stored(backend, "k")
    backend.client.expire(backend._entry("k"), 100)
    reader = client_of(backend, tier_mode="read-only")
    commands = Commands(backend.client)
    assert reader.lookup("k") is not None
    reader.close(timeout=10)
    assert commands.alone == [] and commands.piped == [["GETRANGE"]]
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
    assert commands.piped == [["GETRANGE"]] and backend.client.ttl(redis_key) <= 100  # the read, no EXPIRE
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
    assert commands.alone == [] and commands.piped == [["GETRANGE"], ["STRLEN"]]


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
        fields = {**msgspec.structs.asdict(good), **changes}
        hostile = Entry(**{name: fields[name] for name in ("binary", "input_names", "output_names", "format",
                                                           "version_identifier", "key_components", "producer_host",
                                                           "producer_worker", "created", "compile_seconds",
                                                           "digest", "toolchain")})  # fmt: skip
        with pytest.raises(EntryRejected, match="wrong type"):
            decode_entry(encode_entry(hostile), policy)
        with pytest.raises(EntryRejected, match="wrong type"):  # and again: a refused shape is not remembered
            decode_entry(encode_entry(hostile), policy)


# -- the hit's bookkeeping: counters, writers, the flusher that refreshes TTLs ----------------------------------
def test_lookups_count_hits_misses_rejections_and_writers_as_find_many_does(backend: Any) -> None:
    """lookup of one key is find_many of it: what it counts is what find_many counts for the same reads."""
    from cachestore.trust import WriterKey

    writer = WriterKey.generate()
    backend.client.set(backend._entry("signed"), encode_entry(entry("signed"), None, writer, "signed"))
    stored(backend, "plain")
    backend.client.set(backend._entry("bad"), b"NKC\x04\x00" + bytes(40))  # a digest that does not match
    one, many = client_of(backend), client_of(backend)
    for key in ("signed", "plain", "missing", "bad", "signed"):
        assert (one.lookup(key) is None) == (key in ("missing", "bad"))
        assert (key in many.find_many([key])[0]) == (key not in ("missing", "bad"))
    for client in (one, many):
        counts = client.counts()
        assert counts["entries_found"] == 3 and counts["tier_rejected"] == 1
        assert client._writer_counts == {f"writer_served:{writer.key_id.hex()}": 2}
        client.close(timeout=10)


def test_a_hit_does_not_ask_the_running_flusher_whether_it_is_alive(backend: Any) -> None:
    """A hit queues its TTL refresh for the flusher; once the flusher runs, the hit checks a flag of its own
    instead of Thread.is_alive (a lock each call), and the refresh is still sent."""
    stored(backend, "k")
    backend.client.expire(backend._entry("k"), 100)
    reader = client_of(backend)
    assert reader.lookup("k") is not None  # starts the flusher
    asked = []
    flusher = reader._outbox.thread
    original = flusher.is_alive
    flusher.is_alive = lambda: asked.append(1) or original()  # type: ignore[method-assign]
    for _ in range(5):
        assert reader.lookup("k") is not None
    assert asked == [] and reader.flush(timeout=10)
    assert BASE_TTL - 60 < backend.client.ttl(backend._entry("k")) <= BASE_TTL
    reader.close(timeout=10)


def test_a_hit_in_a_forked_child_starts_a_flusher_of_the_childs_own(backend: Any) -> None:
    """A worker pool forks from a parent whose flusher runs: the child inherits the flusher's flag but not its
    thread, so a hit in the child starts the child's own flusher and its TTL refresh is sent."""
    stored(backend, "k")
    reader = client_of(backend)
    assert reader.lookup("k") is not None and reader.flush(timeout=10)  # the parent's flusher runs
    pid = os.fork()
    if pid == 0:
        try:
            ok = reader.lookup("k") is not None and reader.flush(timeout=3)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    reader.close(timeout=10)


def test_a_payload_with_bytes_after_its_frame_is_refused_even_with_its_digest_right() -> None:
    """The frame is decompressed with extra data refused (arguments passed by position, not keyword): a payload
    whose digest covers a second frame or trailing bytes after the first is no entry."""
    from helpers_entries import body_of, compress
    from helpers_entries import stored as planted

    from cachestore.entry import EntryRejected, SignaturePolicy, decode_entry

    made = entry("k")
    body = body_of(made)
    assert decode_entry(planted(body), SignaturePolicy(None, False)).binary == made.binary
    for payload in (compress(body) + b"\x00", compress(body) + compress(body)):
        with pytest.raises(EntryRejected, match="cannot be decompressed"):
            decode_entry(planted(payload=payload), SignaturePolicy(None, False))


def test_entries_decoded_on_many_threads_at_once_are_each_checked_against_their_own_digest() -> None:
    """The digest is a copy of one shared empty hash (cheaper than a new one): copies made on threads at once hash
    each entry alone, and an entry whose payload was changed is still refused."""
    from concurrent.futures import ThreadPoolExecutor

    from cachestore.entry import EntryRejected, SignaturePolicy, decode_entry

    policy = SignaturePolicy(None, False)
    made = [entry(str(n), size=100 + 3000 * (n % 5)) for n in range(40)]  # some over hashlib's 2 KiB GIL release
    good = [encode_entry(item) for item in made]
    bad = [data[:-1] + bytes([data[-1] ^ 1]) for data in good]

    def decode(data: bytes) -> bytes | str:
        try:
            return decode_entry(data, policy).binary
        except EntryRejected as exc:
            return exc.reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(decode, [*good, *bad] * 5))
    assert results[: len(good)] == [item.binary for item in made]
    assert set(results[len(good) : 2 * len(good)]) == {"stored bytes do not match their digest"}
