"""A single-flight lease as files in a shared folder (cachestore.backends.files): generation n of a key's lease
is the file `<n>` holding JSON {"owner", "expires"}, created exclusively and never rewritten. Of all the
processes that found generation n - 1 the newest, exactly one creates generation n; renewing and releasing
create the next generation too, so a contender that found a lease expired and its owner renewing it cannot
both win.

The folder is shared with anyone who can write it: a generation is a name of ASCII digits only, anything else
is ignored, and a lease lives `lease_ttl` seconds from its file's creation (its ctime, which its writer cannot
set) at most, whatever its "expires" says.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from cachestore.backends.files import SharedFolder

Write = Callable[..., bool]  # (path, data, expires, exclusive=True) -> made: the store's write


class FileLease:
    """The lease of one key: its folder of generations."""

    def __init__(self, files: SharedFolder, folder: Path, write: Write) -> None:
        self.files, self.folder, self._write = files, folder, write

    def acquire(self, owner: str, ttl: float, lease_ttl: float) -> bool:
        now = time.time()
        generation, holder, expires = self._top(lease_ttl)
        if holder and expires > now:
            return False
        return self._claim(generation + 1, owner, now + ttl)  # none, released, or expired: taken over

    def renew(self, owner: str, ttl: float, lease_ttl: float) -> bool:
        now = time.time()
        generation, holder, expires = self._top(lease_ttl)
        return holder == owner and expires > now and self._claim(generation + 1, owner, now + ttl)

    def release(self, owner: str, lease_ttl: float) -> None:
        generation, holder, _ = self._top(lease_ttl)
        if holder == owner:
            self._claim(generation + 1, "", 0.0)  # a released generation: owned by no one

    def holder(self, lease_ttl: float) -> str | None:
        _, holder, expires = self._top(lease_ttl)
        return holder if holder and expires > time.time() else None

    def _generations(self) -> list[int]:
        """The generations there are, sorted: names of ASCII digits only (a '²' is a digit, and no generation)."""
        return sorted(int(name) for name in self.files.names(self.folder) if name.isascii() and name.isdigit())

    def _top(self, lease_ttl: float) -> tuple[int, str, float]:
        """(generation, owner, expiry) of the newest generation; (0, "", 0.0) for none. A foreign or empty file
        reads as released."""
        for _ in range(3):  # the newest was replaced by a newer one between listing and reading: listed again
            if not (generations := self._generations()):
                return 0, "", 0.0
            path = self.folder / str(generations[-1])
            data, info = self.files.read_small(path), self.files.stat_of(path)
            if data is not None and info is not None:
                try:
                    lease = json.loads(data)
                    owner, expires = str(lease["owner"]), float(lease["expires"])
                except (ValueError, TypeError, KeyError):
                    break
                return generations[-1], owner, min(expires, info.st_ctime + lease_ttl)
        return generations[-1], "", 0.0

    def _claim(self, generation: int, owner: str, expires: float) -> bool:
        """Create `generation`: True when this call made it and it is the newest (a caller that looked before a
        newer one was made loses), the older ones then deleted."""
        lease = json.dumps({"owner": owner, "expires": expires}).encode()
        if not self._write(self.folder / str(generation), lease, expires, exclusive=True):
            return False
        generations = self._generations()
        if max(generations, default=generation) > generation:
            return False
        for older in (g for g in generations if g < generation):
            self.files.unlink(self.folder / str(older))
        return True
