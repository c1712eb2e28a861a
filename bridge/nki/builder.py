"""Collects the instructions of one kernel being compiled.

Both frontends drive the same builder: the AST frontend (beta3) while it interprets the kernel source, the
tracer (beta2) while it runs the kernel function. The language functions find it through `active()`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

from bridge import dtypes
from bridge.errors import HardwareLimitError, KernelCompileError
from bridge.limits import LimitError, max_kernel_instructions
from bridge.nki import isa
from bridge.nki.values import HBMTensor, RuntimeScalar, Tile
from bridge.targets import Target

_ACTIVE: contextvars.ContextVar[KernelBuilder | None] = contextvars.ContextVar("nki_builder", default=None)


class KernelBuilder:
    """The instruction list, buffers and registers of one kernel specialization."""

    def __init__(self, kernel_name: str, target: Target):
        self.kernel_name = kernel_name
        self.target = target
        self.inputs: list[HBMTensor] = []
        self.outputs: list[HBMTensor] = []
        self.buffers: list[list] = []  # [shape, dtype, space]
        self.registers = 0
        self.instructions: list[list] = []
        self.max_instructions = max_kernel_instructions()

    # -- kernel arguments -------------------------------------------------------------------------
    def add_tensor(self, name: str, shape: tuple[int, ...], dtype: str, *, is_output: bool) -> HBMTensor:
        tensor = HBMTensor(
            name, tuple(shape), dtypes.check_dtype(dtype), len(self.inputs) + len(self.outputs), is_output
        )
        if is_output:
            self.outputs.append(tensor)
        else:
            if self.outputs:
                raise KernelCompileError("inputs must be declared before outputs")
            self.inputs.append(tensor)
        return tensor

    # -- storage ----------------------------------------------------------------------------------
    def new_tile(self, shape: tuple[int, ...], dtype: str, space: str = "sbuf") -> Tile:
        shape = tuple(shape)
        dtype = dtypes.check_dtype(dtype)
        check_tile_shape(shape, dtype, space, self.target)
        self.buffers.append([list(shape), dtype, space])
        return Tile(len(self.buffers) - 1, tuple((0, n, 1) for n in shape), dtype, space)

    def new_register(self) -> RuntimeScalar:
        self.registers += 1
        return RuntimeScalar(self.registers - 1)

    def emit(self, *instruction: object) -> None:
        self.instructions.append(list(instruction))
        if len(self.instructions) > self.max_instructions:  # stop tracing now, not after millions more
            raise LimitError(
                f"kernel {self.kernel_name!r} emits more than {self.max_instructions} instructions, the limit "
                "max_kernel_instructions"
            )

    # -- activation -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def activate(self) -> Iterator[KernelBuilder]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


def active() -> KernelBuilder:
    builder = _ACTIVE.get()
    if builder is None:
        raise KernelCompileError("nki.language functions work only inside a kernel being compiled")
    return builder


def check_tile_shape(shape: tuple[int, ...], dtype: str, space: str, target: Target) -> None:
    """The hardware limits every on-chip tile obeys; shared with the binary validator."""
    if space not in isa.BUFFER_SPACES:
        raise KernelCompileError(f"unknown buffer {space!r}; tiles live in {' or '.join(isa.BUFFER_SPACES)}")
    if len(shape) < 1 or any(not isinstance(n, int) or n < 1 for n in shape):
        raise KernelCompileError(f"a tile shape needs positive int dims, got {list(shape)}")
    if shape[0] > isa.PARTITION_MAX:
        raise HardwareLimitError(
            f"tile {list(shape)} has partition dim {shape[0]} > {isa.PARTITION_MAX} (partition limit)"
        )
    free = math.prod(shape[1:])
    if space == "psum":
        if dtype != "float32":
            raise HardwareLimitError(f"PSUM tiles hold float32, got {dtype}")
        if free > isa.PSUM_FREE_MAX:
            raise HardwareLimitError(
                f"PSUM tile {list(shape)} has free size {free} > {isa.PSUM_FREE_MAX} float32 (PSUM limit)"
            )
    elif free * dtypes.ITEM_BYTES[dtype] > target.sbuf_partition_bytes:
        raise HardwareLimitError(
            f"SBUF tile {list(shape)} {dtype} needs {free * dtypes.ITEM_BYTES[dtype]} bytes per partition "
            f"> {target.sbuf_partition_bytes} (SBUF partition size)"
        )


def check_matmul_shapes(x: tuple[int, ...], y: tuple[int, ...], transpose_x: bool) -> tuple[int, int]:
    """(M, N) of a matmul, enforcing the PE array limits; shared with the binary validator."""
    if len(x) != 2 or len(y) != 2:
        raise KernelCompileError(f"matmul takes 2-D tiles, got {list(x)} and {list(y)}")
    k_x, m = (x[0], x[1]) if transpose_x else (x[1], x[0])
    k_y, n = y
    if k_x != k_y:
        raise KernelCompileError(f"matmul contraction mismatch: x {list(x)} vs y {list(y)} (transpose_x={transpose_x})")
    if k_x > isa.PARTITION_MAX:
        raise HardwareLimitError(f"matmul contraction {k_x} > {isa.PARTITION_MAX} (partition limit)")
    if m > isa.MATMUL_STATIONARY_FREE_MAX:
        raise HardwareLimitError(
            f"matmul stationary free size {m} > {isa.MATMUL_STATIONARY_FREE_MAX} (stationary limit)"
        )
    if n > isa.MATMUL_MOVING_FREE_MAX:
        raise HardwareLimitError(f"matmul moving free size {n} > {isa.MATMUL_MOVING_FREE_MAX} (moving limit)")
    return m, n
