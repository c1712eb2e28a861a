"""The shared-directory store (`dir:PATH`): a blob store (cachestore.blob.contract) of a file per blob in a folder
that many processes and machines mount (NFS, FSx, a local disk), as AWS Neuron's compile cache and ccache's
file storage keep theirs. A blob's name is its path below PATH, its expiry the file's mtime, and its creation
time the file's ctime, which no writer sets. The tier on it is cachestore.blob.tier's.

Every file is written whole, and created exclusively where it must be new (cachestore.backends.files): a reader
sees a whole file or none, and of many processes creating one name, one does. Temp files a killed writer left
are never read, and are listed as expired once an hour old, for gc to delete. Whoever can write the folder can
plant anything in it: nothing here follows a link or blocks on a file, and what is not a regular file is
listed as planted.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachestore import api
from cachestore.backends import files
from cachestore.blob.contract import Blob, BlobStore
from cachestore.blob.tier import BlobTier
from cachestore.entry import TooLarge

if TYPE_CHECKING:
    from cachestore.settings import Settings

FOLDERS = ("entries", "leases", "variants", "batches")  # made when the tier is, so that its writability is checked
STALE_TEMP_SECONDS = 3600.0  # a temp file unchanged this long was left by a writer that died: listed as expired


class FolderStore(BlobStore):
    """Blobs as files under `path`."""

    def __init__(self, path: str | Path, *, create: bool = True, writable: bool = True) -> None:
        """`create`: a missing folder is made; otherwise it is an error naming it, but for a read-only client
        (`writable=False`), to which it holds nothing."""
        self.path = Path(path).expanduser()
        self.files = files.SharedFolder(self.path)
        self.description = f"dir:{self.path}"
        if self.path.exists() and not self.path.is_dir():
            raise api.TierUnavailable(f"dir tier {self.path} is a file, not a directory")
        if create and writable:
            with files.tier_errors():
                for folder in FOLDERS:
                    if (planted := self.files.hostile_folder(self.path / folder)) is not None:
                        raise api.TierUnavailable(f"dir tier {self.path}: {planted} is not a folder")
                    (self.path / folder).mkdir(parents=True, exist_ok=True)
                if not os.access(self.path / "entries", os.W_OK | os.X_OK):
                    raise api.TierUnavailable(f"dir tier {self.path} is not writable")
        elif writable and not self.path.is_dir():
            raise api.TierUnavailable(f"no dir tier at {self.path}")

    def __repr__(self) -> str:
        return f"FolderStore({str(self.path)!r})"

    def _path(self, name: str) -> Path:
        parts = name.split("/")
        if any(part in ("", ".", "..") or part.startswith(".") for part in parts):
            raise api.TierError(f"{self.description}: {name!r} names no blob")  # the tier makes no such name
        return self.path.joinpath(*parts)

    def get(self, names: Sequence[str], limit: int) -> dict[str, tuple[Blob, bytes | TooLarge]]:
        found = {}
        for name in names:
            if (read := self.files.read_bounded(self._path(name), limit)) is not None:
                why = read.data.reason if read.planted and isinstance(read.data, files.Unreadable) else None
                blob = Blob(name, len(read.data), read.mtime, read.ctime, planted=why)
                found[name] = (blob, read.data)
        return found

    def put(self, items: Sequence[tuple[str, bytes, float]]) -> None:
        for name, data, expires in items:
            self.files.write_whole(self._path(name), data, _mtime(expires))

    def create(self, name: str, data: bytes, expires: float) -> bool:
        return self.files.write_whole(self._path(name), data, _mtime(expires), exclusive=True)

    def delete(self, names: Sequence[str], *, expired_by: float | None = None) -> None:
        """Deleted among any number of processes at once by renaming first (files.take), so that a file written
        again after `expired_by` stays; a folder left empty below the layout's own is removed."""
        for name in names:
            path = self.path.joinpath(*name.split("/"))  # a temp file's name too, which _path refuses
            if expired_by is None or path.name.startswith("."):
                self.files.unlink(path)
            else:
                self.files.take(path, lambda info: files.removable(info.st_mode) or info.st_mtime <= expired_by)
            if len(path.relative_to(self.path).parts) > 2:
                self.files.remove_if_empty(path.parent)

    def list(self, prefix: str) -> Iterator[Blob]:
        folder = prefix.rpartition("/")[0]
        now = time.time()
        for path, info in self.files.walk(self.path / folder if folder else self.path):
            name = path.relative_to(self.path).as_posix()
            if not name.startswith(prefix) or "/" not in name:  # (the layout's own folders, empty in a new tier)
                continue
            if path.name.startswith("."):  # a temp file: listed, as expired, once its writer must be dead
                if info.st_ctime < now - STALE_TEMP_SECONDS:
                    yield Blob(name, info.st_size, -math.inf, info.st_ctime)
                continue
            yield Blob(name, info.st_size, info.st_mtime, info.st_ctime, planted=files.planted(info.st_mode))

    def touch(self, items: Sequence[tuple[str, float]]) -> None:
        for name, expires in items:
            self.files.set_expiry(self._path(name), expires)  # gone, planted or another user's: left as it is

    def close(self) -> None:
        pass


def _mtime(expires: float) -> float | None:
    """The mtime that keeps an expiry; None (the time of writing) for NEVER, which no mtime can hold."""
    return expires if math.isfinite(expires) else None


def folder_tier(path: str | Path, *, create: bool = True, writable: bool = True, **options: Any) -> BlobTier:
    """The tier in the folder at `path`; `options` are BlobTier's."""
    return BlobTier(FolderStore(path, create=create, writable=writable), create=create, writable=writable, **options)


def open_store(settings: Settings, path: str, *, reading: bool, partition: str | None, writable: bool) -> BlobTier:
    """The shared folder `dir:PATH` names (cachestore.stores); reading never creates it."""
    size, ttl = settings.max_entry_bytes, settings.lease_ttl
    create = not reading and writable
    return folder_tier(path, create=create, writable=writable, partition=partition, max_entry_bytes=size, lease_ttl=ttl)
