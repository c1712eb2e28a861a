"""Files that many processes, machines and users share (a local disk, NFS, FSx): whole-file writes, exclusive
creation, bounded reads and removal by exactly one of many, all under one root folder. What the
shared-directory tier (cachestore.backends.directory) is built of, and nothing else of it.

A file is written to a temp file in its own folder (`.tmp-*`), fsynced, then renamed over its name
(`os.replace`), or linked to it where it must be new (`os.link` fails when the name exists, on NFS as on a local
disk, and the file it makes appears whole). So a reader sees a whole file or none (NFS close-to-open). A file's
mtime may be set to a time to come: the stores here keep an expiry in it. Names starting with "." are temp files,
never listed unless asked for.

Anyone who can write the folder may plant anything in it, so nothing here follows a link or waits on a file:
every folder between the root and a path must be a real folder (checked with lstat, never followed), and a
file is opened non-blocking without following a link, then read only if it is a regular file. A read of
something else (a link, a FIFO, a file this user may not read) is an `Unreadable` standing for the entry; a
listing skips it; a write first removes what stands where one of its folders goes. An OSError other than a
missing file, a refused read or a planted file is a TierUnavailable naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from cachestore.api import TierUnavailable
from cachestore.entry import TooLarge, Unreadable

logger = logging.getLogger(__name__)

NOT_FOUND = (FileNotFoundError, IsADirectoryError, NotADirectoryError)  # no file there (a folder is none)
# A file opened for reading never blocks (a FIFO) and is never reached through a link (ELOOP).
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


@contextlib.contextmanager
def tier_errors() -> Iterator[None]:
    """An OSError as TierUnavailable naming its file; a missing file (NOT_FOUND) is left to the caller."""
    try:
        yield
    except NOT_FOUND:
        raise
    except OSError as exc:
        raise TierUnavailable(f"shared directory: {exc.strerror or exc}: {exc.filename}") from None


def planted(mode: int) -> str | None:
    """What a file of this (lstat) mode is when it is not a regular file, or None."""
    if stat.S_ISREG(mode):
        return None
    return "a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"


def removable(mode: int) -> bool:
    """Whether a file of this (lstat) mode was planted and is gc's to remove: anything but a regular file or a
    folder (a link is removed itself, never what it points to)."""
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _own_stat(entry: os.DirEntry[str]) -> tuple[str, os.stat_result] | None:
    """(name, lstat) of a listed file, None for one deleted since the listing (a temp file another writer just
    renamed into place): one file gone, not a folder of them."""
    try:
        return entry.name, entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None


class Read(NamedTuple):
    """A file as read: its bytes (or what stands for them), mtime, ctime, and whether it was planted (not a
    regular file, or in a planted folder)."""

    data: bytes | TooLarge
    mtime: float
    ctime: float
    planted: bool


class SharedFolder:
    """The files under `root`: every path handed to a method lies below it."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def hostile_folder(self, folder: Path) -> Path | None:
        """The first path from the root down to `folder` that exists and is not a real folder (a link, a file,
        a FIFO), or None: `folder` is safe to list, read and write in (what is missing is made when written)."""
        current = self.root
        for part in folder.relative_to(self.root).parts:
            current = current / part
            try:
                mode = os.lstat(current).st_mode
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise TierUnavailable(f"shared directory: {exc.strerror or exc}: {current}") from None
            if not stat.S_ISDIR(mode):
                return current
        return None

    def _make_folder(self, folder: Path) -> None:
        """Make `folder`, first removing whatever was planted where it or one of its parents goes (that name is
        the tier's: what stands there is garbage, and removing a link never touches what it points to)."""
        while (hostile := self.hostile_folder(folder)) is not None:
            logger.warning("shared directory: %s was not a folder; removed", hostile)
            with contextlib.suppress(FileNotFoundError), tier_errors():
                os.unlink(hostile)
        with tier_errors():
            folder.mkdir(parents=True, exist_ok=True)

    def write_whole(self, path: Path, data: bytes, expires: float | None = None, *, exclusive: bool = False) -> bool:
        """Write `path` whole, its mtime `expires` (None: now); `exclusive`: only if no file has its name (False
        when one has). Its folder is made if missing, and again should gc remove it meanwhile, being empty."""
        for _ in range(2):
            with contextlib.suppress(FileNotFoundError):
                return self._write_whole(path, data, expires, exclusive)
        return self._write_whole(path, data, expires, exclusive)

    def _write_whole(self, path: Path, data: bytes, expires: float | None, exclusive: bool) -> bool:
        self._make_folder(path.parent)
        with tier_errors():
            temp = path.parent / f".tmp-{uuid.uuid4().hex}"
            try:
                with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666), "wb") as file:
                    file.write(data)
                    file.flush()
                    os.fsync(file.fileno())
                if expires is not None:
                    os.utime(temp, (time.time(), expires))
                if not exclusive:
                    self._replace(temp, path)
                    return True
                with contextlib.suppress(FileExistsError):
                    os.link(temp, path, follow_symlinks=False)
                    return True
                return False
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)

    @staticmethod
    def _replace(temp: Path, path: Path) -> None:
        """Rename `temp` over `path`: over a link or FIFO planted there (never what a link points to), and over a
        folder planted there once it is removed (the name is the tier's: what stands there is garbage; rmtree
        follows no link)."""
        try:
            os.replace(temp, path)
        except IsADirectoryError:
            logger.warning("shared directory: %s was a folder; removed", path)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(temp, path)

    def read_bounded(self, path: Path, limit: int) -> Read | None:
        """The file at `path`, whatever its mtime: its bytes; a TooLarge, unread, for one over `limit` bytes (stat
        before read); an Unreadable for a link, a FIFO or any other non-regular file, one this user may not read,
        or any file in a planted folder. None for no file."""
        if (hostile := self.hostile_folder(path.parent)) is not None:
            return Read(Unreadable(0, limit, f"{hostile} is not a folder"), 0.0, 0.0, planted=True)
        try:
            with tier_errors():
                info = os.lstat(path)
            if (what := planted(info.st_mode)) is not None:
                return Read(Unreadable(info.st_size, limit, f"{path} is {what}"), info.st_mtime, info.st_ctime, True)
            descriptor = os.open(path, READ_FLAGS)
        except NOT_FOUND:
            return None
        except PermissionError:
            reason = f"{path} may not be read by this user"
            return Read(Unreadable(info.st_size, limit, reason), info.st_mtime, info.st_ctime, planted=False)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # swapped for a link since the lstat
                return Read(Unreadable(0, limit, f"{path} is a symbolic link"), info.st_mtime, info.st_ctime, True)
            raise TierUnavailable(f"shared directory: {exc.strerror or exc}: {path}") from None
        with tier_errors(), open(descriptor, "rb") as file:
            info = os.fstat(file.fileno())  # what was opened, should it have been swapped since the lstat
            if (what := planted(info.st_mode)) is not None:
                return Read(Unreadable(info.st_size, limit, f"{path} is {what}"), info.st_mtime, info.st_ctime, True)
            data = file.read(limit + 1) if info.st_size <= limit else b""  # bounded if it grew since the stat
        size = max(len(data), info.st_size)
        return Read(TooLarge(size, limit) if size > limit else data, info.st_mtime, info.st_ctime, planted=False)

    def walk(self, folder: Path) -> Iterator[tuple[Path, os.stat_result]]:
        """(path, its own lstat) of every file below `folder` that is not a folder, and of every empty folder,
        temp files included, folder by folder in name order; links are never followed, and a folder that is
        missing, planted or may not be listed holds nothing."""
        if self.hostile_folder(folder) is not None:
            return
        try:
            with tier_errors(), os.scandir(folder) as listing:
                found = sorted(filter(None, map(_own_stat, listing)))
        except NOT_FOUND:
            return
        except TierUnavailable:
            if os.access(folder, os.R_OK | os.X_OK):
                raise
            logger.warning("shared directory: %s may not be listed by this user; skipped", folder)
            return
        for name, info in found:
            if not stat.S_ISDIR(info.st_mode):
                yield folder / name, info
                continue
            inside = self.walk(folder / name)
            if (first := next(inside, None)) is None:
                yield folder / name, info
            else:
                yield first
                yield from inside

    def stat_of(self, path: Path) -> os.stat_result | None:
        """The file's own stat (a link's, not its target's), None for none or one in a planted folder."""
        if self.hostile_folder(path.parent) is not None:
            return None
        try:
            with tier_errors():
                return os.lstat(path)
        except NOT_FOUND:
            return None

    def set_expiry(self, path: Path, expires: float) -> None:
        """Set a regular file's mtime to `expires`; nothing for none, a planted one or another user's."""
        info = self.stat_of(path)
        if info is not None and stat.S_ISREG(info.st_mode):
            with contextlib.suppress(OSError):
                os.utime(path, (time.time(), expires), follow_symlinks=False)

    def take(self, path: Path, still: Callable[[os.stat_result], bool]) -> bool:
        """Delete the file at `path` if its stat passes `still`, among any number of processes at once: it is
        renamed to a name of this call's own first (one rename wins), and put back if what was renamed fails
        `still` (it was written after the caller looked). True when this call deleted it."""
        if self.hostile_folder(path.parent) is not None:
            return False
        aside = path.parent / f".stale-{uuid.uuid4().hex}"
        try:
            with tier_errors():
                os.rename(path, aside)
        except NOT_FOUND:
            return False
        with tier_errors():
            try:
                if still(os.lstat(aside)):
                    return True
                with contextlib.suppress(FileExistsError):
                    os.link(aside, path, follow_symlinks=False)
                return False
            finally:
                os.unlink(aside)

    def remove_if_empty(self, folder: Path) -> None:
        """Remove `folder` if it holds nothing (a folder another process writes into meanwhile stays)."""
        if self.hostile_folder(folder) is not None:
            return
        with contextlib.suppress(OSError):
            os.rmdir(folder)

    def unlink(self, path: Path) -> None:
        """Delete the file at `path` (a link itself, never what it points to), or an empty folder planted there,
        if there is one."""
        if self.hostile_folder(path.parent) is not None:
            return
        try:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError), tier_errors():
                os.unlink(path)
        except IsADirectoryError:
            with contextlib.suppress(OSError):
                os.rmdir(path)
