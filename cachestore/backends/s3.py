"""The S3 store (`s3://BUCKET/PREFIX`): a blob store (cachestore.blob.contract) of one object per blob under
PREFIX, through obstore (Rust's object_store), for S3 and what speaks its protocol (MinIO, Ceph). The tier on it
is cachestore.blob.tier's. A blob's expiry is its object's user metadata `nkicache-expires`, and its creation
time the object's Last-Modified, which the server sets.

Credentials, region and endpoint come the usual way: the AWS environment variables (AWS_ENDPOINT_URL names a
MinIO or Ceph endpoint), instance and web-identity roles, and with AWS_PROFILE a profile through boto3 (which
must then be installed). Plain http is allowed to a loopback endpoint only. Leases are conditional creates
(`If-None-Match: *`); every error of the store is a TierUnavailable (TierTimeout for a timeout), so a missing
bucket, refused credentials, throttling or a timeout is a counted miss, never a failed compile.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from ipaddress import ip_address
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, PreconditionError
from obstore.store import S3Store

from cachestore import api
from cachestore.blob.contract import Blob, BlobStore
from cachestore.blob.tier import BlobTier
from cachestore.entry import TooLarge

if TYPE_CHECKING:
    from obstore import GetResult

    from cachestore.settings import Settings

EXPIRES = "nkicache-expires"  # the user metadata holding a blob's expiry
PARALLEL = 16  # requests in flight at once for a call on many blobs
MAX_TOUCH_BYTES = 64 << 20  # a touch rewrites the object (S3 has no metadata-only update): none larger
T = TypeVar("T")


def loopback(endpoint: str) -> bool:
    host = urlsplit(endpoint).hostname or ""
    try:
        return host == "localhost" or ip_address(host).is_loopback
    except ValueError:
        return False


class ObjectStore(BlobStore):
    """Blobs as objects of `bucket` under `prefix`."""

    def __init__(self, bucket: str, prefix: str, *, op_timeout: float, connect_timeout: float) -> None:
        self.description = f"s3://{bucket}/{prefix}".rstrip("/")
        endpoint = os.environ.get("AWS_ENDPOINT_URL", "")
        if endpoint.startswith("http://") and not loopback(endpoint):
            raise api.TierUnavailable(f"{self.description}: plain http to {endpoint} (only to a loopback endpoint)")
        options: dict[str, Any] = {}
        if profile := os.environ.get("AWS_PROFILE"):
            options["credential_provider"] = _profile_credentials(profile)
        self.store = S3Store(
            bucket,
            prefix=prefix or None,
            client_options={
                "timeout": timedelta(seconds=op_timeout),
                "connect_timeout": timedelta(seconds=connect_timeout),
                "allow_http": endpoint.startswith("http://"),
            },
            retry_config={"max_retries": 1, "retry_timeout": timedelta(seconds=op_timeout), "backoff": {}},
            **options,
        )
        self._pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="nkicache-s3")

    def __repr__(self) -> str:
        return f"ObjectStore({self.description!r})"

    def _each(self, call: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """`call` on every item, PARALLEL at a time (obstore's calls let go of the GIL), one alone in this thread;
        errors translated."""
        with s3_errors(self.description):
            return [call(items[0])] if len(items) == 1 else list(self._pool.map(call, items))

    def _blob(self, name: str, result: GetResult) -> Blob:
        meta = result.meta
        return Blob(name, meta["size"], _expiry(result.attributes.get(EXPIRES)), meta["last_modified"].timestamp())

    def _get(self, name: str, limit: int) -> tuple[Blob, bytes | TooLarge] | None:
        try:
            result = obstore.get(self.store, name)
        except FileNotFoundError:
            return None
        blob = self._blob(name, result)
        if blob.size > limit:
            return blob, TooLarge(blob.size, limit)  # the body is never read
        data = bytes(result.bytes())
        return blob, (TooLarge(len(data), limit) if len(data) > limit else data)

    def get(self, names: Sequence[str], limit: int) -> dict[str, tuple[Blob, bytes | TooLarge]]:
        reads = self._each(lambda name: self._get(name, limit), names)
        return {name: read for name, read in zip(names, reads, strict=True) if read is not None}

    def put(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        self._each(lambda item: obstore.put(self.store, item[0], item[1], attributes=_meta(item[2])), items)

    def create(self, name: str, data: bytes, expires: float) -> bool:
        with s3_errors(self.description):
            try:
                obstore.put(self.store, name, data, attributes=_meta(expires), mode="create")
            except (AlreadyExistsError, PreconditionError):
                return False
        return True

    def delete(self, names: Sequence[str], *, expired_by: float | None = None) -> None:
        if expired_by is not None:
            heads = self._each(self._head, names)
            names = [blob.name for blob in heads if blob is not None and blob.expires <= expired_by]
        with s3_errors(self.description):
            for start in range(0, len(names), 1000):  # at most 1,000 keys a DeleteObjects request
                obstore.delete(self.store, list(names[start : start + 1000]))

    def _head(self, name: str) -> Blob | None:
        try:
            return self._blob(name, obstore.get(self.store, name, options={"head": True}))
        except FileNotFoundError:
            return None

    def list(self, prefix: str) -> Iterator[Blob]:
        """S3 lists no user metadata, so each listed object's expiry is asked for with a HEAD."""
        with s3_errors(self.description):
            for page in obstore.list(self.store, prefix=prefix or None):
                heads = self._each(self._head, sorted(meta["path"] for meta in page))
                yield from (blob for blob in heads if blob is not None)

    def touch(self, items: Sequence[tuple[str, float]]) -> None:
        def rewrite(item: tuple[str, float]) -> None:
            if (read := self._get(item[0], MAX_TOUCH_BYTES)) is not None and isinstance(read[1], bytes):
                obstore.put(self.store, item[0], read[1], attributes=_meta(item[1]))

        self._each(rewrite, items)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@contextlib.contextmanager
def s3_errors(description: str) -> Iterator[None]:
    """Every obstore error as the tier's, naming the store and S3's error code (a missing object is caught where
    it means none, before this); a timeout (as obstore's debug text names it) as TierTimeout."""
    try:
        yield
    except api.TierError:
        raise
    except (BaseError, OSError) as error:
        text = str(error) or type(error).__name__
        line = text.splitlines()[0].partition("<?xml")[0].rstrip(": ")
        if code := re.search(r"<Code>(\w+)</Code>", text):
            line += f": {code.group(1)}"
        kind = api.TierTimeout if "kind: Timeout" in text or "TimedOut" in text else api.TierUnavailable
        raise kind(f"{description}: {line}") from error


def _meta(expires: float) -> dict[str, str]:
    return {EXPIRES: repr(expires)}


def _expiry(text: str | None) -> float:
    """A blob's expiry from its metadata; a foreign object's (none, or no number) has expired."""
    try:
        expires = float(text) if text is not None else 0.0
    except ValueError:
        return 0.0
    return 0.0 if math.isnan(expires) else expires


def _profile_credentials(profile: str) -> Any:
    try:
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        raise api.TierUnavailable(f"AWS_PROFILE={profile} needs boto3 to read the profile: pip install boto3") from None
    return Boto3CredentialProvider(boto3.Session(profile_name=profile))


def open_store(settings: Settings, url: str, *, reading: bool, partition: str | None, writable: bool) -> BlobTier:
    """The bucket and prefix `s3://BUCKET/PREFIX` names (cachestore.stores); reading never writes its marker."""
    parts = urlsplit(url)
    op_timeout = max(settings.op_timeout, api.READ_TIMEOUT) if reading else settings.op_timeout
    connect_timeout = max(settings.connect_timeout, api.READ_CONNECT_TIMEOUT) if reading else settings.connect_timeout
    store = ObjectStore(parts.netloc, parts.path.strip("/"), op_timeout=op_timeout, connect_timeout=connect_timeout)
    size, ttl = settings.max_entry_bytes, settings.lease_ttl
    create = not reading and writable
    return BlobTier(store, create=create, writable=writable, partition=partition, max_entry_bytes=size, lease_ttl=ttl)
