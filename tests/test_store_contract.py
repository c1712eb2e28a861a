"""The store contract (cachestore.testing.contract), unchanged, on every store: the local SQLite tier, the shared
directory, S3 (moto's server), Redis (REDIS_URL) and a Redis Cluster; each class gives only how to open its store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers_graphs import delete_namespace, unique_namespace

from cachestore.backends.directory import FolderStore, folder_tier
from cachestore.backends.redis import RedisBackend, connect
from cachestore.backends.s3 import ObjectStore
from cachestore.backends.sqlite import SqliteBackend
from cachestore.blob.contract import BlobStore
from cachestore.blob.tier import BlobTier
from cachestore.keys import KeySpace
from cachestore.testing.contract import StoreContract


def opener(make: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """An `open_store` calling `make(**options)`, closing everything it opened afterwards."""
    opened: list[Any] = []

    def open_store(**options: Any) -> Any:
        opened.append(make(**options))
        return opened[-1]

    yield open_store
    for store in opened:
        store.close()


class TestLocalStore(StoreContract):
    @pytest.fixture
    def open_store(self, tmp_path: Path) -> Iterator[Callable[..., Any]]:
        yield from opener(lambda **options: SqliteBackend(tmp_path / "tier.sqlite", timeout=5.0, **options))

    @pytest.fixture
    def open_read_only(self, tmp_path: Path) -> Iterator[Callable[..., Any]]:
        yield from opener(lambda **options: SqliteBackend(tmp_path / "tier.sqlite", writable=False, **options))


class TestDirectoryStore(StoreContract):
    @pytest.fixture
    def open_store(self, tmp_path: Path) -> Iterator[Callable[..., Any]]:
        yield from opener(lambda **options: folder_tier(tmp_path / "shared", **options))

    @pytest.fixture
    def open_read_only(self, tmp_path: Path) -> Iterator[Callable[..., Any]]:
        yield from opener(lambda **options: folder_tier(tmp_path / "shared", writable=False, **options))


class TestS3Store(StoreContract):
    @pytest.fixture
    def open_store(self, s3_tier: str) -> Iterator[Callable[..., Any]]:
        bucket = s3_tier.removeprefix("s3://").partition("/")[0]
        store = partial(ObjectStore, bucket, "contract", op_timeout=10.0, connect_timeout=2.0)
        yield from opener(lambda **options: BlobTier(store(), **options))

    @pytest.fixture
    def open_read_only(self, s3_tier: str) -> Iterator[Callable[..., Any]]:
        bucket = s3_tier.removeprefix("s3://").partition("/")[0]
        store = partial(ObjectStore, bucket, "contract", op_timeout=10.0, connect_timeout=2.0)
        yield from opener(lambda **options: BlobTier(store(), writable=False, **options))


@pytest.mark.redis
class TestRedisStore(StoreContract):
    @pytest.fixture
    def open_store(self, redis_url: str) -> Iterator[Callable[..., Any]]:
        namespace = unique_namespace()
        client = redis.Redis.from_url(redis_url, socket_timeout=5)
        yield from opener(lambda **options: RedisBackend(client, KeySpace(namespace), "contract redis", **options))
        delete_namespace(client, namespace)
        client.close()


@pytest.mark.redis
class TestRedisClusterStore(StoreContract):
    @pytest.fixture
    def open_store(self, redis_cluster: str) -> Iterator[Callable[..., Any]]:
        namespace = unique_namespace()
        client = connect(redis_cluster, connect_timeout=2.0, op_timeout=5.0)
        yield from opener(lambda **options: RedisBackend(client, KeySpace(namespace), "contract cluster", **options))
        delete_namespace(client, namespace)
        client.close()


def test_the_blob_contract_has_at_most_eight_methods_and_both_blob_stores_keep_it() -> None:
    methods = [name for name, value in vars(BlobStore).items() if callable(value) and not name.startswith("_")]
    assert sorted(methods) == ["close", "create", "delete", "get", "list", "put", "touch"]
    assert BlobStore in FolderStore.__mro__ and BlobStore in ObjectStore.__mro__  # so mypy checks them against it
