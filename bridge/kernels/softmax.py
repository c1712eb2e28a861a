"""Softmax -> softmax: row-wise exp(x - max) / sum over the last axis, 128 rows at a time."""

import bridge.nki.language as nl
from bridge.registry import InternalKernelConfig


def softmax(x, out):
    assert len(x.shape) == 2, f"softmax takes a 2-D input, got {list(x.shape)}"
    assert out.shape == x.shape, f"out must match x {list(x.shape)}, got {list(out.shape)}"
    R = x.shape[0]
    P = nl.tile_size.pmax
    for r0 in nl.affine_range(0, R, P):
        rows = min(P, R - r0)
        t = nl.load(x[r0 : r0 + rows, :], dtype=nl.float32)
        shifted = t - nl.max(t, axis=1)
        e = nl.exp(shifted)
        inverse_sum = nl.reciprocal(nl.sum(e, axis=1))
        nl.store(out[r0 : r0 + rows, :], value=nl.multiply(e, inverse_sum, dtype=out.dtype))


CONFIG = InternalKernelConfig("Softmax", "softmax", softmax)
