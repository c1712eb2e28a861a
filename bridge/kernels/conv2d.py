"""Conv2d -> the conv2d_pbp_* family: NCHW input, OIHW weight, NCHW output, cross-correlation.

attrs: stride (sh, sw), padding ((top, bottom), (left, right)), dilation (dh, dw). Channels sit on
partitions ("pbp": partition-by-partition), so every tap is a matmul contracting C on the PE array:
out[o, pixels] += W[:, c, kh, kw].T @ in[c, shifted pixels], accumulated over (kh, kw, C chunks) in PSUM.

- conv2d_pbp_1x1: 1x1 kernel, stride 1, no padding. A plain matmul over channels; pixel tiles span
  whole rows ([C, R, W] regions loaded as [C, R * W] tiles) up to the 512-wide moving limit.
- conv2d_pbp_kxk: any K x K with stride, asymmetric padding and dilation. One output row (cut into
  512-wide pieces) per PSUM tile; each tap reads one input row through a strided view. Padding is
  resolved when the kernel is compiled: taps whose row falls outside the image are skipped and the
  columns of a tap are clipped to the image, so nothing outside the input is ever read.

`select_conv2d` picks the variant from shapes and attrs; the chosen name is the kernel_name.
"""

import bridge.nki.language as nl
from bridge.registry import InternalKernelConfig

DEFAULT_ATTRS = {"stride": (1, 1), "padding": ((0, 0), (0, 0)), "dilation": (1, 1)}


def conv2d_pbp_kxk(input, weight, out, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1)):
    N, C, H, W, O, KH, KW = conv_shapes(input, weight)
    sh, sw = pair(stride, "stride")
    dh, dw = pair(dilation, "dilation")
    (pt, pb), (pl, pr) = paddings(padding)
    OH = (H + pt + pb - dh * (KH - 1) - 1) // sh + 1
    OW = (W + pl + pr - dw * (KW - 1) - 1) // sw + 1
    assert OH >= 1 and OW >= 1, (
        f"Conv2d output would be empty: input {list(input.shape)}, weight {list(weight.shape)}, "
        f"stride {stride}, padding {padding}, dilation {dilation}"
    )
    check_out(out, input, (N, O, OH, OW))
    P = nl.tile_size.pmax
    FMAX = nl.tile_size.gemm_moving_fmax
    weights = stationary_weights(weight, C, O, KH, KW)
    n_o = (O + P - 1) // P
    for n in nl.affine_range(N):
        rows = input_rows(input, n, C, H, OH, KH, sh, dh, pt)
        for oc in nl.affine_range(n_o):
            o0 = oc * P
            o1 = min(O, o0 + P)
            for oh in nl.affine_range(OH):
                for ow0 in nl.affine_range(0, OW, FMAX):
                    ow1 = min(OW, ow0 + FMAX)
                    acc = nl.zeros((o1 - o0, ow1 - ow0), nl.float32, buffer=nl.psum)
                    for kh in nl.sequential_range(KH):
                        ih = oh * sh - pt + kh * dh
                        if ih < 0 or ih >= H:
                            continue  # the whole tap reads top/bottom padding
                        for kw in nl.sequential_range(KW):
                            shift = kw * dw - pl
                            lo = max(ow0, ceil_div(-shift, sw))  # first output column inside the image
                            hi = min(ow1, floor_div(W - 1 - shift, sw) + 1)
                            if lo >= hi:
                                continue  # the tap reads left/right padding only
                            iw = lo * sw + shift
                            for cc in nl.sequential_range(len(rows)):
                                window = rows[cc][ih][:, iw : iw + (hi - lo - 1) * sw + 1 : sw]
                                w_t = weights[((cc * n_o + oc) * KH + kh) * KW + kw]
                                acc[:, lo - ow0 : hi - ow0] += nl.matmul(w_t, window, transpose_x=True)
                    nl.store(out[n, o0:o1, oh, ow0:ow1], value=nl.copy(acc, dtype=out.dtype))


def conv2d_pbp_1x1(input, weight, out, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1)):
    N, C, H, W, O, KH, KW = conv_shapes(input, weight)
    assert KH == 1 and KW == 1, f"conv2d_pbp_1x1 needs a 1x1 weight, got {list(weight.shape)}"
    assert pair(stride, "stride") == (1, 1), f"conv2d_pbp_1x1 needs stride (1, 1), got {stride}"
    assert paddings(padding) == ((0, 0), (0, 0)), f"conv2d_pbp_1x1 takes no padding, got {padding}"
    pair(dilation, "dilation")  # validated; a 1x1 tap has nothing to dilate
    check_out(out, input, (N, O, H, W))
    P = nl.tile_size.pmax
    FMAX = nl.tile_size.gemm_moving_fmax
    weights = stationary_weights(weight, C, O, 1, 1)
    n_o = (O + P - 1) // P
    n_c = (C + P - 1) // P
    row_group = max(1, FMAX // W)  # whole rows per pixel tile when a row fits the moving limit
    col_piece = min(W, FMAX)
    for n in nl.affine_range(N):
        for h0 in nl.affine_range(0, H, row_group):
            h1 = min(H, h0 + row_group)
            for w0 in nl.affine_range(0, W, col_piece):
                w1 = min(W, w0 + col_piece)
                pixels = (h1 - h0) * (w1 - w0)
                tiles = []
                for cc in nl.affine_range(n_c):
                    c0 = cc * P
                    c1 = min(C, c0 + P)
                    tiles = [*tiles, nl.load(input[n, c0:c1, h0:h1, w0:w1], shape=(c1 - c0, pixels))]
                for oc in nl.affine_range(n_o):
                    o0 = oc * P
                    o1 = min(O, o0 + P)
                    acc = nl.matmul(weights[oc], tiles[0], transpose_x=True)
                    for cc in nl.sequential_range(1, n_c):
                        acc += nl.matmul(weights[cc * n_o + oc], tiles[cc], transpose_x=True)
                    nl.store(out[n, o0:o1, h0:h1, w0:w1], value=nl.copy(acc, dtype=out.dtype))


# -- helpers shared by the family ------------------------------------------------------------------
def conv_shapes(input, weight):
    assert len(input.shape) == 4, f"Conv2d input must be NCHW (rank 4), got {list(input.shape)}"
    assert len(weight.shape) == 4, f"Conv2d weight must be OIHW (rank 4), got {list(weight.shape)}"
    N, C, H, W = input.shape
    O, C_w, KH, KW = weight.shape
    assert C_w == C, (
        f"Conv2d weight {list(weight.shape)} has {C_w} input channels but input {list(input.shape)} has {C} "
        "(grouped convolution is not supported)"
    )
    return N, C, H, W, O, KH, KW


def check_out(out, input, expected):
    assert out.shape == expected, (
        f"Conv2d out must be {list(expected)} for input {list(input.shape)} and these attrs, got {list(out.shape)}"
    )


def pair(value, name):
    assert isinstance(value, (tuple, list)) and len(value) == 2, f"Conv2d {name} must be a pair (h, w), got {value}"
    a, b = value
    assert isinstance(a, int) and isinstance(b, int) and a >= 1 and b >= 1, (
        f"Conv2d {name} must be positive ints, got {value}"
    )
    return (a, b)


def paddings(value):
    message = f"Conv2d padding must be ((top, bottom), (left, right)) of non-negative ints, got {value}"
    assert isinstance(value, (tuple, list)) and len(value) == 2, message
    pads = ()
    for part in value:
        assert isinstance(part, (tuple, list)) and len(part) == 2, message
        lo, hi = part
        assert isinstance(lo, int) and isinstance(hi, int) and lo >= 0 and hi >= 0, message
        pads = (*pads, (lo, hi))
    return pads


def ceil_div(a, b):
    return -((-a) // b)


def floor_div(a, b):
    return a // b


def stationary_weights(weight, C, O, KH, KW):
    """W[o0:o1, c0:c1, kh, kw] turned to [cs, os] tiles (C on partitions), flat in (cc, oc, kh, kw) order."""
    P = nl.tile_size.pmax
    tiles = []
    for c0 in nl.affine_range(0, C, P):
        c1 = min(C, c0 + P)
        for o0 in nl.affine_range(0, O, P):
            o1 = min(O, o0 + P)
            for kh in nl.affine_range(KH):
                for kw in nl.affine_range(KW):
                    tiles = [*tiles, nl.transpose(nl.load(weight[o0:o1, c0:c1, kh, kw]))]
    return tiles


def input_rows(input, n, C, H, OH, KH, sh, dh, pt):
    """[cs, W] tiles of every input row some output row reads, indexed [c chunk][row]; None elsewhere."""
    used = [False] * H
    for oh in range(OH):
        for kh in range(KH):
            ih = oh * sh - pt + kh * dh
            if 0 <= ih < H:
                used = [*used[:ih], True, *used[ih + 1 :]]
    P = nl.tile_size.pmax
    chunks = []
    for c0 in nl.affine_range(0, C, P):
        c1 = min(C, c0 + P)
        rows = []
        for ih in range(H):
            rows = [*rows, nl.load(input[n, c0:c1, ih, :]) if used[ih] else None]
        chunks = [*chunks, rows]
    return chunks


def select_conv2d(operands, results, attrs):
    """conv2d_pbp_1x1 for 1x1 weights with stride 1 and no padding, else conv2d_pbp_kxk (which also
    reports malformed shapes and attrs)."""
    try:
        is_1x1 = (
            len(operands) == 2
            and len(operands[1].shape) == 4
            and tuple(operands[1].shape[2:]) == (1, 1)
            and tuple(attrs["stride"]) == (1, 1)
            and tuple(tuple(p) for p in attrs["padding"]) == ((0, 0), (0, 0))
        )
    except (TypeError, KeyError):
        is_1x1 = False
    return ("conv2d_pbp_1x1", conv2d_pbp_1x1) if is_1x1 else ("conv2d_pbp_kxk", conv2d_pbp_kxk)


CONFIG = InternalKernelConfig(
    "Conv2d", "conv2d_pbp_kxk", conv2d_pbp_kxk, attr_defaults=DEFAULT_ATTRS, select=select_conv2d
)
