"""What the toolchain id (bridge.identity) is computed from: the `bridge` modules a compile loads, found by
following imports from its roots, and what each one means (its syntax tree without docstrings). Imported only
when the id is computed, not when it is remembered: parsing is most of that cost.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

PACKAGE = "bridge"


def closure(root: Path, roots: Sequence[str]) -> dict[Path, ast.Module]:
    """Every `bridge` module file that importing `roots` loads (module-level and function-level imports alike),
    with its parsed syntax tree; `root` is the package's source folder."""
    trees: dict[Path, ast.Module] = {}
    pending = [path for name in roots for path in module_files(root, name)]
    while pending:
        path = pending.pop()
        if path in trees:
            continue
        trees[path] = ast.parse(path.read_bytes(), filename=str(path))
        pending.extend(_imported_files(root, trees[path]))
    return trees


def meaning_of(tree: ast.Module) -> bytes:
    """What a module means: its syntax tree, docstrings removed, dumped (comments, formatting and line numbers
    are not in it)."""
    return ast.dump(_without_docstrings(tree)).encode()


def _imported_files(root: Path, tree: ast.Module) -> list[Path]:
    files: list[Path] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                files.extend(module_files(root, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            files.extend(module_files(root, node.module))
            # `from bridge import dtypes` and `from bridge.kernels import softmax` name modules, not attributes.
            for alias in node.names:
                files.extend(module_files(root, f"{node.module}.{alias.name}"))
    return files


def _without_docstrings(tree: ast.Module) -> ast.Module:
    """`tree` with the docstring of the module and of every class and function removed (in place: each tree
    is dumped once). A docstring is documentation; any other string in the code stays."""
    documented = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, documented) and node.body and _is_docstring(node.body[0]):
            node.body = node.body[1:] or [ast.Pass()]
    return tree


def _is_docstring(statement: ast.stmt) -> bool:
    value = statement.value if isinstance(statement, ast.Expr) else None
    return isinstance(value, ast.Constant) and isinstance(value.value, str)


def module_files(root: Path, module: str) -> list[Path]:
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
