"""Bounds on the work one graph can cause: elements per tensor and per graph (checked before any kernel is
traced) and instructions per kernel (checked as a kernel is traced).

A graph is untrusted input to a shared fleet: a softmax over 10^9 elements traces for minutes and takes
gigabytes, and one worker's out-of-memory kill must not be the price of a typo. The values come from the
caller (the settings live in cachestore, which bridge does not import); the defaults here are the
settings' defaults, for callers that give none.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import msgspec

from bridge.errors import NkiCacheError

if TYPE_CHECKING:  # bridge.graph imports this module
    from bridge.graph import Graph

DEFAULT_GRAPH_BYTES = 16 * 1024 * 1024
DEFAULT_TENSOR_ELEMENTS = 2**27  # 512 MiB of float32: larger than any tensor of the workload models by far
DEFAULT_GRAPH_ELEMENTS = 2**29
DEFAULT_KERNEL_INSTRUCTIONS = 1_000_000  # the BIR decoder refuses more than 5 M anyway


class LimitError(NkiCacheError):
    """A graph or a kernel exceeds a configured limit; the message names the graph, the op and the limit."""


class Limits(msgspec.Struct, frozen=True):
    max_graph_bytes: int = DEFAULT_GRAPH_BYTES
    max_tensor_elements: int = DEFAULT_TENSOR_ELEMENTS
    max_graph_elements: int = DEFAULT_GRAPH_ELEMENTS
    max_kernel_instructions: int = DEFAULT_KERNEL_INSTRUCTIONS


def check_graph(graph: Graph, limits: Limits) -> None:
    """Raise LimitError for the first op that reads or writes a tensor larger than max_tensor_elements, or
    whose tensors take the graph's total past max_graph_elements (each tensor counted once)."""
    counted: set[str] = set()
    total = 0
    for index, op in enumerate(graph.ops):
        where = f"{graph.source}: op {index} ({getattr(op, 'func_name', type(op).__name__)})"
        for tensor in (*op.operands, *op.results):
            elements = math.prod(tensor.shape)
            if elements > limits.max_tensor_elements:
                raise LimitError(
                    f"{where}: tensor {tensor.name!r} has {elements} elements, more than the limit "
                    f"max_tensor_elements = {limits.max_tensor_elements}"
                )
            if tensor.name not in counted:
                counted.add(tensor.name)
                total += elements
        if total > limits.max_graph_elements:
            raise LimitError(
                f"{where}: the graph's tensors reach {total} elements here, more than the limit "
                f"max_graph_elements = {limits.max_graph_elements}"
            )


_INSTRUCTIONS: contextvars.ContextVar[int] = contextvars.ContextVar(
    "max_kernel_instructions", default=DEFAULT_KERNEL_INSTRUCTIONS
)


@contextlib.contextmanager
def kernel_instruction_limit(limit: int) -> Iterator[None]:
    """Kernels traced inside this block may emit at most `limit` instructions each."""
    token = _INSTRUCTIONS.set(limit)
    try:
        yield
    finally:
        _INSTRUCTIONS.reset(token)


def max_kernel_instructions() -> int:
    """The instruction limit of a kernel traced now (see `kernel_instruction_limit`)."""
    return _INSTRUCTIONS.get()
