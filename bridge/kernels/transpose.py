"""Transpose10 -> tiled_dve_transpose_10: [..., I, J] -> [..., J, I] for inputs of rank 2 to 4.

Every leading index is one [I, J] matrix, cut into 128 x 128 tiles (ragged at the edges): each tile is
loaded with I on partitions, turned over by the engine ([is, js] -> [js, is]) and stored at the mirrored
position. The data never changes value, so any dtype comes out exact.
"""

import bridge.nki.language as nl
from bridge.registry import InternalKernelConfig


def tiled_dve_transpose_10(x, out):
    rank = len(x.shape)
    assert 2 <= rank <= 4, f"Transpose10 takes a 2-D, 3-D or 4-D input, got {list(x.shape)}"
    I = x.shape[rank - 2]
    J = x.shape[rank - 1]
    expected = (*x.shape[: rank - 2], J, I)
    assert out.shape == expected, f"out must be {list(expected)} for x {list(x.shape)}, got {list(out.shape)}"
    assert out.dtype == x.dtype, f"Transpose10 moves data: out dtype {out.dtype} must equal x dtype {x.dtype}"
    for lead in leading_indices(x.shape[: rank - 2]):
        transpose_matrix(x, out, lead, I, J)


def leading_indices(dims):
    """Every index tuple into the leading dims (one empty tuple for a 2-D input)."""
    indices = [()]
    for size in dims:
        longer = []
        for index in indices:
            for i in range(size):
                longer = [*longer, (*index, i)]
        indices = longer
    return indices


def transpose_matrix(x, out, lead, I, J):
    P = nl.tile_size.pmax
    for i0 in nl.affine_range(0, I, P):
        i1 = min(I, i0 + P)
        for j0 in nl.affine_range(0, J, P):
            j1 = min(J, j0 + P)
            block = nl.load(matrix_region(x, lead, i0, i1, j0, j1))
            nl.store(matrix_region(out, lead, j0, j1, i0, i1), value=nl.transpose(block))


def matrix_region(t, lead, r0, r1, c0, c1):
    """t[*lead, r0:r1, c0:c1]; spelled out per rank because kernels index with literal slices."""
    if len(lead) == 0:
        return t[r0:r1, c0:c1]
    if len(lead) == 1:
        return t[lead[0], r0:r1, c0:c1]
    return t[lead[0], lead[1], r0:r1, c0:c1]


CONFIG = InternalKernelConfig("Transpose10", "tiled_dve_transpose_10", tiled_dve_transpose_10)
