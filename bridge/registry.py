"""The internal kernel registry: func_name -> InternalKernelConfig.

A config says which kernel function implements a macro op and how the op's operands, results and attrs
become the kernel's call arguments. Parameter names of the kernel function name the binary's inputs and
outputs, so graph tensor names never reach a binary (the cache key does not include them either).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from bridge import dtypes
from bridge.errors import KernelCompileError, UnknownKernelError
from bridge.ir import view_shape


class TensorLike(Protocol):
    name: str
    shape: Sequence[int]
    dtype: str


class TensorSpec(msgspec.Struct, frozen=True):
    name: str
    shape: tuple[int, ...]
    dtype: str

    def as_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


class KernelCall(msgspec.Struct, frozen=True):
    """A kernel function with its marshalled arguments: the call_args and additional_args of the spec."""

    kernel_name: str
    kernel_func: Callable
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attrs: dict[str, Any]


Variant = tuple[str, Callable]


class InternalKernelConfig(msgspec.Struct, frozen=True):
    """How one func_name is compiled. `select` picks a variant of a family (conv2d_pbp_*) by shapes/attrs."""

    func_name: str
    kernel_name: str
    kernel_func: Callable
    attr_defaults: Mapping[str, Any] = msgspec.field(default_factory=dict)
    select: Callable[[tuple[TensorSpec, ...], tuple[TensorSpec, ...], dict], Variant] | None = None

    def marshal(self, operands: Sequence[TensorLike], results: Sequence[TensorLike], attrs: Mapping) -> KernelCall:
        operand_specs = tuple(_spec(t, self.func_name, "operand", i) for i, t in enumerate(operands))
        result_specs = tuple(_spec(t, self.func_name, "result", i) for i, t in enumerate(results))
        merged = {**self.attr_defaults, **dict(attrs)}
        kernel_name, kernel_func = (
            self.select(operand_specs, result_specs, merged) if self.select else (self.kernel_name, self.kernel_func)
        )
        tensor_params, attr_params = _parameters(kernel_func)
        expected = len(tensor_params) - len(result_specs)
        if len(operand_specs) != expected or expected < 0:
            raise KernelCompileError(
                f"{self.func_name} ({kernel_name}) takes {len(tensor_params)} tensors "
                f"({', '.join(tensor_params)}), got {len(operand_specs)} operands and {len(result_specs)} results"
            )
        unknown = sorted(set(merged) - set(attr_params))
        if unknown:
            raise KernelCompileError(
                f"{self.func_name} ({kernel_name}) has no attr {', '.join(map(repr, unknown))}; "
                f"known attrs: {', '.join(attr_params) or 'none'}"
            )
        renamed = [
            TensorSpec(param, spec.shape, spec.dtype)
            for param, spec in zip(tensor_params, operand_specs + result_specs, strict=True)
        ]
        return KernelCall(kernel_name, kernel_func, tuple(renamed[:expected]), tuple(renamed[expected:]), merged)


@functools.cache  # inspect.signature cost a warm pass a quarter of its time: every remote hit resolves its op
def _parameters(func: Callable) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tensor parameters, attr parameters): tensors are the parameters without defaults."""
    params = inspect.signature(func).parameters.values()
    return (
        tuple(p.name for p in params if p.default is p.empty),
        tuple(p.name for p in params if p.default is not p.empty),
    )


def _spec(tensor: TensorLike, func_name: str, role: str, index: int) -> TensorSpec:
    shape = view_shape(tensor)
    if not shape or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in shape):
        raise KernelCompileError(f"{func_name} {role} {index} ({tensor.name}) has invalid shape {list(shape)}")
    try:
        dtype = dtypes.check_dtype(tensor.dtype)
    except KernelCompileError as exc:
        raise KernelCompileError(f"{func_name} {role} {index} ({tensor.name}): {exc}") from None
    return TensorSpec(tensor.name, shape, dtype)


class KernelRegistry:
    """func_name -> InternalKernelConfig; `get` returns None for unknown names, as a dict does."""

    def __init__(self) -> None:
        self._configs: dict[str, InternalKernelConfig] = {}

    def register(self, config: InternalKernelConfig) -> InternalKernelConfig:
        if config.func_name in self._configs:
            raise ValueError(f"internal kernel {config.func_name!r} is registered twice")
        self._configs[config.func_name] = config
        return config

    def get(self, func_name: str) -> InternalKernelConfig | None:
        return self._configs.get(func_name)

    def names(self) -> list[str]:
        return sorted(self._configs)

    def resolve(self, func_name: str) -> InternalKernelConfig:
        config = self.get(func_name)
        if config is None:
            raise UnknownKernelError(
                f"no internal kernel is registered for func_name {func_name!r}; known: {', '.join(self.names())}"
            )
        return config
