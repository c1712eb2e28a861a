"""BlockwiseMatmul -> blockwise_mm: the MoE expert MLP, one block of B tokens at a time (DESIGN.md section 5).

    output = 0
    for each block n:  ids = token_position_to_id[nB:(n+1)B];  e = block_to_expert[n, 0]
        x = hidden[ids];  inter = silu(x @ W_gu[e, :, 0, :]) * (x @ W_gu[e, :, 1, :])
        output[ids] += (inter @ W_down[e]) * affinities[ids * E + e]

Token ids and the expert of each block are only known when the binary runs, so the kernel reads them
then: the ids of up to 128 tokens as an int32 [P, 1] column that gathers rows of `hidden` (and
scatters rows of `output`), the expert as a runtime scalar that picks the weight slices. Both are
bounds-checked by the executor, so a bad id or a missing expert is a run-time error, never a wrong
answer.

Layouts: x is gathered as [tokens, H] (tokens on partitions) and turned into [128, tokens] slices of
H so that the gate/up matmuls contract H on partitions: gate[tokens, I] = sum_k xT_k.T @ W_gu[e, k, 0, :].
inter is turned the same way to contract I for the down projection. All matmuls accumulate float32
in PSUM; silu, the product and the affinity scale run in float32. Blocks run in order and each one
reads the output rows it adds to after the previous block stored them, so tokens that appear in
several blocks (and experts used by several blocks) accumulate. Within a block the update is
output[ids] = output[ids] + y, like numpy's `output[ids] += y`: only padding tokens (id T, affinity 0)
repeat inside a block, and they add zeros.
"""

import bridge.nki.language as nl
from bridge.registry import InternalKernelConfig


def blockwise_mm(
    hidden,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    token_position_to_id,
    block_to_expert,
    output,
    block_size=None,
):
    T1, H, E, I, N, B = check_shapes(
        hidden,
        expert_affinities_masked,
        gate_up_proj_weight,
        down_proj_weight,
        token_position_to_id,
        block_to_expert,
        output,
        block_size,
    )
    zero_output(output, T1, H)
    P = nl.tile_size.pmax
    for n in nl.sequential_range(N):
        e = nl.load_scalar(block_to_expert[n, 0])
        for t0 in nl.sequential_range(0, B, P):
            tokens = min(P, B - t0)
            start = n * B + t0
            ids = nl.load(token_position_to_id[start : start + tokens], shape=(tokens, 1))
            expert_mlp(hidden, expert_affinities_masked, gate_up_proj_weight, down_proj_weight, output, ids, e, E, H, I)


def check_shapes(hidden, affinities, gate_up, down, token_ids, block_expert, output, block_size):
    assert isinstance(block_size, int) and block_size >= 1, (
        f"BlockwiseMatmul needs int attr block_size >= 1, got {block_size}"
    )
    assert len(hidden.shape) == 2, f"hidden must be [T+1, H], got {list(hidden.shape)}"
    T1, H = hidden.shape
    assert len(gate_up.shape) == 4 and gate_up.shape[1] == H and gate_up.shape[2] == 2, (
        f"gate_up_proj_weight must be [E, H={H}, 2, I], got {list(gate_up.shape)}"
    )
    E = gate_up.shape[0]
    I = gate_up.shape[3]
    assert down.shape == (E, I, H), f"down_proj_weight must be [E={E}, I={I}, H={H}], got {list(down.shape)}"
    assert affinities.shape == (T1 * E, 1), (
        f"expert_affinities_masked must be [(T+1)*E, 1] = [{T1 * E}, 1], got {list(affinities.shape)}"
    )
    assert len(block_expert.shape) == 2 and block_expert.shape[1] == 1, (
        f"block_to_expert must be [N, 1], got {list(block_expert.shape)}"
    )
    N = block_expert.shape[0]
    assert token_ids.shape == (N * block_size,), (
        f"token_position_to_id must be [N*B] = [{N * block_size}] for N={N} blocks of {block_size}, "
        f"got {list(token_ids.shape)}"
    )
    assert token_ids.dtype == "int32", f"token_position_to_id must be int32, got {token_ids.dtype}"
    assert block_expert.dtype == "int32", f"block_to_expert must be int32, got {block_expert.dtype}"
    assert output.shape == (T1, H), f"output must be [T+1, H] = [{T1}, {H}], got {list(output.shape)}"
    return T1, H, E, I, N, block_size


def zero_output(output, T1, H):
    P = nl.tile_size.pmax
    W = nl.tile_size.psum_fmax
    zeros = nl.zeros((min(P, T1), min(W, H)), dtype=output.dtype)
    for r0 in nl.affine_range(0, T1, P):
        r1 = min(T1, r0 + P)
        for h0 in nl.affine_range(0, H, W):
            h1 = min(H, h0 + W)
            nl.store(output[r0:r1, h0:h1], value=zeros[0 : r1 - r0, 0 : h1 - h0])


def expert_mlp(hidden, affinities, gate_up, down, output, ids, e, E, H, I):
    """One sub-block of at most 128 tokens through expert e; adds its rows into output."""
    P = nl.tile_size.pmax
    FMAX = nl.tile_size.psum_fmax
    x = nl.load(hidden[ids, 0:H])  # gather: [tokens, H]; bad ids fail here, before anything is written
    x_t = transposed_chunks(x, H)
    inter = []  # [tokens, <=512] float32 chunks of silu(gate) * up
    for i0 in nl.affine_range(0, I, FMAX):
        i1 = min(I, i0 + FMAX)
        gate = project(x_t, gate_up, e, 0, i0, i1)
        up = project(x_t, gate_up, e, 1, i0, i1)
        inter = [*inter, nl.multiply(nl.silu(gate), up)]
    inter_t = []  # [<=128, tokens] slices of inter, contraction dim of the down projection first
    for k0 in nl.affine_range(0, I, P):
        k1 = min(I, k0 + P)
        chunk = inter[k0 // FMAX]
        base = (k0 // FMAX) * FMAX
        inter_t = [*inter_t, nl.transpose(chunk[:, k0 - base : k1 - base])]
    scale = nl.load(affinities[nl.add(nl.multiply(ids, E), e), 0:1], dtype=nl.float32)  # [tokens, 1]
    for h0 in nl.affine_range(0, H, FMAX):
        h1 = min(H, h0 + FMAX)
        y = nl.matmul(inter_t[0], nl.load(down[e, 0 : min(I, P), h0:h1]), transpose_x=True)
        for k0 in nl.sequential_range(P, I, P):
            k1 = min(I, k0 + P)
            y += nl.matmul(inter_t[k0 // P], nl.load(down[e, k0:k1, h0:h1]), transpose_x=True)
        current = nl.load(output[ids, h0:h1], dtype=nl.float32)
        nl.store(output[ids, h0:h1], value=nl.add(current, nl.multiply(y, scale)))


def transposed_chunks(x, H):
    """[tokens, H] -> [<=128, tokens] tiles, one per 128 columns of H."""
    P = nl.tile_size.pmax
    chunks = []
    for k0 in nl.affine_range(0, H, P):
        chunks = [*chunks, nl.transpose(x[:, k0 : min(H, k0 + P)])]
    return chunks


def project(x_t, gate_up, e, which, i0, i1):
    """x @ W_gu[e, :, which, i0:i1] as a [tokens, i1 - i0] PSUM tile, contracting H 128 rows at a time."""
    P = nl.tile_size.pmax
    H = gate_up.shape[1]
    acc = nl.matmul(x_t[0], nl.load(gate_up[e, 0 : min(H, P), which, i0:i1]), transpose_x=True)
    for k0 in nl.sequential_range(P, H, P):
        k1 = min(H, k0 + P)
        acc += nl.matmul(x_t[k0 // P], nl.load(gate_up[e, k0:k1, which, i0:i1]), transpose_x=True)
    return acc


CONFIG = InternalKernelConfig("BlockwiseMatmul", "blockwise_mm", blockwise_mm)
