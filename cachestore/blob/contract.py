"""The blob contract: the seven methods an object store gives for the generic tier (cachestore.blob.tier) to
keep entries, leases, the variant index and fleet metrics in it. A blob is named by a path of "/"-separated
parts, holds bytes and an expiry, and is only ever written whole: a reader sees all of a blob or none of it.

Every store is shared with others who can write to it, so a blob is never trusted: its bytes are bounded on
read, and a store that can hold something that is no blob of its own (a link or a FIFO in a shared folder)
hands it over as `planted`, for the tier to count and for gc to delete.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Protocol

import msgspec

from cachestore.entry import TooLarge

# The expiry of a blob that does not expire. A store that keeps expiries in a file's mtime cannot keep this one,
# and lists such a blob as expiring when it was written: the tier gives NEVER only to blobs whose expiry it
# never reads (its marker, metrics batches).
NEVER = math.inf


class Blob(msgspec.Struct, frozen=True):
    """A blob as listed or read: its name, stored size, expiry (unix seconds, NEVER for none), when the store
    made it (by the store's clock, which no writer sets), and why it is not a blob at all (None when it is)."""

    name: str
    size: int
    expires: float
    created: float
    planted: str | None = None


class BlobStore(Protocol):
    """What a store of blobs does; every method raises cachestore.api.TierUnavailable or TierTimeout when the
    store cannot answer, and nothing else for a store's own failure."""

    description: str  # how errors and listings name the store, without secrets

    def get(self, names: Sequence[str], limit: int) -> dict[str, tuple[Blob, bytes | TooLarge]]:
        """The blobs of these names that exist, expired or not: the bytes of one of at most `limit` bytes, a
        TooLarge (never downloaded) for a larger one, an Unreadable for a planted one."""
        ...

    def put(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        """Write each (name, bytes, expiry) whole, replacing what had the name."""

    def create(self, name: str, data: bytes, expires: float) -> bool:
        """Write the blob only if no blob has its name; True when this call made it (of many callers, one)."""
        ...

    def delete(self, names: Sequence[str], *, expired_by: float | None = None) -> None:
        """Delete these blobs where they exist; with `expired_by`, only those still expiring by then (one
        written again meanwhile stays). A planted one is deleted itself, never what it points to."""

    def list(self, prefix: str) -> Iterator[Blob]:
        """Every blob whose name starts with `prefix` (a folder: "entries/"), in name order; no bytes read. A blob
        that exists throughout the call is listed whatever others write or delete meanwhile: a lease's
        contenders rely on it (cachestore.blob.leases)."""
        ...

    def touch(self, items: Sequence[tuple[str, float]]) -> None:
        """Set each (name, expiry) blob's expiry, where the blob exists and is this store's own."""

    def close(self) -> None: ...
