"""A single-flight lease as blobs (cachestore.blob.contract): generation n of a key's lease is the blob
`<folder>/<n>` holding JSON {"owner", "expires"}, created if absent and never rewritten. Of all the processes
that found generation n - 1 the newest, exactly one creates generation n; renewing and releasing create the
next generation too, so a contender that found a lease expired and its owner renewing it cannot both win.

The store is shared with anyone who can write it: a generation is a name of ASCII digits only, anything else is
ignored, and a lease lives `lease_ttl` seconds from its blob's creation (by the store's clock, which its writer
cannot set) at most, whatever its "expires" says.
"""

from __future__ import annotations

import json
import time

from cachestore.blob.contract import BlobStore

MAX_LEASE_BYTES = 4096


class BlobLease:
    """The lease of one key: its folder of generations in `blobs`."""

    def __init__(self, blobs: BlobStore, folder: str, lease_ttl: float) -> None:
        self.blobs, self.folder, self.lease_ttl = blobs, folder, lease_ttl

    def acquire(self, owner: str, ttl: float) -> bool:
        now = time.time()
        generation, holder, expires = self._top()
        if holder and expires > now:
            return False
        return self._claim(generation + 1, owner, now + ttl)  # none, released, or expired: taken over

    def renew(self, owner: str, ttl: float) -> bool:
        now = time.time()
        generation, holder, expires = self._top()
        return holder == owner and expires > now and self._claim(generation + 1, owner, now + ttl)

    def release(self, owner: str) -> None:
        generation, holder, _ = self._top()
        if holder == owner:
            self._claim(generation + 1, "", 0.0)  # a released generation: owned by no one

    def holder(self) -> str | None:
        _, holder, expires = self._top()
        return holder if holder and expires > time.time() else None

    def _generations(self) -> list[int]:
        """The generations there are, sorted: names of ASCII digits only (a '²' is a digit, and no generation)."""
        names = (blob.name.rpartition("/")[2] for blob in self.blobs.list(self.folder) if blob.planted is None)
        return sorted(int(name) for name in names if name.isascii() and name.isdigit())

    def _top(self) -> tuple[int, str, float]:
        """(generation, owner, expiry) of the newest generation; (0, "", 0.0) for none. A foreign or empty blob
        reads as released."""
        for _ in range(3):  # the newest was replaced by a newer one between listing and reading: listed again
            if not (generations := self._generations()):
                return 0, "", 0.0
            name = f"{self.folder}{generations[-1]}"
            if (found := self.blobs.get([name], MAX_LEASE_BYTES).get(name)) is not None:
                blob, data = found
                try:
                    lease = json.loads(data) if isinstance(data, bytes) else {}
                    owner, expires = str(lease["owner"]), float(lease["expires"])
                except (ValueError, TypeError, KeyError):
                    break
                return generations[-1], owner, min(expires, blob.created + self.lease_ttl)
        return generations[-1], "", 0.0

    def _claim(self, generation: int, owner: str, expires: float) -> bool:
        """Create `generation`: True when this call made it and it is the newest (a caller that looked before a
        newer one was made loses), the older ones then deleted."""
        lease = json.dumps({"owner": owner, "expires": expires}).encode()
        if not self.blobs.create(f"{self.folder}{generation}", lease, expires):
            return False
        generations = self._generations()
        if max(generations, default=generation) > generation:
            return False
        self.blobs.delete([f"{self.folder}{older}" for older in generations if older < generation])
        return True
