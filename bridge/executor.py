"""Runs a `Program` on numpy arrays.

Loading a program validates every instruction against the instruction set and the hardware limits before
anything runs, and turns each into a closure; running walks the closures. Buffers are created at their
first use filled with NaN (the most negative int32 for int tiles) so that reading memory nobody wrote
shows in the result, and dropped after their last use so long unrolled kernels stay small in memory.
Matmuls accumulate in float32; elementwise math runs in float32 and is cast to the result's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from bridge import dtypes
from bridge.errors import BinaryFormatError, KernelCompileError, KernelRuntimeError
from bridge.nki import isa
from bridge.nki.builder import check_matmul_shapes, check_tile_shape
from bridge.program import Program
from bridge.targets import TARGETS

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

INT_POISON = np.iinfo(np.int32).min

_UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    # The tanh approximation, as the hardware's activation table computes it.
    "gelu": lambda x: 0.5 * x * (1.0 + np.tanh(np.float32(0.7978845608) * (x + np.float32(0.044715) * x**3))),
    "relu": lambda x: np.maximum(x, 0),
    "negative": np.negative,
    "abs": np.abs,
    "square": np.square,
    "reciprocal": lambda x: 1.0 / x,
}
_BINARY: dict[str, Callable] = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "divide": np.divide,
    "maximum": np.maximum,
    "minimum": np.minimum,
}
_REDUCE: dict[str, Callable] = {"sum": np.sum, "max": np.max, "min": np.min, "mean": np.mean}


class _Machine(msgspec.Struct):
    """The state of one run: buffers, registers, argument tensors."""

    buffers: list[np.ndarray | None]
    registers: list[int | None]
    tensors: list[np.ndarray]


Step = Callable[[_Machine], None]


class LoadedProgram:
    """A validated program, ready to run any number of times."""

    def __init__(self, program: Program):
        self.program = program
        self.inputs = [_tensor_spec(spec, f"input {i}") for i, spec in enumerate(program.inputs)]
        self.outputs = [_tensor_spec(spec, f"output {i}") for i, spec in enumerate(program.outputs)]
        if not isinstance(program.target, str) or program.target not in TARGETS:
            raise BinaryFormatError(f"binary names unknown target {program.target!r}")
        target = TARGETS[program.target]()
        self.buffers = [_buffer_spec(spec, i, target) for i, spec in enumerate(program.buffers)]
        if not 0 <= program.registers <= len(program.code):
            raise BinaryFormatError(f"register count {program.registers} is out of range")
        self._last_use: dict[int, int] = {}
        self.steps = [self._prepare(i, instruction) for i, instruction in enumerate(program.code)]
        self._release_after: list[list[int]] = [[] for _ in self.steps]
        for buf, index in self._last_use.items():
            self._release_after[index].append(buf)

    # -- running ----------------------------------------------------------------------------------
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensors = [self._bind_input(name, shape, dtype, inputs) for name, shape, dtype in self.inputs]
        outputs = [_poisoned(shape, dtype) for _, shape, dtype in self.outputs]
        machine = _Machine([None] * len(self.buffers), [None] * self.program.registers, tensors + outputs)
        with np.errstate(all="ignore"):
            for index, step in enumerate(self.steps):
                try:
                    step(machine)
                except KernelRuntimeError as exc:
                    raise KernelRuntimeError(
                        f"kernel {self.program.kernel}, instruction {index} ({self.program.code[index][0]}): {exc}"
                    ) from None
                for buf in self._release_after[index]:
                    machine.buffers[buf] = None
        return {name: array for (name, _, _), array in zip(self.outputs, outputs, strict=True)}

    def _bind_input(self, name: str, shape: tuple, dtype: str, inputs: dict[str, np.ndarray]) -> np.ndarray:
        if name not in inputs:
            raise KernelRuntimeError(f"kernel {self.program.kernel} needs input {name!r}; given {sorted(inputs)}")
        array = np.asarray(inputs[name])
        if array.shape != shape:
            raise KernelRuntimeError(
                f"kernel {self.program.kernel} input {name!r} has shape {list(array.shape)}, expected {list(shape)}"
            )
        return np.ascontiguousarray(array, dtype=dtypes.to_numpy(dtype))

    # -- validation and closure building ----------------------------------------------------------
    def _prepare(self, index: int, instruction: object) -> Step:
        if not isinstance(instruction, list) or not instruction or instruction[0] not in isa.OPCODES:
            head = instruction[0] if isinstance(instruction, list) and instruction else instruction
            raise BinaryFormatError(f"instruction {index}: unknown opcode {head!r}")
        self._index = index
        try:
            return getattr(self, f"_op_{instruction[0]}")(*instruction[1:])
        except BinaryFormatError as exc:
            raise BinaryFormatError(f"instruction {index} ({instruction[0]}): {exc}") from None
        except KernelCompileError as exc:  # a hardware limit broken by the binary
            raise BinaryFormatError(f"instruction {index} ({instruction[0]}): {exc}") from None
        except TypeError as exc:  # wrong number of fields
            raise BinaryFormatError(f"instruction {index} ({instruction[0]}): malformed fields ({exc})") from None

    def _tile(self, ref: object) -> tuple[int, tuple[slice, ...], tuple[int, ...], str, str]:
        """(buf, numpy index, shape, dtype, space) of a tile ref, bounds-checked."""
        if not (isinstance(ref, list) and len(ref) == 2 and isinstance(ref[1], list)):
            raise BinaryFormatError(f"bad tile ref {ref!r}")
        buf = _int(ref[0], "buffer id")
        if not 0 <= buf < len(self.buffers):
            raise BinaryFormatError(f"buffer {buf} does not exist")
        shape, dtype, space = self.buffers[buf]
        index, sizes = _region(ref[1], shape, f"buffer {buf}")
        self._last_use[buf] = self._index
        return buf, index, sizes, dtype, space

    def _operand(self, operand: object) -> tuple[Callable[[_Machine], ArrayLike], tuple[int, ...], bool]:
        """(fetch, shape, is_integral) of an operand."""
        if not isinstance(operand, list) or not operand:
            raise BinaryFormatError(f"bad operand {operand!r}")
        if operand[0] == "c" and len(operand) == 2 and _is_number(operand[1]):
            value = operand[1]
            return (lambda m: value), (), isinstance(value, int)
        if operand[0] == "r" and len(operand) == 2:
            reg = self._register(operand[1])
            return (lambda m: _read_register(m, reg)), (), True
        if operand[0] == "t" and len(operand) == 3:
            buf, index, shape, dtype, _ = self._tile(operand[1:])
            fetch = self._reader(buf, index, dtype)
            return fetch, shape, dtype == "int32"
        raise BinaryFormatError(f"bad operand {operand!r}")

    def _register(self, value: object) -> int:
        reg = _int(value, "register")
        if not 0 <= reg < self.program.registers:
            raise BinaryFormatError(f"register {reg} does not exist")
        return reg

    def _reader(self, buf: int, index: tuple, dtype: str) -> Callable[[_Machine], np.ndarray]:
        full_shape = self.buffers[buf][0]

        def read(m: _Machine) -> np.ndarray:
            target = m.buffers[buf]
            if target is None:  # read before any write: the poison shows in the result
                target = m.buffers[buf] = _poisoned(full_shape, dtype)
            return target[index]

        return read

    def _writer(self, ref: object) -> tuple[Callable[[_Machine, ArrayLike], None], tuple[int, ...], str, str]:
        buf, index, shape, dtype, space = self._tile(ref)
        full_shape = self.buffers[buf][0]

        def write(m: _Machine, value: ArrayLike) -> None:
            target = m.buffers[buf]
            if target is None:
                target = m.buffers[buf] = _poisoned(full_shape, dtype)
            # The numpy dtype when the program runs, not when it is loaded: a trace validates its binary by loading
            # it, and bfloat16's dtype would import ml_dtypes (0.6-0.8 s) into every process that traces.
            target[index] = np.broadcast_to(value, shape).astype(dtypes.to_numpy(dtype), copy=False)

        return write, shape, dtype, space

    def _access(self, access: object, *, for_store: bool) -> tuple[Callable, Callable, tuple[int, ...], int]:
        """(read, write, shape, tensor id) of an HBM access; runtime indices are bounds-checked."""
        if not (isinstance(access, list) and len(access) == 2 and isinstance(access[1], list)):
            raise BinaryFormatError(f"bad HBM access {access!r}")
        tensor_id = _int(access[0], "tensor id")
        specs = self.inputs + self.outputs
        if not 0 <= tensor_id < len(specs):
            raise BinaryFormatError(f"tensor {tensor_id} does not exist")
        if for_store and tensor_id < len(self.inputs):
            raise BinaryFormatError(f"store into input tensor {specs[tensor_id][0]!r}")
        name, tensor_shape, _ = specs[tensor_id]
        if len(access[1]) != len(tensor_shape):
            raise BinaryFormatError(f"access into {name!r} has {len(access[1])} indices for rank {len(tensor_shape)}")
        resolvers: list[Callable[[_Machine], object]] = []
        shape: list[int] = []
        gather: tuple | None = None
        for axis, (entry, size) in enumerate(zip(access[1], tensor_shape, strict=True)):
            resolver, dims, entry_gather = self._access_entry(entry, size, axis, name)
            if entry_gather is not None:
                if gather is not None:
                    raise BinaryFormatError(f"access into {name!r} has more than one gather")
                gather = (len(shape), *entry_gather)
            resolvers.append(resolver)
            shape.extend(dims)
        return (*_access_closures(tensor_id, resolvers, gather), tuple(shape), tensor_id)

    def _access_entry(self, entry: object, size: int, axis: int, name: str):
        if not isinstance(entry, list) or not entry:
            raise BinaryFormatError(f"bad index entry {entry!r} into {name!r}")
        kind = entry[0]
        if kind == "s" and len(entry) == 4:
            (index,), (length,) = _region([entry[1:]], (size,), name)
            return (lambda m: index), [length], None
        if kind == "i" and len(entry) == 2:
            value = _int(entry[1], "index")
            if not 0 <= value < size:
                raise BinaryFormatError(f"index {value} out of range for axis {axis} of {name!r}")
            return (lambda m: value), [], None
        if kind == "r" and len(entry) == 2:
            reg = self._register(entry[1])

            def runtime_index(m: _Machine) -> int:
                value = _read_register(m, reg)
                if not 0 <= value < size:
                    raise KernelRuntimeError(
                        f"runtime index {value} out of range for axis {axis} of {name!r} (size {size})"
                    )
                return value

            return runtime_index, [], None
        if kind == "g" and len(entry) == 3:
            buf, tile_index, shape, dtype, _ = self._tile(entry[1:])
            if dtype != "int32" or len(shape) != 2 or shape[1] != 1:
                raise BinaryFormatError(f"gather index into {name!r} must be an int32 [P, 1] tile")
            read = self._reader(buf, tile_index, dtype)
            return (lambda m: slice(None)), [shape[0]], (read, size, axis, name)
        raise BinaryFormatError(f"bad index entry {entry!r} into {name!r}")

    # -- opcodes ----------------------------------------------------------------------------------
    def _op_memset(self, dst: object, value: object) -> Step:
        write, _, _, _ = self._writer(dst)
        if not (isinstance(value, list) and len(value) == 2 and value[0] == "c" and _is_number(value[1])):
            raise BinaryFormatError(f"memset value must be a constant, got {value!r}")
        constant = np.float32(value[1]) if isinstance(value[1], float) else value[1]
        return lambda m: write(m, constant)

    def _op_load(self, dst: object, access: object) -> Step:
        read, _, shape, _ = self._access(access, for_store=False)
        write, tile_shape, _, space = self._writer(dst)
        _expect_space(space, "sbuf", "load destination")
        _expect_fit(tile_shape, shape, "destination tile", "loaded region")
        return lambda m: write(m, read(m).reshape(tile_shape))

    def _op_store(self, access: object, src: object) -> Step:
        _, write, shape, tensor_id = self._access(access, for_store=True)
        buf, index, tile_shape, dtype, _ = self._tile(src)
        _expect_fit(tile_shape, shape, "stored tile", "destination region")
        read = self._reader(buf, index, dtype)
        stored = (self.inputs + self.outputs)[tensor_id][2]  # its numpy dtype when the program runs (see _writer)
        return lambda m: write(m, read(m).reshape(shape).astype(dtypes.to_numpy(stored), copy=False))

    def _op_load_scalar(self, reg: object, access: object) -> Step:
        register = self._register(reg)
        read, _, shape, tensor_id = self._access(access, for_store=False)
        if math.prod(shape) != 1 or (self.inputs + self.outputs)[tensor_id][2] != "int32":
            raise BinaryFormatError("load_scalar reads exactly one int32 element")

        def load_scalar(m: _Machine) -> None:
            m.registers[register] = int(read(m).reshape(()))

        return load_scalar

    def _op_binary(self, op: object, dst: object, a: object, b: object) -> Step:
        function = _lookup(_BINARY, op, "binary op")
        write, shape, dtype, _ = self._writer(dst)
        fetch_a, shape_a, int_a = self._operand(a)
        fetch_b, shape_b, int_b = self._operand(b)
        _expect_broadcast((shape_a, shape_b), shape)
        if dtype == "int32" and int_a and int_b and op != "divide":
            return lambda m: write(m, function(np.asarray(fetch_a(m), np.int64), np.asarray(fetch_b(m), np.int64)))
        return lambda m: write(m, function(_f32(fetch_a(m)), _f32(fetch_b(m))))

    def _op_unary(self, op: object, dst: object, src: object) -> Step:
        function = _lookup(_UNARY, op, "unary op")
        write, shape, _, _ = self._writer(dst)
        fetch, src_shape, _ = self._operand(["t", *src] if isinstance(src, list) else src)
        _expect_shape(src_shape, shape, "source", "destination")
        return lambda m: write(m, function(_f32(fetch(m))))

    def _op_reduce(self, op: object, dst: object, src: object, axes: object) -> Step:
        function = _lookup(_REDUCE, op, "reduce op")
        write, shape, _, _ = self._writer(dst)
        fetch, src_shape, _ = self._operand(["t", *src] if isinstance(src, list) else src)
        if not (isinstance(axes, list) and axes and all(isinstance(a, int) and 0 < a < len(src_shape) for a in axes)):
            raise BinaryFormatError(f"reduce axes {axes!r} must be free axes of a rank-{len(src_shape)} tile")
        reduced = tuple(1 if i in axes else n for i, n in enumerate(src_shape))
        _expect_shape(reduced, shape, "reduced shape", "destination")
        axis = tuple(axes)
        return lambda m: write(m, function(_f32(fetch(m)), axis=axis, keepdims=True))

    def _op_matmul(self, dst: object, x: object, y: object, transpose_x: object) -> Step:
        write, shape, _, space = self._writer(dst)
        _expect_space(space, "psum", "matmul destination")
        fetch_x, shape_x = self._sbuf_operand(x)
        fetch_y, shape_y = self._sbuf_operand(y)
        if not isinstance(transpose_x, bool):
            raise BinaryFormatError("matmul transpose_x must be a bool")
        _expect_shape(check_matmul_shapes(shape_x, shape_y, transpose_x), shape, "matmul result", "destination")
        if transpose_x:
            return lambda m: write(m, _f32(fetch_x(m)).T @ _f32(fetch_y(m)))
        return lambda m: write(m, _f32(fetch_x(m)) @ _f32(fetch_y(m)))

    def _op_transpose(self, dst: object, src: object) -> Step:
        write, shape, _, _ = self._writer(dst)
        fetch, src_shape = self._sbuf_operand(src)
        if len(src_shape) != 2:
            raise BinaryFormatError("transpose takes a 2-D tile")
        _expect_shape(src_shape[::-1], shape, "transposed source", "destination")
        return lambda m: write(m, fetch(m).T)

    def _op_copy(self, dst: object, src: object) -> Step:
        write, shape, _, _ = self._writer(dst)
        fetch, src_shape, _ = self._operand(["t", *src] if isinstance(src, list) else src)
        _expect_broadcast((src_shape,), shape)
        return lambda m: write(m, fetch(m))

    def _sbuf_operand(self, ref: object) -> tuple[Callable, tuple[int, ...]]:
        buf, index, shape, dtype, space = self._tile(ref)
        _expect_space(space, "sbuf", "operand")
        return self._reader(buf, index, dtype), shape


# -- helpers ----------------------------------------------------------------------------------------
def _access_closures(tensor_id: int, resolvers: list[Callable], gather: tuple | None) -> tuple[Callable, Callable]:
    def basic_index(m: _Machine) -> tuple:
        return tuple(resolve(m) for resolve in resolvers)

    if gather is None:

        def read(m: _Machine) -> np.ndarray:
            return m.tensors[tensor_id][basic_index(m)]

        def write(m: _Machine, value: ArrayLike) -> None:
            m.tensors[tensor_id][basic_index(m)] = value

        return read, write

    position, read_index, size, axis, name = gather

    def gather_indices(m: _Machine) -> np.ndarray:
        indices = np.asarray(read_index(m)).reshape(-1)
        bad = (indices < 0) | (indices >= size)
        if bad.any():
            raise KernelRuntimeError(
                f"gather index {int(indices[bad][0])} out of range for axis {axis} of {name!r} (size {size})"
            )
        return indices.astype(np.intp)

    def gather_read(m: _Machine) -> np.ndarray:
        return np.take(m.tensors[tensor_id][basic_index(m)], gather_indices(m), axis=position)

    def scatter_write(m: _Machine, value: np.ndarray) -> None:
        view = m.tensors[tensor_id][basic_index(m)]
        view[(slice(None),) * position + (gather_indices(m),)] = value

    return gather_read, scatter_write


def _tensor_spec(spec: object, what: str) -> tuple[str, tuple[int, ...], str]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[0], str) and isinstance(spec[1], list)):
        raise BinaryFormatError(f"{what} spec {spec!r} is malformed")
    shape = tuple(_int(n, f"{what} dim") for n in spec[1])
    if any(n < 1 for n in shape) or math.prod(shape) > 1 << 31:
        raise BinaryFormatError(f"{what} shape {list(shape)} is invalid")
    return spec[0], shape, _dtype(spec[2])


def _buffer_spec(spec: object, index: int, target) -> tuple[tuple[int, ...], str, str]:
    if not (isinstance(spec, list) and len(spec) == 3 and isinstance(spec[1], str) and isinstance(spec[2], str)):
        raise BinaryFormatError(f"buffer {index} spec {spec!r} is malformed")
    if not isinstance(spec[0], list):
        raise BinaryFormatError(f"buffer {index} shape is malformed")
    shape = tuple(_int(n, f"buffer {index} dim") for n in spec[0])
    dtype = _dtype(spec[1])
    try:
        check_tile_shape(shape, dtype, spec[2], target)
    except KernelCompileError as exc:
        raise BinaryFormatError(f"buffer {index}: {exc}") from None
    return shape, dtype, spec[2]


def _region(region: object, shape: tuple[int, ...], what: str) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    if not isinstance(region, list) or len(region) != len(shape):
        raise BinaryFormatError(f"region {region!r} does not match the rank of {what}")
    index, sizes = [], []
    for axis, (part, size) in enumerate(zip(region, shape, strict=True)):
        if not (isinstance(part, list) and len(part) == 3):
            raise BinaryFormatError(f"region part {part!r} of {what} is malformed")
        start, stop, step = (_int(v, "region bound") for v in part)
        if not (0 <= start < stop <= size and step >= 1):
            raise BinaryFormatError(f"region {start}:{stop}:{step} is out of bounds for axis {axis} of {what}")
        index.append(slice(start, stop, step))
        sizes.append(len(range(start, stop, step)))
    return tuple(index), tuple(sizes)


def _read_register(m: _Machine, reg: int) -> int:
    value = m.registers[reg]
    if value is None:
        raise KernelRuntimeError(f"register {reg} is read before it is loaded")
    return value


def _poisoned(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    fill = INT_POISON if dtype == "int32" else np.nan
    return np.full(shape, fill, dtype=dtypes.to_numpy(dtype))


def _f32(value: object) -> np.ndarray:
    return np.asarray(value, dtype=np.float32)


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BinaryFormatError(f"{what} must be an int, got {value!r}")
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _dtype(value: object) -> str:
    if not isinstance(value, str) or value not in dtypes.ITEM_BYTES:
        raise BinaryFormatError(f"unknown dtype {value!r}")
    return value


def _lookup(table: dict, op: object, what: str) -> Callable:
    if not isinstance(op, str) or op not in table:
        raise BinaryFormatError(f"unknown {what} {op!r}")
    return table[op]


def _expect_shape(actual: tuple, expected: tuple, actual_what: str, expected_what: str) -> None:
    if tuple(actual) != tuple(expected):
        raise BinaryFormatError(f"{actual_what} {list(actual)} does not match {expected_what} {list(expected)}")


def _expect_fit(tile_shape: tuple, access_shape: tuple, tile_what: str, access_what: str) -> None:
    if not isa.tile_fits_access(tile_shape, access_shape):
        raise BinaryFormatError(f"{tile_what} {list(tile_shape)} does not fit {access_what} {list(access_shape)}")


def _expect_space(space: str, expected: str, what: str) -> None:
    if space != expected:
        raise BinaryFormatError(f"{what} must be in {expected.upper()}, not {space.upper()}")


def _expect_broadcast(shapes: tuple, into: tuple[int, ...]) -> None:
    try:
        if np.broadcast_shapes(*shapes, into) != into:
            raise ValueError
    except ValueError:
        raise BinaryFormatError(f"shapes {[list(s) for s in shapes]} do not broadcast into {list(into)}") from None
