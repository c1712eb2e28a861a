"""Product code (bridge, cachestore, workers) uses redis-py through its public API only: no private module, no
name with a leading underscore imported from it, and no `_`-prefixed attribute of a redis-py module or object,
read as `x._name` or by `getattr(x, "_name")`. A private name can change in any redis-py release."""

from __future__ import annotations

import ast

import pytest
from helpers_code import ROOT, product_modules

# Names under which product code holds redis-py objects (clients, pools, connections, pipelines, parsers).
REDIS_HOLDERS = {"client", "connection_pool", "pool", "connection", "pipe", "pipeline", "parser", "nodes_manager"}
REACHING = {"getattr", "hasattr", "setattr", "delattr"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _redis_module(module: str) -> bool:
    return module.split(".")[0] in ("redis", "hiredis")


def _chain(node: ast.expr) -> list[str]:
    """The names along an expression's attribute chain, calls and subscripts looked through: `a.b(c).d` is
    [a, b, d]."""
    names: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        elif isinstance(node, (ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        elif isinstance(node, ast.Name):
            names.append(node.id)
            return names[::-1]
        else:
            return names[::-1]


def private_redis_uses(source: str) -> list[str]:
    """Each use of a redis-py private name in `source`, as `line: code`."""
    tree = ast.parse(source)
    aliases: set[str] = set()  # local names bound to redis-py modules or to names imported from them
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _redis_module(alias.name):
                    aliases.add((alias.asname or alias.name).split(".")[0])
                    if any(_private(part) for part in alias.name.split(".")):
                        found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and _redis_module(node.module or ""):
            aliases.update(alias.asname or alias.name for alias in node.names)
            private_module = any(_private(part) for part in (node.module or "").split("."))
            if private_module or any(_private(alias.name) for alias in node.names):
                found.append((node.lineno, ast.unparse(node)))

    def from_redis(node: ast.expr) -> bool:
        chain = _chain(node)
        if not chain or (chain[0] in ("self", "cls") and len(chain) == 1):
            return False
        return chain[0] in aliases or any(name in REDIS_HOLDERS for name in chain)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and from_redis(node.value):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REACHING:
            # A private name reached by string on anything but the object itself: another object's internals.
            owner, named = [*node.args, None, None][:2]
            own = isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            if isinstance(named, ast.Constant) and isinstance(named.value, str) and _private(named.value) and not own:
                found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {code}" for line, code in sorted(found)]


def test_product_code_uses_no_private_name_of_redis_py() -> None:
    uses = {str(path.relative_to(ROOT)): private_redis_uses(path.read_text()) for path in product_modules()}
    assert {path: found for path, found in uses.items() if found} == {}


@pytest.mark.parametrize(
    "source",
    [
        "from redis._parsers.hiredis import NOT_ENOUGH_DATA",
        "from redis.connection import _HiredisParser",
        "import redis._parsers",
        "import redis\nredis._parsers.hiredis",
        "import redis\nredis.Redis.from_url(url)._something",
        "from redis.cluster import RedisCluster\nRedisCluster(startup_nodes=[])._nodes",
        "self.client.connection_pool._available_connections",
        "pool = client.connection_pool\npool._in_use_connections",
        "getattr(connection, '_parser', None)",
        "hasattr(parser, '_reader')",
    ],
)
def test_the_scan_finds_a_private_name_however_it_is_reached(source: str) -> None:
    assert private_redis_uses(source)


@pytest.mark.parametrize(
    "source",
    [
        "from redis.connection import URL_QUERY_ARGUMENT_PARSERS",
        "import redis\nredis.Redis.from_url(url).connection_pool.disconnect()",
        "self._call(lambda: self.client.getrange(key, 0, 9))",
        "tier._backend.scan_entries()",  # the project's own names
        "getattr(self, '_shards', None)",
        "self.client.__class__",
    ],
)
def test_the_scan_lets_public_names_and_the_projects_own_through(source: str) -> None:
    assert private_redis_uses(source) == []
