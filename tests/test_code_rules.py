"""Rules about the product code itself, checked on its syntax trees."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers_code import ROOT, product_modules


def product_lines(find: Callable[[ast.Module], list[int]]) -> list[str]:
    """`path:line` of every line `find` reports in a product module's syntax tree."""
    return [
        f"{path.relative_to(ROOT)}:{line}" for path in product_modules() for line in find(ast.parse(path.read_text()))
    ]


def is_sorted_items_text(node: ast.AST) -> bool:
    """`str(sorted(X.items()))`: the key rule's canonical text."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "str"
        and len(node.args) == 1
        and isinstance(sorted_call := node.args[0], ast.Call)
        and isinstance(sorted_call.func, ast.Name)
        and sorted_call.func.id == "sorted"
        and len(sorted_call.args) == 1
        and isinstance(items := sorted_call.args[0], ast.Call)
        and isinstance(items.func, ast.Attribute)
        and items.func.attr == "items"
    )


def test_the_key_rule_is_written_once() -> None:
    writers = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in product_modules()
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if is_sorted_items_text(node)
    ]
    assert writers == ["bridge/key_rule.py:15"], writers


@pytest.mark.parametrize("source", ["str(sorted(parts.items()))", "x = h(str(sorted(c.items())).encode())"])
def test_the_rule_check_sees_a_copy(source: str) -> None:
    assert any(is_sorted_items_text(node) for node in ast.walk(ast.parse(source)))


def test_the_loop_and_the_fingerprints_hash_the_same_text() -> None:
    from bridge.codegen import BirCodeGenLoop
    from bridge.key_rule import key_digest
    from bridge.miss_causes import variant_fingerprints
    from bridge.targets import make_target

    loop = BirCodeGenLoop(make_target("Trn2"))
    components = {"kernel_name": "k", "shapes": ((4, 4),), "dtypes": ("float32",), "attrs": ()}
    key = loop._compute_cache_key_from_components(dict(components))
    assert key == key_digest(
        {**components, "target": "Trn2", "num_neuroncores": loop.target.num_neuroncores_per_sengine}
    )
    without_attrs = {name: value for name, value in components.items() if name != "attrs"}
    assert variant_fingerprints(components).shapes == key_digest(without_attrs)[:16]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.Module, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The product modules `tree` imports, at module level or inside functions alike (not those imported only
    for type checking, under `if TYPE_CHECKING:`, which never run)."""
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for node in ast.walk(block)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            # `from P import N`: the submodule P.N when there is one, else a name of P's __init__.
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return (found & known) - {module}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in product_modules()}
    known = set(paths)
    return {
        name: imported_modules(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
        for name, path in paths.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_among_product_modules() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_an_import_inside_a_function() -> None:
    tree = ast.parse("def f():\n    from cachestore import api\n")
    graph = {"a": imported_modules(tree, "a", False, {"a", "cachestore.api", "cachestore"}), "cachestore.api": {"a"}}
    assert cycles({**graph, "cachestore": set()}) == [["a", "cachestore.api"]]


STORE_NAME = ("store", "reader", "tier", "level", "backend")
PROBES = ("getattr", "hasattr", "setattr")  # setattr: a method patched by name is a probe too


def probes(tree: ast.Module) -> list[int]:
    """Lines of getattr/hasattr/setattr calls on a store, reader, tier, level or backend (by the name it goes by)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES:
            target = node.args[0] if node.args else None
            name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            if name.lower().lstrip("_").endswith(STORE_NAME):
                found.append(node.lineno)
    return found


def test_no_store_ability_is_probed() -> None:
    """Optional abilities of a store are declared in the contract with defaults (cachestore.api, bridge.port)."""
    assert product_lines(probes) == []


@pytest.mark.parametrize(
    "source",
    ["getattr(reader, 'splits_scans', False)", "hasattr(self._backend, 'x')", "setattr(tier, 'flush', timed)"],
)
def test_the_probe_check_sees_one(source: str) -> None:
    assert probes(ast.parse(source))


def read_only_asks(tree: ast.Module) -> list[int]:
    """Lines comparing something with "read-only", or setting tier_mode to it to borrow what it implies."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.keyword) and node.arg == "tier_mode":
            operands = [node.value]
        else:
            continue
        if any(isinstance(operand, ast.Constant) and operand.value == "read-only" for operand in operands):
            found.append(node.lineno)
    return found


def test_read_only_is_asked_in_one_place() -> None:
    """Settings.read_only answers it; the compile path's answer is the ReadOnlyTier wrapper (cachestore.read_only)."""
    asks = product_lines(read_only_asks)
    settings = ast.parse((ROOT / "cachestore" / "settings.py").read_text())
    [answer] = [node for node in ast.walk(settings) if isinstance(node, ast.FunctionDef) and node.name == "read_only"]
    assert asks == [f"cachestore/settings.py:{answer.body[-1].lineno}"], asks  # its return statement


@pytest.mark.parametrize(
    "source", ["settings.tier_mode == 'read-only'", "'read-only' != mode", "s.replace(tier_mode='read-only')"]
)
def test_the_read_only_check_sees_one(source: str) -> None:
    assert read_only_asks(ast.parse(source))


def test_the_formatter_formats_product_code() -> None:
    """`# fmt: skip` only where a table would lose its meaning: at most 30 in product code."""
    skips = sum(path.read_text().count("# fmt: skip") for path in product_modules())
    assert skips <= 30, skips


# What redis-py objects go by in product code: a private name on one of them breaks when redis-py renames it.
REDIS_OBJECT = ("redis", "client", "connection", "conn", "pool", "pipe", "pipeline", "parser", "raw")


def redis_private_uses(tree: ast.Module) -> list[int]:
    """Lines that import a private redis-py module or read a private attribute (`_name`, not a dunder; directly
    or by getattr) of an object named like a redis-py client, connection, pool, pipeline or parser."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("redis."):
            if any(part.startswith("_") for part in node.module.split(".")):
                found.append(node.lineno)
        elif isinstance(node, ast.Import):
            if any(alias.name.startswith("redis.") and "._" in alias.name for alias in node.names):
                found.append(node.lineno)
        elif (owner_attr := _attribute_read(node)) is not None:
            owner, attr = owner_attr
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            private = attr.startswith("_") and not attr.startswith("__")
            if private and name.lower().lstrip("_").endswith(REDIS_OBJECT):
                found.append(node.lineno)
    return found


def _attribute_read(node: ast.AST) -> tuple[ast.expr, str] | None:
    """(owner, name) of `owner.name` or `getattr(owner, "name"[, default])`, else None."""
    if isinstance(node, ast.Attribute):
        return node.value, node.attr
    is_getattr = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
    if is_getattr and len(node.args) >= 2 and isinstance(name := node.args[1], ast.Constant):
        return (node.args[0], name.value) if isinstance(name.value, str) else None
    return None


def test_no_private_name_of_redis_py_is_used() -> None:
    """redis-py is used through its public API (`redis[hiredis]` has no upper bound in pyproject.toml)."""
    assert product_lines(redis_private_uses) == []


@pytest.mark.parametrize(
    "source",
    [
        "from redis._parsers import _HiredisParser",
        "import redis._parsers.hiredis",
        "self.client.connection_pool._available_connections",
        "connection._parser._buffer",
        "pipe._command_stack",
        'getattr(connection, "_parser", None)',
    ],
)
def test_the_private_name_check_sees_one(source: str) -> None:
    assert redis_private_uses(ast.parse(source))


# Benchmarks and dev tools are the checkout's bench/ package, which no wheel ships (issue 47).
DEV_PACKAGE = "bench"
DEV_TOOLS = ("dev_redis", "trickle_proxy")  # a throwaway redis-server, a proxy that trickles replies


def dev_imports(tree: ast.Module) -> list[int]:
    """Lines that import the dev package or a module of it (at module level or in a function alike, or by
    importlib.import_module with the name written out)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            names = [arg.value for arg in node.args[:1] if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
        else:
            continue
        if any(name == DEV_PACKAGE or name.startswith(f"{DEV_PACKAGE}.") for name in names):
            found.append(node.lineno)
    return found


def is_dev_tool(path: Path) -> bool:
    """A product file named as a benchmark (a `bench` in any part of its path) or as one of the dev tools."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return any("bench" in part.lower() for part in parts) or parts[-1] in DEV_TOOLS


def test_no_benchmark_or_dev_tool_ships_in_the_product() -> None:
    """No module of bridge, cachestore or workers is a benchmark or a dev tool, or imports one; `nkicache bench`
    names its module as text (workers/cli.py DEV_COMMANDS), loaded from a source checkout only. And pyproject.toml
    packages no dev package."""
    import tomllib

    named = [str(path.relative_to(ROOT)) for path in product_modules() if is_dev_tool(path)]
    importing = product_lines(dev_imports)
    assert (named, importing) == ([], [])
    packaged = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not [pattern for pattern in packaged if pattern.startswith(DEV_PACKAGE)], packaged


@pytest.mark.parametrize(
    "source",
    [
        "from bench.figures import GOALS",
        "import bench.dev_redis",
        "def f():\n    from bench import figures\n",
        "importlib.import_module('bench.cli')",
    ],
)
def test_the_dev_import_check_sees_one(source: str) -> None:
    assert dev_imports(ast.parse(source))


@pytest.mark.parametrize("path", ["workers/bench/figures.py", "workers/dev_redis.py", "cachestore/benchmarks.py"])
def test_the_dev_tool_check_sees_one(path: str) -> None:
    assert is_dev_tool(ROOT / path)


def test_the_dev_checks_pass_product_code_by() -> None:
    assert dev_imports(ast.parse("from bridge.miss_causes import variant_fingerprints\nimport benchmark_tools")) == []
    assert not is_dev_tool(ROOT / "bridge" / "miss_causes.py")
