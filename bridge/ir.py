"""The macro-graph IR the codegen loop walks, and the BIR instructions it emits.

Macro ops: `InternalNkiKernel` (re-traced through the NKI frontend, cached) and a few ordinary elementwise
ops (lowered directly, no cache). BIR side: a `BasicBlock` of `BirElementwise` and `NKIKLIRKernel`
instructions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class Tensor:
    """A graph tensor. Reading `.access_shape` raises AttributeError when none was given, so callers can
    prefer the access pattern and fall back to the raw shape, as the specification's key builder does."""

    def __init__(self, name: str, shape: Sequence[int], dtype: str, access_shape: Sequence[int] | None = None):
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        if access_shape is not None:
            self.access_shape = tuple(access_shape)

    def __repr__(self) -> str:
        extra = f", access_shape={list(self.access_shape)}" if hasattr(self, "access_shape") else ""
        return f"Tensor({self.name!r}, {list(self.shape)}, {self.dtype!r}{extra})"


def view_shape(tensor: Any) -> tuple[int, ...]:
    """The shape a kernel sees: access_shape when the tensor has one, else shape (the key builder's
    preference; codegen spells it out inline, as the specification does)."""
    try:
        return tuple(tensor.access_shape)
    except AttributeError:
        return tuple(tensor.shape)


def freeze_attr(value: Any) -> Any:
    """Lists become tuples and mappings are ordered by key, so an attr reads the same whether it came from
    JSON or from Python, in whatever order it was written; the cache key stringifies attrs (the spec sorts
    only the top-level items), and "[1, 2]" and "(1, 2)" would otherwise be two keys for one variant."""
    if isinstance(value, list | tuple):
        return tuple(freeze_attr(v) for v in value)
    if isinstance(value, Mapping):
        return {k: freeze_attr(value[k]) for k in sorted(value, key=str)}
    return value


def freeze_key_components(key_components: Mapping[str, Any]) -> dict[str, Any]:
    """Key components as the loop builds them, from a stored copy: msgpack and JSON bring its tuples back
    as lists, and str() of the components, which the key hashes, tells a list from a tuple."""
    frozen: dict[str, Any] = {}
    for name, value in key_components.items():
        if name in ("operands", "results") and isinstance(value, Mapping):
            frozen[name] = {
                part: [tuple(s) for s in items] if part == "shapes" else list(items) for part, items in value.items()
            }
        elif name == "attrs" and isinstance(value, Mapping):
            frozen[name] = {attr: freeze_attr(v) for attr, v in value.items()}
        elif name == "out_shape" and isinstance(value, list | tuple):
            frozen[name] = tuple(value)
        else:
            frozen[name] = value
    return frozen


class InternalNkiKernel:
    """A macro op implemented by an internal NKI kernel that codegen re-traces."""

    def __init__(
        self,
        func_name: str,
        kernel_name: str,
        operands: Sequence[Tensor],
        results: Sequence[Tensor],
        attrs: Mapping[str, Any] | None = None,
    ):
        self.func_name = func_name
        self.kernel_name = kernel_name
        self.operands = list(operands)
        self.results = list(results)
        # In name order, as a compiler op's attributes come in a fixed order: a graph file may list them in
        # any order, and str() of the attrs dict is part of the cache key.
        self.attrs = freeze_attr(dict(attrs or {}))

    def get_attrs_dict(self) -> dict[str, Any]:
        return dict(self.attrs)

    def __repr__(self) -> str:
        return f"InternalNkiKernel({self.func_name!r}, {self.kernel_name!r})"


class MacroOp:
    """An ordinary elementwise macro op; subclasses name the operation."""

    arity = 2

    def __init__(self, operands: Sequence[Tensor], results: Sequence[Tensor]):
        self.operands = list(operands)
        self.results = list(results)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({[t.name for t in self.operands]} -> {[t.name for t in self.results]})"


class Add(MacroOp):
    arity = 2


class Multiply(MacroOp):
    arity = 2


class Relu(MacroOp):
    arity = 1


class Copy(MacroOp):
    arity = 1


ORDINARY_OPS: dict[str, type[MacroOp]] = {cls.__name__: cls for cls in (Add, Multiply, Relu, Copy)}


class BirElementwise:
    """The BIR instruction an ordinary op lowers to."""

    def __init__(self, op: str, operands: Sequence[str], results: Sequence[str]):
        self.op = op
        self.operands = list(operands)
        self.results = list(results)

    def __repr__(self) -> str:
        return f"BirElementwise({self.op!r}, {self.operands} -> {self.results})"


class NKIKLIRKernel:
    """The BIR instruction that carries a traced kernel binary; `operands`/`results` name the graph tensors
    bound, in order, to the binary's func_args/func_outs."""

    def __init__(self, name: str, operands: Sequence[str] = (), results: Sequence[str] = ()):
        self.name = name
        self.operands = list(operands)
        self.results = list(results)
        self.klir_binary: bytes = b""
        self.kernel_format: str = ""
        self.nki_binary_version_identifier: str = ""
        self.func_args: list[str] = []
        self.func_outs: list[str] = []

    def set_klir_binary(self, binary: bytes) -> None:
        self.klir_binary = binary

    def set_kernel_format(self, kernel_format: str) -> None:
        self.kernel_format = kernel_format

    def set_nki_binary_version_identifier(self, identifier: str) -> None:
        self.nki_binary_version_identifier = identifier

    def set_func_args(self, names: Sequence[str]) -> None:
        self.func_args = list(names)

    def set_func_outs(self, names: Sequence[str]) -> None:
        self.func_outs = list(names)

    def __repr__(self) -> str:
        return f"NKIKLIRKernel({self.name!r}, {self.kernel_format}, {len(self.klir_binary)} bytes)"


class BasicBlock:
    """An ordered list of BIR instructions."""

    def __init__(self, name: str = "entry"):
        self.name = name
        self.instructions: list[BirElementwise | NKIKLIRKernel] = []

    def addInstruction(self, inst: BirElementwise | NKIKLIRKernel) -> None:
        self.instructions.append(inst)
