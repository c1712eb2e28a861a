"""The temporary folder a beta3 trace writes its kernel json under, and the folders killed traces left.

A trace removes its folder however it ends, except when its process is killed (SIGKILL runs no `finally`).
Each folder's name carries its process id, so the first trace of every later process removes the folders
of processes that no longer exist.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "nkicache-kernel-"


@contextlib.contextmanager
def kernel_folder() -> Iterator[str]:
    """A new folder `PREFIX<pid>-<random>` in the temporary directory, removed when the block ends."""
    remove_dead_folders(tempfile.gettempdir())
    directory = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@functools.cache  # once per process and temporary directory: what a dead process left cannot come back
def remove_dead_folders(temporary: str) -> int:
    """Remove the kernel folders in `temporary` whose process no longer runs; returns how many went."""
    removed = 0
    for path in Path(temporary).glob(f"{PREFIX}*-*"):
        owner = path.name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _running(int(owner)):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or no pid we can ask about: left alone
        pass
    return True
