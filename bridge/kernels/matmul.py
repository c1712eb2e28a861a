"""Matmul -> matmul_tiled: out[M, N] = lhsT.T @ rhs, tiled for the PE array with float32 accumulation."""

import bridge.nki.language as nl
from bridge.registry import InternalKernelConfig


def matmul_tiled(lhsT, rhs, out):
    K, M = lhsT.shape
    K_rhs, N = rhs.shape
    assert K_rhs == K, f"contraction mismatch: lhsT {list(lhsT.shape)} vs rhs {list(rhs.shape)}"
    assert out.shape == (M, N), f"out must be [{M}, {N}], got {list(out.shape)}"
    TK = nl.tile_size.pmax
    TM = nl.tile_size.gemm_stationary_fmax
    TN = nl.tile_size.gemm_moving_fmax
    for m0 in nl.affine_range(0, M, TM):
        ms = min(TM, M - m0)
        for n0 in nl.affine_range(0, N, TN):
            ns = min(TN, N - n0)
            acc = nl.zeros((ms, ns), nl.float32, buffer=nl.psum)
            for k0 in nl.sequential_range(0, K, TK):
                ks = min(TK, K - k0)
                a = nl.load(lhsT[k0 : k0 + ks, m0 : m0 + ms])
                b = nl.load(rhs[k0 : k0 + ks, n0 : n0 + ns])
                acc += nl.matmul(a, b, transpose_x=True)
            nl.store(out[m0 : m0 + ms, n0 : n0 + ns], value=nl.copy(acc, dtype=out.dtype))


CONFIG = InternalKernelConfig("Matmul", "matmul_tiled", matmul_tiled)
