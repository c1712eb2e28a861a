"""The shared-directory tier (`dir:PATH`): a file per entry in a directory that many processes and machines
mount (NFS, FSx, a local disk), as AWS Neuron's compile cache and ccache's file storage keep theirs. Under PATH
(names are hex or SHA-256 digests: no key, partition or kernel name can name a path outside its folder):

    nkicache-dir-store                    marker: what tells this directory from any other
    entries/<hex partition>/<hex key>     an encoded entry as stored; its mtime is its expiry
    leases/<hex partition>/<hex key>/<n>  JSON {"owner", "expires"}: generation n of the key's lease (file_leases)
    index/<sha256 kernel>/<sha256 field>  a field's value in the variant index; mtime: its expiry
    batches/<sha256 batch id>             an applied metrics batch (cachestore.metrics_fold), never rewritten

Every file is written whole, and lease generations and batches exclusively (cachestore.backends.files): a
reader sees a whole file or none, and of many processes creating one name, one does. Temp files a killed
writer left are never read, and `purge_expired` (inspect gc) deletes them, and the lease generations older than
`lease_ttl` with the key folders they leave empty. Whoever can write the directory can
plant anything in it: nothing here follows a link or blocks on a file (files.SharedFolder), a planted entry is
read as a corrupt one, and gc deletes what was planted; a lease lives `lease_ttl` from its file's creation at
most, whatever it says.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bridge.identity import toolchain_id
from cachestore import api
from cachestore.backends import files
from cachestore.backends.file_leases import FileLease
from cachestore.entry import MAX_ENTRY_BYTES, TooLarge
from cachestore.metrics_fold import FoldedMetrics, batch_record, zero_record

if TYPE_CHECKING:
    from cachestore.settings import Settings

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
        lease_ttl: float = 6.0,
    ) -> None:
        """`create` (a compile): a missing directory is made; otherwise it is an error naming it, but for a
        read-only client (`writable=False`), to which it reads as an empty tier. `partition`: the partition of
        entries and leases (default: this compiler's). Entries over `max_entry_bytes` are not read. A lease
        lives `lease_ttl` seconds from its file's creation at most."""
        self.path = Path(path).expanduser()
        self.files = files.SharedFolder(self.path)
        self.lease_ttl = lease_ttl
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
                    if (planted := self.files.hostile_folder(self.path / folder)) is not None:
                        raise api.TierUnavailable(f"dir tier {self.path}: {planted} is not a folder")
                    (self.path / folder).mkdir(parents=True, exist_ok=True)
                if not os.access(self.path / "entries", os.W_OK | os.X_OK):
                    raise api.TierUnavailable(f"dir tier {self.path} is not writable")
                if not (self.path / MARKER).exists():
                    self._write(self.path / MARKER, MARKER_TEXT, exclusive=True)
        elif not self.path.is_dir():
            if writable:
                raise api.TierUnavailable(f"no dir tier at {self.path}")
            return
        if self.files.read_small(self.path / MARKER) != MARKER_TEXT:
            raise api.TierUnavailable(f"{self.path} is no nkicache dir tier (its {MARKER} is missing or foreign)")

    def __repr__(self) -> str:
        return f"DirectoryBackend({str(self.path)!r}, partition {self.partition})"

    def _write(self, path: Path, data: bytes, expires: float | None = None, *, exclusive: bool = False) -> bool:
        if self.read_only:
            raise api.TierError(f"dir tier {self.path} is opened read-only")
        return self.files.write_whole(path, data, expires, exclusive=exclusive)

    def _entry(self, cache_key: str) -> Path:
        return self.path / "entries" / _hex(self.partition) / _hex(cache_key)

    # -- the compile path -------------------------------------------------------------------------
    def fetch(self, cache_keys: Sequence[str], ttl: int | None) -> dict[str, bytes | TooLarge]:
        now, found = time.time(), {}
        for key in (key for key in cache_keys if len(key.encode()) <= MAX_NAME_BYTES):
            if (read := self.files.read_bounded(self._entry(key), now, self.max_entry_bytes)) is None:
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
            self.files.set_expiry(self._entry(key), now + ttl)  # gone, planted or another user's: left as it is

    def read_variant_index(self, queries: Sequence[tuple[str, Sequence[bytes]]]) -> list[list[bytes | None] | None]:
        now, answers = time.time(), []
        for kernel_name, fields in queries:
            folder = self.path / "index" / _sha(kernel_name)
            if self.files.hostile_folder(folder) is not None:
                answers.append(None)  # a link or a file where the kernel's folder goes
                continue
            reads = [self.files.read_bounded(folder / _sha(name), now, MAX_SMALL_FILE) for name in fields]
            answers.append([read[0] if read and isinstance(read[0], bytes) else None for read in reads])
        return answers

    # -- leases: generations of files, each created exclusively (cachestore.backends.file_leases) ----------
    def _leases(self, cache_key: str) -> FileLease:
        return FileLease(self.files, self.path / "leases" / _hex(self.partition) / _hex(cache_key), self._write)

    def acquire_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        return self._leases(cache_key).acquire(owner, ttl, self.lease_ttl)

    def renew_lease(self, cache_key: str, owner: str, ttl: float) -> bool:
        return self._leases(cache_key).renew(owner, ttl, self.lease_ttl)

    def release_lease(self, cache_key: str, owner: str) -> None:
        self.release_leases([(cache_key, owner)])

    def release_leases(self, leases: Sequence[tuple[str, str]]) -> None:
        for cache_key, owner in leases:
            self._leases(cache_key).release(owner, self.lease_ttl)

    def lease_holder(self, cache_key: str) -> str | None:
        return self._leases(cache_key).holder(self.lease_ttl)

    # -- metrics: one file per batch, folded by cachestore.metrics_fold -----------------------------
    def apply_metrics(self, batch: api.MetricsBatch) -> bool:
        if (problem := api.batch_problem(batch)) is not None:
            raise api.BatchRefused(f"dir tier {self.path}: metrics batch {batch.batch_id!r} refused: {problem}")
        record = batch_record(batch, time.time())
        return self._write(self.path / "batches" / _sha(batch.batch_id), record, exclusive=True)

    def zero_counters(self, record: dict) -> None:
        self._write(self.path / "batches" / f"zero-{uuid.uuid4().hex}", zero_record(record, time.time()))

    def _record_names(self) -> list[str]:
        return self.files.names(self.path / "batches")

    def _record_bytes(self, name: str) -> bytes | None:
        return self.files.read_small(self.path / "batches" / name)

    # -- entries ----------------------------------------------------------------------------------
    def _live(self, partition: str) -> Iterator[str]:
        """The cache key of every live entry of `partition`, in order, and of every file planted under an entry's
        name (read as a corrupt entry, so verify reports it)."""
        now, folder = time.time(), self.path / "entries" / _hex(partition)
        for name in self.files.names(folder):
            info = self.files.stat_of(folder / name)
            if (key := _unhex(name)) is not None and info and (files.planted(info.st_mode) or info.st_mtime > now):
                yield key

    def entry_partitions(self) -> list[str]:
        names = (_unhex(name) for name in self.files.names(self.path / "entries"))
        return [name for name in names if name is not None and next(self._live(name), None) is not None]

    def entry_keys(self) -> Iterator[tuple[str, str]]:
        for partition in self.entry_partitions():
            yield from ((partition, key) for key in self._live(partition))

    def scan_entries(self, with_ttl: bool = True) -> Iterator[api.RawEntry]:
        for key in self._live(self.partition):
            now = time.time()
            if (read := self.files.read_bounded(self._entry(key), now, self.max_entry_bytes)) is not None:
                yield api.RawEntry(key, read[0], max(read[1] - now, 0.0), self.partition)

    def get_entries(self, cache_keys: Sequence[str]) -> dict[str, bytes | TooLarge]:
        return self.fetch(cache_keys, None)

    def find_keys(self, prefix: str, limit: int = 10) -> list[str]:
        return [key for key in self._live(self.partition) if key.startswith(prefix)][:limit]

    def put_entries(self, items: Sequence[api.WriteItem]) -> None:
        now = time.time()
        for item in items:
            self._write(self._entry(item.cache_key), item.data, now + item.ttl)

    def delete_entries(self, cache_keys: Sequence[str]) -> None:
        if self.read_only:
            raise api.TierError(f"dir tier {self.path} is opened read-only")
        for key in cache_keys:
            self.files.unlink(self._entry(key))

    def _garbage(self) -> Iterator[tuple[Path, int]]:
        """(path, bytes) of every expired entry and index field, every temp file a dead writer left there, and
        whatever was planted there (a link, a FIFO, a file where a folder goes)."""
        now = time.time()
        for top in ("entries", "index"):
            for folder in self.files.names(self.path / top):
                if (info := self.files.stat_of(self.path / top / folder)) is not None and files.removable(info.st_mode):
                    yield self.path / top / folder, 0  # a link is removed, never what it points to
                    continue
                for name in self.files.names(self.path / top / folder, hidden=True):
                    if (info := self.files.stat_of(path := self.path / top / folder / name)) is None:
                        continue
                    temp = name.startswith(".")
                    stale = info.st_ctime < now - STALE_TEMP_SECONDS if temp else info.st_mtime <= now
                    if stale or files.removable(info.st_mode):
                        yield path, info.st_size

    def _spent_leases(self) -> Iterator[tuple[Path, int]]:
        """(path, bytes) of every lease generation older than `lease_ttl`, and whatever was planted among them."""
        now = time.time()
        leases = self.path / "leases"
        for partition in self.files.names(leases):
            for key in self.files.names(leases / partition):
                folder = leases / partition / key
                if (info := self.files.stat_of(folder)) is not None and files.removable(info.st_mode):
                    yield folder, 0
                    continue
                for name in self.files.names(folder, hidden=True):
                    info = self.files.stat_of(folder / name)
                    if info is not None and (files.removable(info.st_mode) or info.st_ctime + self.lease_ttl < now):
                        yield folder / name, info.st_size

    def expired_count(self) -> tuple[int, int]:
        """(files `purge_expired` would delete, their bytes), of every partition."""
        found = [size for _, size in (*self._garbage(), *self._spent_leases())]
        return len(found), sum(found)

    def purge_expired(self) -> None:
        """Delete what `_garbage` lists, a file written again meanwhile excepted (`_take`), and the spent lease
        generations (never rewritten: deleted as they are) with the key folders they leave empty."""
        now = time.time()
        for path, _ in self._garbage():
            if path.name.startswith("."):
                self.files.unlink(path)
            else:
                self.files.take(path, lambda info: files.removable(info.st_mode) or info.st_mtime <= now)
        for path, _ in list(self._spent_leases()):
            self.files.unlink(path)
            self.files.remove_if_empty(path.parent)

    def close(self) -> None:
        pass


def open_store(
    settings: Settings, path: str, *, reading: bool, partition: str | None, writable: bool
) -> DirectoryBackend:
    """The shared folder `dir:PATH` names (cachestore.stores); reading never creates it."""
    size, ttl = settings.max_entry_bytes, settings.lease_ttl
    create = not reading and writable
    return DirectoryBackend(
        path, create=create, writable=writable, partition=partition, max_entry_bytes=size, lease_ttl=ttl
    )
