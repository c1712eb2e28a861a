"""Reading input files (graphs, artifacts) safely, and naming them safely in messages.

An input path may name anything: /dev/zero never ends, a FIFO blocks until someone writes to it, and a file
name may hold a newline that would start a forged line in a worker's log. Every input is therefore opened
without blocking, refused unless it is a regular file, and read no further than its limit; and every file
name a message shows goes through `shown_path`.
"""

from __future__ import annotations

import os
import stat

CHUNK_BYTES = 1 << 20
# What a path that is not a regular file is, for the one-line refusal.
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class InputFileError(Exception):
    """An input file cannot be read as one: the message says why, without the file's name (callers prefix it)."""


def shown_path(path: object) -> str:
    """`path` as a message shows it: itself when printable, else Python's escaped form (a newline as \\n), so
    that no file name can end a log line and forge the next one."""
    text = str(path)
    return text if text.isprintable() else repr(text)[1:-1]


def read_input(path: str | os.PathLike, max_bytes: int, what: str, limit: str) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes` (the limit setting named `limit`); else an
    InputFileError saying what is wrong with the `what` ("graph file"). Opened with O_NONBLOCK, so that a FIFO
    is refused at once instead of blocking the caller."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InputFileError(f"cannot read {what}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb", buffering=0) as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = next((name for test, name in _KINDS if test(info.st_mode)), "a special file")
            raise InputFileError(f"{what} is {kind}, not a regular file; refused")
        if info.st_size > max_bytes:  # refused unread; the loop below still stops at a file that grows
            raise InputFileError(f"{what} of more than {max_bytes} bytes, the limit {limit}")
        chunks, size = [], 0
        try:
            # In chunks: read(max_bytes + 1) would allocate the whole limit up front, whatever the file's size.
            while size <= max_bytes and (chunk := file.read(min(CHUNK_BYTES, max_bytes + 1 - size))):
                chunks.append(chunk)
                size += len(chunk)
        except OSError as exc:
            raise InputFileError(f"cannot read {what}: {exc.strerror or exc}") from None
    if size > max_bytes:  # one byte more than the limit was read: the file is over it
        raise InputFileError(f"{what} of more than {max_bytes} bytes, the limit {limit}")
    return b"".join(chunks)
