"""The compiler's identity: a fingerprint of everything that decides what binary a kernel compiles to.

A cached binary is only as good as the compiler that made it: after a change to a kernel's maths, the
kernel language, a frontend or the binary encoding, yesterday's binaries are wrong. Build caches that users
trust put the compiler's identity beside the key (sccache hashes the compiler, TorchInductor hashes its own
code generator); this is ours.

The fingerprint is computed from the code itself, never from a hand-bumped constant: the source of every
module a compile loads, found by following the imports of the codegen loop and the kernel library through
the `bridge` package (so a module added to the compile path is covered without anyone remembering to list
it), plus the versions of the libraries that shape a binary (numpy and ml_dtypes compute constants,
msgpack encodes BIR) and of Python (the beta3 frontend parses kernels with Python's own parser). Anything
else (docs, reports, the command line, cachestore, workers) can change without changing it.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import platform
from importlib import metadata
from pathlib import Path

PACKAGE = "bridge"
COMPILE_ROOTS = ("bridge.codegen", "bridge.kernels")  # the loop, and every kernel it can trace
LIBRARIES = ("numpy", "ml_dtypes", "msgpack")
FINGERPRINT_HEX_DIGITS = 16


def package_root() -> Path:
    return Path(__file__).resolve().parent


@functools.cache
def toolchain_id() -> str:
    """This compiler's identity: 16 hex digits of a SHA-256 over the compile path's sources and the versions
    of the libraries and the Python that shape its binaries."""
    return fingerprint(package_root())


def fingerprint(root: Path) -> str:
    """The identity of the `bridge` package whose source folder is `root` (tests fingerprint copies)."""
    digest = hashlib.sha256()
    for path in compile_sources(root):
        source = path.read_bytes()
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(source)}\0".encode())
        digest.update(source)
    for name in LIBRARIES:
        digest.update(f"{name}=={_version(name)}\0".encode())
    python = f"{platform.python_implementation()}-{'.'.join(platform.python_version_tuple()[:2])}"
    digest.update(f"python=={python}".encode())
    return digest.hexdigest()[:FINGERPRINT_HEX_DIGITS]


def compile_sources(root: Path) -> list[Path]:
    """The source files of every `bridge` module a compile loads: the closure of COMPILE_ROOTS' imports
    within the package (module-level and function-level imports alike), sorted."""
    seen: set[Path] = set()
    pending = [path for name in COMPILE_ROOTS for path in _module_files(root, name)]
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        pending.extend(_imported_files(root, path))
    return sorted(seen)


def _imported_files(root: Path, path: Path) -> list[Path]:
    files: list[Path] = []
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                files.extend(_module_files(root, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            files.extend(_module_files(root, node.module))
            # `from bridge import dtypes` and `from bridge.kernels import softmax` name modules, not attributes.
            for alias in node.names:
                files.extend(_module_files(root, f"{node.module}.{alias.name}"))
    return files


def _module_files(root: Path, module: str) -> list[Path]:
    """The file of `module` (and of each package on the way to it, which Python runs first), when it is in
    the `bridge` package."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return []
    files = []
    for depth in range(1, len(parts) + 1):
        base = root.joinpath(*parts[1:depth])
        for candidate in (base / "__init__.py", base.with_suffix(".py")):
            if candidate.is_file():
                files.append(candidate)
                break
    return files


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"
