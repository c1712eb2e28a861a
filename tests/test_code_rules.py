"""Rules about the product code itself, checked on its syntax trees."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("bridge", "cachestore", "workers")


def product_modules() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))


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
