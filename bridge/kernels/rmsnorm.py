"""RMSNorm -> rmsnorm: a * rsqrt(mean(a^2, last axis) + eps) * g, 128 rows at a time."""

import bridge.nki.language as nl
from bridge.registry import InternalKernelConfig


def rmsnorm(a, g, out, eps=1e-6):
    assert len(a.shape) == 2, f"rmsnorm takes a 2-D input, got {list(a.shape)}"
    R, C = a.shape
    assert g.shape == (C,), f"g must be [{C}], got {list(g.shape)}"
    assert out.shape == a.shape, f"out must match a {list(a.shape)}, got {list(out.shape)}"
    P = nl.tile_size.pmax
    gain = nl.load(g[0:C], dtype=nl.float32)  # a [1, C] row
    gain_rows = nl.broadcast_to(gain, (min(P, R), C))
    for r0 in nl.affine_range(0, R, P):
        rows = min(P, R - r0)
        t = nl.load(a[r0 : r0 + rows, :], dtype=nl.float32)
        scale = nl.rsqrt(nl.mean(nl.square(t), axis=1) + eps)
        nl.store(out[r0 : r0 + rows, :], value=nl.multiply(t * scale, gain_rows[0:rows, :], dtype=out.dtype))


CONFIG = InternalKernelConfig("RMSNorm", "rmsnorm", rmsnorm, attr_defaults={"eps": 1e-6})
