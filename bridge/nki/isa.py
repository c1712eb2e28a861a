"""The instruction set shared by both frontends, both binary formats and the executor.

An instruction is a list whose first element is its opcode. Operands are encoded as plain msgpack-able
values so that a binary is the same bytes on every machine:

    tile ref      [buf, [[start, stop, step], ...]]     a region of an on-chip buffer
    operand       ["t", buf, region] | ["c", number] | ["r", reg]
    HBM access    [tensor, [entry, ...]]                 tensor indexes inputs then outputs
      entry       ["s", start, stop, step]               a static slice, keeps the dim
                  ["i", index]                           a static index, drops the dim
                  ["r", reg]                             a runtime scalar register, drops the dim
                  ["g", buf, region]                     gather by an int32 [P, 1] tile, dim of size P

Opcodes and their fields (after the opcode):

    memset      dst, value
    load        dst, access                 dst's shape fits the region (see tile_fits_access)
    store       access, src                 src's shape fits the region
    load_scalar reg, access                 one int32 element into a register
    binary      op, dst, a, b               a and b are operands; numpy broadcasting to dst
    unary       op, dst, src
    reduce      op, dst, src, axes          axes are free axes; dst keeps them with size 1
    matmul      dst, x, y, transpose_x      dst (PSUM, float32) = x.T @ y if transpose_x else x @ y
    transpose   dst, src                    2-D only
    copy        dst, src                    broadcast src to dst, cast to dst's dtype
"""

from __future__ import annotations

import math

# Hardware limits (DESIGN.md section 5); checked at compile time and again when a binary is loaded.
PARTITION_MAX = 128  # partition dim of every on-chip tile
PSUM_FREE_MAX = 512  # float32 elements per partition in one PSUM tile
MATMUL_STATIONARY_FREE_MAX = 128
MATMUL_MOVING_FREE_MAX = 512

BUFFER_SPACES = ("sbuf", "psum")

UNARY_OPS = (
    "exp",
    "log",
    "sqrt",
    "rsqrt",
    "tanh",
    "sigmoid",
    "silu",
    "gelu",
    "relu",
    "negative",
    "abs",
    "square",
    "reciprocal",
)

OPCODES = (
    "memset",
    "load",
    "store",
    "load_scalar",
    "binary",
    "unary",
    "reduce",
    "matmul",
    "transpose",
    "copy",
)


def _access_reads(access: list) -> list[tuple[str, int]]:
    reads = []
    for entry in access[1]:
        if entry[0] == "r":
            reads.append(("reg", entry[1]))
        elif entry[0] == "g":
            reads.append(("buf", entry[1]))
    return reads


def _operand_reads(operand: list) -> list[tuple[str, int]]:
    if operand[0] == "t":
        return [("buf", operand[1])]
    if operand[0] == "r":
        return [("reg", operand[1])]
    return []


def reads_and_writes(instruction: list) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """The ("buf", id) and ("reg", id) an instruction reads and writes, for liveness analysis."""
    opcode, *fields = instruction
    if opcode == "memset":
        return [], [("buf", fields[0][0])]
    if opcode == "load":
        return _access_reads(fields[1]), [("buf", fields[0][0])]
    if opcode == "store":
        return [*_access_reads(fields[0]), ("buf", fields[1][0])], []
    if opcode == "load_scalar":
        return _access_reads(fields[1]), [("reg", fields[0])]
    if opcode == "binary":
        return [*_operand_reads(fields[2]), *_operand_reads(fields[3])], [("buf", fields[1][0])]
    if opcode in ("unary", "reduce"):
        return [("buf", fields[2][0])], [("buf", fields[1][0])]
    if opcode == "matmul":
        return [("buf", fields[1][0]), ("buf", fields[2][0])], [("buf", fields[0][0])]
    if opcode in ("transpose", "copy"):
        return [("buf", fields[1][0])], [("buf", fields[0][0])]
    raise ValueError(f"unknown opcode {opcode!r}")


def tile_shape_of_access(access_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The tile an HBM region loads into: rank-0 and rank-1 regions land in [1, N] tiles."""
    if len(access_shape) >= 2:
        return tuple(access_shape)
    return (1, access_shape[0] if access_shape else 1)


def tile_fits_access(tile_shape: tuple[int, ...], access_shape: tuple[int, ...]) -> bool:
    """Whether a tile can receive a load of, or be stored into, an HBM region of `access_shape`.

    The elements move in row-major order, so beyond the region's own tile shape a rank-0/1 region may
    land in an [N, 1] column (one element per partition), and a region of rank >= 2 in any tile that
    keeps its partition dim and its number of free elements ([C, R, W] as [C, R * W]).
    """
    tile_shape, access_shape = tuple(tile_shape), tuple(access_shape)
    if tile_shape == tile_shape_of_access(access_shape):
        return True
    if len(access_shape) <= 1:
        return tile_shape == (math.prod(access_shape), 1)
    return (
        len(tile_shape) >= 2
        and tile_shape[0] == access_shape[0]
        and math.prod(tile_shape[1:]) == math.prod(access_shape[1:])
    )
