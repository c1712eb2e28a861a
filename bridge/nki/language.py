"""The NKI-style kernel language: what kernels `import bridge.nki.language as nl` and call.

Kernels see HBM tensors (their arguments) and on-chip tiles whose axis 0 is the partition dim (at most 128).
Data moves with `load`/`store`; matmuls go through the PE array into PSUM with float32 accumulation;
everything else runs elementwise on tiles (float32 internally, cast to the result dtype). Loops are
`affine_range`, `sequential_range` and `static_range`: all of them are unrolled at compile time, so every
shape and slice is a compile-time int and a compiled binary is a flat instruction list.

Each function here checks its arguments and emits instructions into the active builder; the same functions
serve the AST frontend (beta3) and the tracer (beta2).
"""

from __future__ import annotations

import builtins
import math
import sys

from bridge.errors import KernelCompileError
from bridge.nki import isa, values
from bridge.nki.builder import active, check_matmul_shapes
from bridge.nki.values import HBMAccess, RuntimeScalar, Tile

float32 = "float32"
float16 = "float16"
bfloat16 = "bfloat16"
int32 = "int32"

sbuf = "sbuf"
psum = "psum"


class tile_size:
    pmax = isa.PARTITION_MAX
    psum_fmax = isa.PSUM_FREE_MAX
    gemm_stationary_fmax = isa.MATMUL_STATIONARY_FREE_MAX
    gemm_moving_fmax = isa.MATMUL_MOVING_FREE_MAX


# -- loops: unrolled at compile time ----------------------------------------------------------------
def affine_range(*args: int) -> range:
    """Iterations without loop-carried dependencies."""
    return builtins.range(*args)


def sequential_range(*args: int) -> range:
    """Iterations that depend on each other (accumulation into one tile)."""
    return builtins.range(*args)


def static_range(*args: int) -> range:
    """Iterations unrolled in program order."""
    return builtins.range(*args)


# -- allocation -------------------------------------------------------------------------------------
def ndarray(shape: tuple[int, ...], dtype: str, buffer: str = sbuf) -> Tile:
    """A new uninitialised tile (the executor fills it with NaN so stray reads show)."""
    return active().new_tile(tuple(shape), dtype, buffer)


def zeros(shape: tuple[int, ...], dtype: str, buffer: str = sbuf) -> Tile:
    return full(shape, 0.0, dtype, buffer)


def full(shape: tuple[int, ...], fill_value: float, dtype: str, buffer: str = sbuf) -> Tile:
    tile = ndarray(shape, dtype, buffer)
    active().emit("memset", tile.ref(), _constant(fill_value))
    return tile


# -- data movement ----------------------------------------------------------------------------------
def load(access: HBMAccess, dtype: str | None = None, shape: tuple[int, ...] | None = None) -> Tile:
    """Copy an HBM region into a new SBUF tile; a rank-1 region becomes a [1, N] tile.

    `shape` lands the region in another tile shape, elements in row-major order: (N, 1) loads a rank-1
    region as a column (one element per partition, e.g. a gather index), and a region of rank >= 2 may
    have its free dims merged ([C, R, W] as (C, R * W)); see isa.tile_fits_access."""
    _expect(access, HBMAccess, "load", "an HBM tensor region such as a[0:128, :]")
    tile_shape = isa.tile_shape_of_access(access.shape) if shape is None else _static_shape(shape, "load")
    if not isa.tile_fits_access(tile_shape, access.shape):
        raise KernelCompileError(
            f"cannot load region {list(access.shape)} of {access.tensor.name} into a {list(tile_shape)} tile; "
            "a tile keeps the region's partition dim and element count (a rank-1 region loads as [1, N] or [N, 1])"
        )
    tile = ndarray(tile_shape, dtype or access.tensor.dtype)
    active().emit("load", tile.ref(), access.encode())
    return tile


def load_scalar(access: HBMAccess) -> RuntimeScalar:
    """Read one int32 element when the binary runs; the result indexes later loads and stores."""
    _expect(access, HBMAccess, "load_scalar", "an HBM tensor element such as ids[n, 0]")
    if access.tensor.dtype != "int32" or math.prod(access.shape) != 1:
        raise KernelCompileError(f"load_scalar reads one int32 element, got {access.tensor.dtype}{list(access.shape)}")
    builder = active()
    register = builder.new_register()
    builder.emit("load_scalar", register.reg, access.encode())
    return register


def store(access: HBMAccess, value: Tile) -> None:
    """Copy a tile into an output tensor region, casting to the tensor's dtype."""
    _expect(access, HBMAccess, "store", "an HBM tensor region such as out[0:128, :]")
    _expect(value, Tile, "store", "a tile")
    if not access.tensor.is_output:
        raise KernelCompileError(f"cannot store into input tensor {access.tensor.name}; inputs are read-only")
    if not isa.tile_fits_access(value.shape, access.shape):
        raise KernelCompileError(
            f"store of a {list(value.shape)} tile into {access.tensor.name} region {list(access.shape)}"
        )
    active().emit("store", access.encode(), value.ref())


# -- PE array ---------------------------------------------------------------------------------------
def matmul(x: Tile, y: Tile, transpose_x: bool = False) -> Tile:
    """x @ y into a new PSUM tile (float32); with transpose_x, x is given as [K, M]."""
    _expect(x, Tile, "matmul", "a tile")
    _expect(y, Tile, "matmul", "a tile")
    if x.space != "sbuf" or y.space != "sbuf":
        raise KernelCompileError("matmul operands must be in SBUF; copy PSUM results to SBUF first")
    m, n = check_matmul_shapes(x.shape, y.shape, bool(transpose_x))
    result = ndarray((m, n), float32, psum)
    active().emit("matmul", result.ref(), x.ref(), y.ref(), bool(transpose_x))
    return result


def transpose(x: Tile) -> Tile:
    """[P, F] -> [F, P] through the PE array; F becomes the partition dim, so F <= 128."""
    _expect(x, Tile, "transpose", "a tile")
    if x.ndim != 2:
        raise KernelCompileError(f"transpose takes a 2-D tile, got {list(x.shape)}")
    result = ndarray((x.shape[1], x.shape[0]), x.dtype)
    active().emit("transpose", result.ref(), x.ref())
    return result


# -- elementwise ------------------------------------------------------------------------------------
def _binary(op: str, x: object, y: object, dtype: str | None) -> Tile:
    shape = _broadcast_shape(op, x, y)
    result = ndarray(shape, dtype or _result_dtype(x, y))
    active().emit("binary", op, result.ref(), _operand(x), _operand(y))
    return result


def add(x, y, dtype=None):
    return _binary("add", x, y, dtype)


def subtract(x, y, dtype=None):
    return _binary("subtract", x, y, dtype)


def multiply(x, y, dtype=None):
    return _binary("multiply", x, y, dtype)


def divide(x, y, dtype=None):
    return _binary("divide", x, y, dtype)


def maximum(x, y, dtype=None):
    return _binary("maximum", x, y, dtype)


def minimum(x, y, dtype=None):
    return _binary("minimum", x, y, dtype)


def _unary(op: str, x: Tile, dtype: str | None) -> Tile:
    _expect(x, Tile, op, "a tile")
    result = ndarray(x.shape, dtype or _float_dtype(x))
    active().emit("unary", op, result.ref(), x.ref())
    return result


def exp(x, dtype=None):
    return _unary("exp", x, dtype)


def log(x, dtype=None):
    return _unary("log", x, dtype)


def sqrt(x, dtype=None):
    return _unary("sqrt", x, dtype)


def rsqrt(x, dtype=None):
    return _unary("rsqrt", x, dtype)


def tanh(x, dtype=None):
    return _unary("tanh", x, dtype)


def sigmoid(x, dtype=None):
    return _unary("sigmoid", x, dtype)


def silu(x, dtype=None):
    return _unary("silu", x, dtype)


def gelu(x, dtype=None):
    return _unary("gelu", x, dtype)


def relu(x, dtype=None):
    return _unary("relu", x, dtype)


def negative(x, dtype=None):
    return _unary("negative", x, dtype)


def abs(x, dtype=None):
    return _unary("abs", x, dtype)


def square(x, dtype=None):
    return _unary("square", x, dtype)


def reciprocal(x, dtype=None):
    return _unary("reciprocal", x, dtype)


def copy(x: Tile, dtype: str | None = None) -> Tile:
    """A new SBUF tile with x's values, cast to dtype (this is how PSUM results reach SBUF)."""
    _expect(x, Tile, "copy", "a tile")
    result = ndarray(x.shape, dtype or _float_dtype(x))
    active().emit("copy", result.ref(), x.ref())
    return result


def broadcast_to(x: Tile, shape: tuple[int, ...]) -> Tile:
    """A new tile of `shape` repeating x along its size-1 axes (a [1, F] row or a [P, 1] column)."""
    _expect(x, Tile, "broadcast_to", "a tile")
    shape = tuple(shape)
    try:
        if _broadcast_shapes(x.shape, shape) != shape:
            raise ValueError
    except ValueError:
        raise KernelCompileError(f"cannot broadcast a {list(x.shape)} tile to {list(shape)}") from None
    result = ndarray(shape, x.dtype)
    active().emit("copy", result.ref(), x.ref())
    return result


# -- reductions along free axes ---------------------------------------------------------------------
def _reduce(op: str, x: Tile, axis: int | tuple[int, ...], dtype: str | None) -> Tile:
    _expect(x, Tile, op, "a tile")
    axes = tuple(sorted({a % x.ndim for a in (axis if isinstance(axis, tuple) else (axis,))}))
    if 0 in axes or not axes:
        raise KernelCompileError(f"{op} reduces along free axes (1..{x.ndim - 1}); axis 0 is the partition dim")
    shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    result = ndarray(shape, dtype or _float_dtype(x))
    active().emit("reduce", op, result.ref(), x.ref(), list(axes))
    return result


def sum(x, axis, dtype=None):
    """Sum along free axes; the reduced axes stay with size 1 ([P, F] -> [P, 1])."""
    return _reduce("sum", x, axis, dtype)


def max(x, axis, dtype=None):
    return _reduce("max", x, axis, dtype)


def min(x, axis, dtype=None):
    return _reduce("min", x, axis, dtype)


def mean(x, axis, dtype=None):
    return _reduce("mean", x, axis, dtype)


# -- writes into existing tiles (t[...] = v, t += v) ------------------------------------------------
def update(target: Tile, op: str, value: object) -> Tile:
    """In-place `target op= value`; returns target so `acc += ...` keeps naming the same tile."""
    _broadcast_shape(op, target, value, into=target.shape)
    active().emit("binary", op, target.ref(), target.operand(), _operand(value))
    return target


def assign(target: Tile, value: object) -> None:
    """`target[...] = value` for a tile or a constant."""
    if value == target:  # `t[i] += v` re-assigns the view it already updated
        return
    if isinstance(value, Tile):
        _broadcast_shape("assign", target, value, into=target.shape)
        active().emit("copy", target.ref(), value.ref())
    else:
        active().emit("memset", target.ref(), _constant(value))


# -- helpers ----------------------------------------------------------------------------------------
def _expect(value: object, kind: type, where: str, what: str) -> None:
    if not isinstance(value, kind):
        raise KernelCompileError(f"{where} expects {what}, got {type(value).__name__}")


def _static_shape(shape: object, where: str) -> tuple[int, ...]:
    if not isinstance(shape, tuple | list) or any(isinstance(n, bool) or not isinstance(n, int) for n in shape):
        raise KernelCompileError(f"{where} shape must be a tuple of compile-time ints, got {shape!r}")
    return tuple(shape)


def _constant(value: object) -> list:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KernelCompileError(f"expected a compile-time number, got {type(value).__name__}")
    return ["c", value]


def _operand(value: object) -> list:
    if isinstance(value, Tile):
        return value.operand()
    if isinstance(value, RuntimeScalar):
        return ["r", value.reg]
    return _constant(value)


def _shape(value: object) -> tuple[int, ...]:
    return value.shape if isinstance(value, Tile) else ()


def _broadcast_shape(op: str, x: object, y: object, into: tuple[int, ...] | None = None) -> tuple[int, ...]:
    if not isinstance(x, Tile) and not isinstance(y, Tile):
        raise KernelCompileError(f"{op} needs at least one tile operand")
    for value in (x, y):
        if not isinstance(value, Tile | RuntimeScalar | int | float) or isinstance(value, bool):
            raise KernelCompileError(f"{op} takes tiles and numbers, got {type(value).__name__}")
    try:
        shape = _broadcast_shapes(_shape(x), _shape(y))
        partitions = (into or shape)[0]
        if any(isinstance(v, Tile) and v.shape[0] != partitions for v in (x, y)):
            raise KernelCompileError(
                f"{op} of shapes {list(_shape(x))} and {list(_shape(y))}: tiles must share the partition dim; "
                "repeat a [1, F] row across partitions with nl.broadcast_to"
            )
        if into is not None and _broadcast_shapes(shape, into) != into:
            raise ValueError
    except ValueError:
        raise KernelCompileError(
            f"{op} of shapes {list(_shape(x))} and {list(_shape(y))} do not broadcast"
            + (f" into {list(into)}" if into is not None else "")
        ) from None
    return shape


def _result_dtype(x: object, y: object) -> str:
    """int32 when every operand is an integer, else the dtype of the first float tile (see _float_dtype)."""
    tiles = [v for v in (x, y) if isinstance(v, Tile)]
    float_tiles = [t for t in tiles if t.dtype != "int32"]
    if float_tiles:
        return _float_dtype(float_tiles[0])
    integral = all(isinstance(v, Tile | RuntimeScalar | int) for v in (x, y))
    return int32 if integral else float32


def _float_dtype(x: Tile) -> str:
    """Results of float math keep a float input's dtype; int and PSUM inputs give float32."""
    return x.dtype if x.dtype in ("bfloat16", "float16") and x.space == "sbuf" else float32


def _broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's broadcasting rule (ValueError when the shapes do not broadcast); numpy is loaded only when a kernel
    is traced, so that importing the kernel library for a warm hit does not load it."""
    import numpy as np

    return np.broadcast_shapes(*shapes)


values.use_language(sys.modules[__name__])
