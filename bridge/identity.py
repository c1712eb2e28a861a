"""The compiler's identity: a fingerprint of everything that decides what binary a kernel compiles to.

A cached binary is only as good as the compiler that made it: after a change to a kernel's maths, the
kernel language, a frontend or the binary encoding, yesterday's binaries are wrong. Build caches that users
trust put the compiler's identity beside the key (sccache hashes the compiler, TorchInductor hashes its own
code generator); this is ours.

The fingerprint is computed from the code itself, never from a hand-bumped constant: what every module a
compile loads means (its syntax tree without docstrings; comments, formatting and line numbers are not in
it), the modules found by following the imports of the codegen loop and the kernel library through the
`bridge` package (so a module added to the compile path is covered without anyone remembering to list it),
plus the versions of the libraries that shape a binary (numpy and ml_dtypes compute constants, msgpack
encodes BIR) and of Python (the beta3 frontend parses kernels with Python's own parser). Anything else
(docs, reports, the command line, cachestore, workers) can change without changing it. Line numbers reach
only error messages, never a binary, so a comment or a reformat keeps the id.

Parsing the closure takes tens of milliseconds, so the id is kept in the package's `__pycache__` beside
Python's own bytecode, under a stamp of every package file's size, times and inode and of the libraries'
installed files: any edit, checkout or upgrade changes the stamp and the id is computed again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

COMPILE_ROOTS = ("bridge.codegen", "bridge.kernels")  # the loop, and every kernel it can trace
LIBRARIES = ("numpy", "ml_dtypes", "msgpack")
FINGERPRINT_HEX_DIGITS = 16
CACHE_NAME = "toolchain-id.json"


def package_root() -> Path:
    return Path(__file__).resolve().parent


@functools.cache
def toolchain_id() -> str:
    """This compiler's identity: 16 hex digits of a SHA-256 over what the compile path's code means and the
    versions of the libraries and the Python that shape its binaries."""
    root = package_root()
    stamp = source_stamp(root)
    known = _cached_id(root, stamp)
    if known is not None:
        return known
    identity = fingerprint(root)
    _remember_id(root, stamp, identity)
    return identity


def fingerprint(root: Path) -> str:
    """The identity of the `bridge` package whose source folder is `root` (tests fingerprint copies)."""
    from bridge.source_closure import closure, meaning_of  # parsing: only when the id is computed, not remembered

    digest = hashlib.sha256()
    for path, tree in sorted(closure(root, COMPILE_ROOTS).items()):
        meaning = meaning_of(tree)
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(meaning)}\0".encode())
        digest.update(meaning)
    for name in LIBRARIES:
        digest.update(f"{name}=={_version(name)}\0".encode())
    import platform  # this and the imports below load only when the id is computed, not when it is remembered

    python = f"{platform.python_implementation()}-{'.'.join(platform.python_version_tuple()[:2])}"
    digest.update(f"python=={python}".encode())
    return digest.hexdigest()[:FINGERPRINT_HEX_DIGITS]


def compile_sources(root: Path) -> list[Path]:
    """The source files of every `bridge` module a compile loads: the closure of COMPILE_ROOTS' imports
    within the package (module-level and function-level imports alike), sorted."""
    from bridge.source_closure import closure

    return sorted(closure(root, COMPILE_ROOTS))


def source_stamp(root: Path) -> str:
    """A digest of every package source file's path, size, times and inode, of the installed files of the
    libraries in LIBRARIES, and of this Python: it changes whenever the fingerprint could."""
    digest = hashlib.sha256(f"{sys.version}\0{sys.implementation.cache_tag}\0".encode())
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            digest.update(_file_stamp(os.path.join(directory, name), root))
    for name in LIBRARIES:
        spec = importlib.util.find_spec(name)
        digest.update(_file_stamp(spec.origin, root) if spec and spec.origin else f"{name} absent\n".encode())
    return digest.hexdigest()


def _file_stamp(path: str, root: Path) -> bytes:
    status = os.stat(path)
    where = os.path.relpath(path, root)
    return f"{where}\0{status.st_size}\0{status.st_mtime_ns}\0{status.st_ctime_ns}\0{status.st_ino}\n".encode()


def _cache_path(root: Path) -> Path:
    return root / "__pycache__" / CACHE_NAME


def _cached_id(root: Path, stamp: str) -> str | None:
    """The id remembered under `stamp`, or None when there is none (or the file is not one we wrote)."""
    try:
        record = json.loads(_cache_path(root).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("stamp") != stamp:
        return None
    identity = record.get("toolchain")
    if not isinstance(identity, str) or len(identity) != FINGERPRINT_HEX_DIGITS:
        return None
    return identity if all(c in "0123456789abcdef" for c in identity) else None


def _remember_id(root: Path, stamp: str, identity: str) -> None:
    """Keep the id for the next process (a temporary file renamed into place, so readers see all or nothing);
    a package folder we may not write to only costs the next process the computation."""
    import tempfile

    path = _cache_path(root)
    try:
        path.parent.mkdir(exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{CACHE_NAME}.")
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "w") as out:
            json.dump({"stamp": stamp, "toolchain": identity}, out)
        os.replace(temporary, path)
    except OSError:
        Path(temporary).unlink(missing_ok=True)


def _version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"
