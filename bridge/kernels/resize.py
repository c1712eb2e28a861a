"""ResizeNearest -> resize_nearest_fixed_dma_kernel: nearest-neighbour resize of NHWC data to attr out_shape.

Per spatial axis, output position o reads source floor(float32(o) * float32(in / out)), the product
rounded to float32 as the hardware computes it (and clamped to in - 1, which float32 never reaches in
practice). The index tables are fixed when the kernel is compiled, so the kernel is pure data movement
with static access patterns ("fixed DMA"):

- source rows are loaded 128 at a time with H on partitions, as [rows, W, C] tiles;
- the W axis is remapped inside the tile by a few strided copies: the index table is covered by
  arithmetic progressions (runs of consecutive outputs, or the phases of the rational scale in/out,
  whichever needs fewer copies), and a run that repeats one source column is a broadcast;
- the H axis is remapped by the stores: each progression of output rows is one store from a strided
  partition view of the remapped tile.

Channels are cut into chunks so that a tile stays well inside one SBUF partition.
"""

import math

import bridge.nki.language as nl
from bridge.registry import InternalKernelConfig

TILE_BUDGET_BYTES = 64 * 1024  # per partition, for each of the two tiles of a chunk


def resize_nearest_fixed_dma_kernel(data, out, out_shape=None):
    assert out_shape is not None, "ResizeNearest needs attr out_shape (N, H_out, W_out, C)"
    assert len(data.shape) == 4, f"ResizeNearest takes NHWC data, got {list(data.shape)}"
    N, H, W, C = data.shape
    assert len(out_shape) == 4, f"out_shape must be (N, H_out, W_out, C), got {out_shape}"
    assert out_shape[0] == N and out_shape[3] == C, (
        f"out_shape {list(out_shape)} must keep batch {N} and channels {C} of data {list(data.shape)}"
    )
    assert out.shape == tuple(out_shape), f"out {list(out.shape)} does not match out_shape {list(out_shape)}"
    assert out.dtype == data.dtype, f"ResizeNearest moves data: out dtype {out.dtype} must equal {data.dtype}"
    Ho = out_shape[1]
    Wo = out_shape[2]
    src_h = source_indices(H, Ho)
    src_w = source_indices(W, Wo)
    w_moves = cover(src_w, W, Wo, True)
    h_moves = cover(src_h, H, Ho, False)
    item_bytes = 4 if data.dtype in ("float32", "int32") else 2
    cs_max = max(1, min(C, TILE_BUDGET_BYTES // (max(W, Wo) * item_bytes)))
    P = nl.tile_size.pmax
    for n in nl.affine_range(N):
        for c0 in nl.affine_range(0, C, cs_max):
            c1 = min(C, c0 + cs_max)
            h0 = src_h[0]
            for _ in range(H):  # one pass per chunk of used source rows; ends when none are left
                if h0 >= H:
                    break
                h1 = min(H, h0 + P)
                rows = nl.load(data[n, h0:h1, :, c0:c1])
                remapped = nl.ndarray((h1 - h0, Wo, c1 - c0), dtype=data.dtype)
                for move in w_moves:
                    remap_columns(remapped, rows, move)
                for move in h_moves:
                    store_rows(out, remapped, move, n, h0, h1, c0, c1)
                h0 = next_used(src_h, h1, H)


def source_indices(size_in, size_out):
    """src[o] = min(floor(f32(f32(o) * f32(size_in / size_out))), size_in - 1), in float32 exactly."""
    scale = float32_round(size_in / size_out)
    indices = []
    for o in range(size_out):
        indices = [*indices, min(math.floor(float32_round(o * scale)), size_in - 1)]
    return indices


def float32_round(value):
    """`value` rounded to the nearest float32, ties to even (numpy's float32 cast), for normal floats.

    Python's float ops are IEEE double; a product of two float32 values is exact in double, and a
    double quotient rounded again to float32 equals the float32 quotient, so this reproduces numpy's
    float32 arithmetic for the index tables."""
    if value == 0:
        return 0.0
    mantissa, exponent = math.frexp(value)
    return math.ldexp(round(mantissa * 16777216.0), exponent - 24)


def next_used(src, start, size):
    """The first source index >= start that some output reads, or size when there is none."""
    for s in src:
        if s >= start:
            return s
    return size


def cover(src, size_in, size_out, allow_repeat):
    """Arithmetic progressions (dst_start, count, dst_step, src_start, src_step) covering o -> src[o].

    Two coverings are built and the one with fewer moves wins: runs of consecutive outputs with a
    constant source step (step 0 repeats one source, which only a copy can broadcast), and the phases
    of the reduced ratio in / out, whose source advances by in' every out' outputs."""
    runs = consecutive_runs(src, allow_repeat)
    phases = phase_runs(src, size_in, size_out)
    return runs if len(runs) <= len(phases) else phases


def consecutive_runs(src, allow_repeat):
    moves = []
    o = 0
    count_out = len(src)
    for _ in range(count_out):
        if o >= count_out:
            break
        if o + 1 == count_out:
            moves = [*moves, (o, 1, 1, src[o], 1)]
            o = o + 1
            continue
        step = src[o + 1] - src[o]
        if step == 0 and not allow_repeat:
            moves = [*moves, (o, 1, 1, src[o], 1)]
            o = o + 1
            continue
        end = o + 1
        for k in range(o + 1, count_out):
            if src[k] - src[k - 1] != step:
                break
            end = k + 1
        moves = [*moves, (o, end - o, 1, src[o], step)]
        o = end
    return moves


def phase_runs(src, size_in, size_out):
    divisor = math.gcd(size_in, size_out)
    dst_step = size_out // divisor
    src_step = size_in // divisor
    moves = []
    for phase in range(min(dst_step, size_out)):
        start = phase
        for o in range(phase + dst_step, size_out + dst_step, dst_step):
            if o >= size_out or src[o] - src[o - dst_step] != src_step:
                moves = [*moves, (start, (o - start) // dst_step, dst_step, src[start], src_step)]
                start = o
    return moves


def remap_columns(remapped, rows, move):
    d0, count, d_step, s0, s_step = move
    d_stop = d0 + (count - 1) * d_step + 1
    if s_step == 0 or count == 1:
        remapped[:, d0:d_stop:d_step, :] = rows[:, s0 : s0 + 1, :]
    else:
        remapped[:, d0:d_stop:d_step, :] = rows[:, s0 : s0 + (count - 1) * s_step + 1 : s_step, :]


def store_rows(out, remapped, move, n, h0, h1, c0, c1):
    """Store the part of one row progression whose sources lie in the loaded rows [h0, h1)."""
    d0, count, d_step, s0, s_step = move
    first = max(0, -((s0 - h0) // s_step))  # ceil((h0 - s0) / s_step)
    last = min(count - 1, (h1 - 1 - s0) // s_step)
    if first > last:
        return
    k = last - first
    dst = d0 + first * d_step
    src = s0 + first * s_step - h0
    nl.store(
        out[n, dst : dst + k * d_step + 1 : d_step, :, c0:c1],
        value=remapped[src : src + k * s_step + 1 : s_step, :, :],
    )


CONFIG = InternalKernelConfig("ResizeNearest", "resize_nearest_fixed_dma_kernel", resize_nearest_fixed_dma_kernel)
