"""Files that many processes and machines share (a local disk, NFS, FSx): whole-file writes, exclusive creation,
bounded reads and removal by exactly one of many. What the shared-directory tier (cachestore.backends.directory)
is built of, and nothing else of it.

A file is written to a temp file in its own folder (`.tmp-*`), fsynced, then renamed over its name
(`os.replace`), or linked to it where it must be new (`os.link` fails when the name exists, on NFS as on a local
disk, and the file it makes appears whole). So a reader sees a whole file or none (NFS close-to-open). A file's
mtime may be set to a time to come: the stores here keep an expiry in it. Names starting with "." are temp files,
never listed unless asked for. An OSError other than a missing file is a TierUnavailable naming the file.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from cachestore.api import TierUnavailable
from cachestore.entry import TooLarge

NOT_FOUND = (FileNotFoundError, IsADirectoryError, NotADirectoryError)  # no file there (a folder is none)


@contextlib.contextmanager
def tier_errors() -> Iterator[None]:
    """An OSError as TierUnavailable naming its file; a missing file (NOT_FOUND) is left to the caller."""
    try:
        yield
    except NOT_FOUND:
        raise
    except OSError as exc:
        raise TierUnavailable(f"shared directory: {exc.strerror or exc}: {exc.filename}") from None


def write_whole(path: Path, data: bytes, expires: float | None = None, *, exclusive: bool = False) -> bool:
    """Write `path` whole, its mtime `expires` (None: now); `exclusive`: only if no file has its name (False
    when one has). Its folder is made if missing."""
    with tier_errors():
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            if expires is not None:
                os.utime(temp, (time.time(), expires))
            if not exclusive:
                os.replace(temp, path)
                return True
            with contextlib.suppress(FileExistsError):
                os.link(temp, path)
                return True
            return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)


def read_bounded(path: Path, now: float, limit: int) -> tuple[bytes | TooLarge, float] | None:
    """(data, mtime) of the file at `path` if its mtime is after `now`; a TooLarge, unread, for one over `limit`
    bytes (stat before read); None for no file or an expired one."""
    try:
        with tier_errors(), open(path, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_mtime <= now:
                return None
            data = file.read(limit + 1) if info.st_size <= limit else b""  # bounded if it grew since the stat
    except NOT_FOUND:
        return None
    size = max(len(data), info.st_size)
    return (TooLarge(size, limit) if size > limit else data), info.st_mtime


def read_small(path: Path, limit: int = 1 << 20) -> bytes | None:
    """The bytes of a small file (a marker, a lease, a record), whatever its mtime; None for none or a larger one."""
    found = read_bounded(path, float("-inf"), limit)
    return found[0] if found and isinstance(found[0], bytes) else None


def names(folder: Path, hidden: bool = False) -> list[str]:
    """The names in `folder`, sorted (temp files only when `hidden`); none when it is missing."""
    try:
        with tier_errors():
            return sorted(name for name in os.listdir(folder) if hidden or not name.startswith("."))
    except NOT_FOUND:
        return []


def stat_of(path: Path) -> os.stat_result | None:
    try:
        with tier_errors():
            return os.stat(path)
    except NOT_FOUND:
        return None


def take(path: Path, still: Callable[[Path], bool]) -> bool:
    """Delete the file at `path` if it passes `still`, among any number of processes at once: it is renamed to a
    name of this call's own first (one rename wins), and put back if what was renamed fails `still` (it was
    written after the caller looked). True when this call deleted it."""
    aside = path.parent / f".stale-{uuid.uuid4().hex}"
    try:
        with tier_errors():
            os.rename(path, aside)
    except NOT_FOUND:
        return False
    with tier_errors():
        try:
            if still(aside):
                return True
            with contextlib.suppress(FileExistsError):
                os.link(aside, path)
            return False
        finally:
            os.unlink(aside)


def unlink(path: Path) -> None:
    """Delete the file at `path`, if there is one."""
    with contextlib.suppress(*NOT_FOUND), tier_errors():
        os.unlink(path)
