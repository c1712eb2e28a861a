"""The shared-directory tier (`dir:PATH`): a file per entry in a directory that many processes and machines
mount (NFS, FSx, a local disk), as AWS Neuron's compile cache and ccache's file storage keep theirs. Under PATH
(names are hex or SHA-256 digests: no key, partition or kernel name can name a path outside its folder):

    nkicache-dir-store                    marker: what tells this directory from any other
    entries/<hex partition>/<hex key>     an encoded entry as stored; its mtime is its expiry
    leases/<hex partition>/<hex key>/<n>  JSON {"owner", "expires"}: generation n of the key's lease
    index/<sha256 kernel>/<sha256 field>  a field's value in the variant index; mtime: its expiry
    batches/<sha256 batch id>             an applied metrics batch (cachestore.metrics_fold), never rewritten

Every file is written whole, and lease generations and batches exclusively (cachestore.backends.files): a
reader sees a whole file or none, and of many processes creating one name, one does. Temp files a killed
writer left are never read, and `purge_expired` (inspect gc) deletes them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from bridge.identity import toolchain_id
from cachestore import api
from cachestore.backends import files
from cachestore.entry import MAX_ENTRY_BYTES, TooLarge
from cachestore.metrics_fold import FoldedMetrics, batch_record, zero_record

MARKER = "nkicache-dir-store"
MARKER_TEXT = b"nkicache shared directory tier, layout 1\n"
FOLDERS = ("entries", "leases", "index", "batches")
MAX_NAME_BYTES = 120  # a key or partition of at most this many bytes: its hex name fits in any file system's 255
TTL_REFRESH_FRACTION = 0.9  # as the local tier: an entry read is given its TTL again once 10% of it is used up
STALE_TEMP_SECONDS = 3600.0  # a temp file unchanged this long was left by a writer that died: gc deletes it
MAX_SMALL_FILE = 1 << 20  # bytes read of a lease, index field or batch file at most


def _hex(text: str) -> str:
    raw = text.encode()
    if len(raw) > MAX_NAME_BYTES:
        raise api.TierError(f"a name of {len(raw)} bytes; the dir tier takes keys and toolchains of {MAX_NAME_BYTES}")
    return raw.hex() or "-"


def _unhex(name: str) -> str | None:
    """The text a file name stands for; None for a name this store did not make (skipped)."""
    try:
        return "" if name == "-" else bytes.fromhex(name).decode()
    except (ValueError, UnicodeDecodeError):
        return None


def _sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


class DirectoryBackend(FoldedMetrics, api.Backend, api.Reader):
    """A tier in a shared directory: the compile path (Backend) and the reader side (Reader)."""

    value_ttls = True  # an entry stays for its TTL alone
    keeps_expired = True  # expired files stay until purge_expired (inspect gc)
    splits_scans = False  # scanned in one process (cachestore.scan_split)

    def __init__(
        self,
        path: str | Path,
        *,
        create: bool = True,
        writable: bool = True,
        partition: str | None = None,
        max_entry_bytes: int = MAX_ENTRY_BYTES,
    ) -> None:
        """`create` (a compile): a missing directory is made; otherwise it is an error naming it, but for a
        read-only client (`writable=False`), to which it reads as an empty tier. `partition`: the partition of
        entries and leases (default: this compiler's). Entries over `max_entry_bytes` are not read."""
        self.path = Path(path).expanduser()
        self.description = f"dir:{self.path}"
        self.partition = partition or toolchain_id()
        self.max_entry_bytes = max_entry_bytes
        self.read_only = not writable  # every write raises TierError
        self._records: dict[str, dict | None] = {}
        if self.path.exists() and not self.path.is_dir():
            raise api.TierUnavailable(f"dir tier {self.path} is a file, not a directory")
        if create and writable:
            with files.tier_errors():
                for folder in FOLDERS:
                    (self.path / folder).mkdir(parents=True, exist_ok=True)
                if not os.access(self.path / "entries", os.W_OK | os.X_OK):
                    raise api.TierUnavailable(f"dir tier {self.path} is not writable")
                if not (self.path / MARKER).exists():
                    self._write(self.path / MARKER, MARKER_TEXT, exclusive=True)
        elif not self.path.is_dir():
            if writable:
                raise api.TierUnavailable(f"no dir tier at {self.path}")
            return
        if files.read_small(self.path / MARKER) != MARKER_TEXT:
            raise api.TierUnavailable(f"{self.path} is no nkicache dir tier (its {MARKER} is missing or foreign)")

    def __repr__(self) -> str:
        return f"DirectoryBackend({str(self.path)!r}, partition {self.partition})"

    def _write(self, path: Path, data: bytes, expires: float | None = None, *, exclusive: bool = False) -> bool:
        if self.read_only:
            raise api.TierError(f"dir tier {self.path} is opened read-only")
        return files.write_whole(path, data, expires, exclusive=exclusive)

    def _entry(self, cache_key: str) -> Path:
        return self.path / "entries" / _hex(self.partition) / _hex(cache_key)

    # -- the compile path -------------------------------------------------------------------------
    def fetch(self, cache_keys: Sequence[str], ttl: int | None) -> dict[str, bytes | TooLarge]:
        now, found = time.time(), {}
        for key in (key for key in cache_keys if len(key.encode()) <= MAX_NAME_BYTES):
            if (read := files.read_bounded(self._entry(key), now, self.max_entry_bytes)) is None:
                continue
            found[key], expires = read
            if ttl is not None and isinstance(found[key], bytes) and expires < now + ttl * TTL_REFRESH_FRACTION:
                self.refresh_ttls([(key, ttl)])
        return found

    def store(self, requests: Sequence[api.StoreRequest], ttl: int) -> None:
        now = time.time()
        for request in requests:
            self._write(self._entry(request.cache_key), request.full, now + (request.ttl or ttl))
            for name, value in request.index_fields.items():
                self._write(self.path / "index" / _sha(request.kernel_name) / _sha(name), value, now + ttl)

    def refresh_ttls(self, items: Sequence[tuple[str, int]]) -> None:
        now = time.time()
        for key, ttl in items:
            with contextlib.suppress(OSError):  # gone, or another user's file: it keeps its expiry
                os.utime(self._entry(key), (now, now + ttl))

    def read_variant_index(self, queries: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[bytes | None] | None]:
        now, answers = time.time(), []
        for kernel_name, fields in queries:
            folder = self.path / "index" / _sha(kernel_name)
            if folder.exists() and not folder.is_dir():
                answers.append(None)  # a foreign file where the kernel's folder goes
                continue
            reads = [files.read_bounded(folder / _sha(name), now, MAX_SMALL_FILE) for name in fields]
            answers.append([read[0] if read and isinstance(read[0], bytes) else None for read in reads])
        return answers

    # -- leases: generations, each created exclusively -------------------------------------------
    def _top(self, folder: Path) -> tuple[int, str, float]:
        """(generation, owner, expiry) of a key's newest lease file; (0, "", 0.0) for none. A foreign or empty
        file reads as released."""
        for _ in range(3):  # the newest was replaced by a newer one between listing and reading: listed again
            generations = sorted(int(name) for name in files.names(folder) if name.isdigit())
            if not generations:
                return 0, "", 0.0
            if (data := files.read_small(folder / str(generations[-1]))) is not None:
                try:
                    lease = json.loads(data)
                    return generations[-1], str(lease["owner"]), float(lease["expires"])
                except (ValueError, TypeError, KeyError):
                    break
        return generations[-1], "", 0.0

    def _claim(self, folder: Path, generation: int, owner: str, expires: float) -> bool:
        """Create lease `generation` of a key: True when this call made it and it is the newest (a caller that
        looked before a newer one was made loses), the older ones then deleted. Of all the processes that found
        generation - 1 the newest, one creates this one: no lease file is ever rewritten."""
        lease = json.dumps({"owner": owner, "expires": expires}).encode()
        if not self._write(folder / str(generation), lease, expires, exclusive=True):
            return False
        generations = [int(name) for name in files.names(folder) if name.isdigit()]
        if max(generations, default=generation) > generation:
            return False
        for older in (g for g in generations if g < generation):
            files.unlink(folder / str(older))
        return True

    def _leases(self, cache_key: str) -> Path:
        return self.path / "leases" / _hex(self.partition) / _hex(cache_key)

    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        folder, now = self._leases(cache_key), time.time()
        generation, holder, expires = self._top(folder)
        if holder and expires > now:
            return False
        return self._claim(folder, generation + 1, owner, now + ttl)  # none, released, or expired: taken over

    def renew_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        folder, now = self._leases(cache_key), time.time()
        generation, holder, expires = self._top(folder)
        # A new generation, not a rewrite: a contender that found this one expired and the owner renewing it
        # cannot both win.
        return holder == owner and expires > now and self._claim(folder, generation + 1, owner, now + ttl)

    def release_lease(self, cache_key: str, owner: str) -> None:
        self.release_leases([(cache_key, owner)])

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> None:
        for cache_key, owner in leases:
            generation, holder, _ = self._top(folder := self._leases(cache_key))
            if holder == owner:
                self._claim(folder, generation + 1, "", 0.0)  # a released generation: owned by no one

    def lease_holder(self, cache_key: str) -> str | None:
        _, holder, expires = self._top(self._leases(cache_key))
        return holder if holder and expires > time.time() else None

    # -- metrics: one file per batch, folded by cachestore.metrics_fold -----------------------------
    def apply_metrics(self, batch: api.MetricsBatch) -> bool:
        if (problem := api.batch_problem(batch)) is not None:
            raise api.BatchRefused(f"dir tier {self.path}: metrics batch {batch.batch_id!r} refused: {problem}")
        record = batch_record(batch, time.time())
        return self._write(self.path / "batches" / _sha(batch.batch_id), record, exclusive=True)

    def zero_counters(self, record: dict) -> None:
        self._write(self.path / "batches" / f"zero-{uuid.uuid4().hex}", zero_record(record, time.time()))

    def _record_names(self) -> list[str]:
        return files.names(self.path / "batches")

    def _record_bytes(self, name: str) -> bytes | None:
        return files.read_small(self.path / "batches" / name)

    # -- entries ----------------------------------------------------------------------------------
    def _live(self, partition: str) -> Iterator[str]:
        """The cache key of every live entry of `partition`, in order."""
        now, folder = time.time(), self.path / "entries" / _hex(partition)
        for name in files.names(folder):
            info = files.stat_of(folder / name)
            if (key := _unhex(name)) is not None and info and stat.S_ISREG(info.st_mode) and info.st_mtime > now:
                yield key

    def entry_partitions(self) -> list[str]:
        names = (_unhex(name) for name in files.names(self.path / "entries"))
        return [name for name in names if name is not None and next(self._live(name), None) is not None]

    def entry_keys(self) -> Iterator[tuple[str, str]]:
        for partition in self.entry_partitions():
            yield from ((partition, key) for key in self._live(partition))

    def scan_entries(self, with_ttl: bool = True) -> Iterator[api.RawEntry]:
        for key in self._live(self.partition):
            now = time.time()
            if (read := files.read_bounded(self._entry(key), now, self.max_entry_bytes)) is not None:
                yield api.RawEntry(key, read[0], read[1] - now, self.partition)

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        return self.fetch(cache_keys, None)

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        return [key for key in self._live(self.partition) if key.startswith(prefix)][:limit]

    def put_entries(self, items: Sequence[api.WriteItem]) -> None:
        now = time.time()
        for item in items:
            self._write(self._entry(item.cache_key), item.data, now + item.ttl)

    def delete_entries(self, items: Sequence[tuple[str, str | None]]) -> None:
        if self.read_only:
            raise api.TierError(f"dir tier {self.path} is opened read-only")
        for key, _ in items:
            files.unlink(self._entry(key))

    def _garbage(self) -> Iterator[tuple[Path, int]]:
        """(path, bytes) of every expired entry and index field, and every temp file a dead writer left there."""
        now = time.time()
        for top in ("entries", "index"):
            for folder in files.names(self.path / top):
                for name in files.names(self.path / top / folder, hidden=True):
                    if (info := files.stat_of(path := self.path / top / folder / name)) is None:
                        continue
                    temp = name.startswith(".")
                    if (temp and info.st_ctime < now - STALE_TEMP_SECONDS) or (not temp and info.st_mtime <= now):
                        yield path, info.st_size

    def expired_count(self) -> tuple[int, int]:
        """(expired entries and index fields and stale temp files, their bytes), of every partition."""
        found = [size for _, size in self._garbage()]
        return len(found), sum(found)

    def purge_expired(self) -> None:
        """Delete what `_garbage` lists, a file written again meanwhile excepted (`_take`)."""
        now = time.time()
        for path, _ in self._garbage():
            if path.name.startswith("."):
                files.unlink(path)
            else:
                files.take(path, lambda aside: os.stat(aside).st_mtime <= now)

    def close(self) -> None:
        pass
