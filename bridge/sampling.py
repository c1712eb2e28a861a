"""Random inputs that a kernel can actually take, for `nkicache run` and the tests.

Standard normal floats suit most kernels. Some kernels read index tensors (BlockwiseMatmul's token ids and
block-to-expert map) for which a random value is an out-of-range gather, not a test; they get a sampler of
their own that builds a valid routing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from bridge import dtypes
from bridge.errors import NkiCacheError
from bridge.ir import view_shape


class TensorLike(Protocol):
    name: str
    shape: Sequence[int]
    dtype: str


Sampler = Callable[[Sequence[TensorLike], Mapping[str, Any], np.random.Generator], list[np.ndarray]]
_SAMPLERS: dict[str, Sampler] = {}

# Integers a generic int32 operand gets: small and non-negative, so they are valid indices more often than not.
DEFAULT_INT_HIGH = 4


def sampler_for(func_name: str) -> Callable[[Sampler], Sampler]:
    def register(function: Sampler) -> Sampler:
        _SAMPLERS[func_name] = function
        return function

    return register


def default_array(tensor: TensorLike, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    shape = view_shape(tensor)
    if tensor.dtype == "int32":
        return rng.integers(0, DEFAULT_INT_HIGH, size=shape, dtype=np.int32)
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(dtypes.to_numpy(tensor.dtype))


def sample_inputs(
    func_name: str, operands: Sequence[TensorLike], attrs: Mapping[str, Any] | None, rng: np.random.Generator
) -> list[np.ndarray]:
    """Valid random inputs for one call of `func_name`, one array per operand, in operand order."""
    sampler = _SAMPLERS.get(func_name)
    if sampler is None:
        return [default_array(t, rng) for t in operands]
    return sampler(operands, dict(attrs or {}), rng)


@sampler_for("BlockwiseMatmul")
def blockwise_matmul_inputs(
    operands: Sequence[TensorLike], attrs: Mapping[str, Any], rng: np.random.Generator
) -> list[np.ndarray]:
    """hidden[T+1,H], expert_affinities_masked[(T+1)*E,1], gate_up_proj_weight[E,H,2,I],
    down_proj_weight[E,I,H], token_position_to_id[N*B], block_to_expert[N,1]: every real token placed once
    at a random position, padding positions carry id T, experts in [0, E), padding affinities 0."""
    if len(operands) != 6:
        raise NkiCacheError(f"BlockwiseMatmul takes 6 operands, got {len(operands)}")
    hidden, affinities, gate_up, down, positions, block_map = operands
    shapes = [view_shape(t) for t in operands]
    (t_plus_1, h), (n_blocks, *_) = shapes[0], shapes[5]
    tokens, experts = t_plus_1 - 1, shapes[2][0]
    intermediate = shapes[3][1]
    slots = math.prod(shapes[4])
    block_size = int(attrs.get("block_size") or max(1, slots // max(1, n_blocks)))
    slots = min(slots, n_blocks * block_size)

    token_ids = np.full(math.prod(shapes[4]), tokens, dtype=np.int32)
    placed = rng.permutation(tokens)[:slots].astype(np.int32)
    token_ids[np.sort(rng.choice(slots, size=len(placed), replace=False))] = placed
    block_to_expert = rng.integers(0, experts, size=shapes[5], dtype=np.int32)

    affinity = rng.random(shapes[1], dtype=np.float32)
    affinity.reshape(-1)[tokens * experts : (tokens + 1) * experts] = 0.0
    return [
        default_array(hidden, rng),
        affinity.astype(dtypes.to_numpy(affinities.dtype)),
        default_array(gate_up, rng, scale=1.0 / math.sqrt(h)),
        default_array(down, rng, scale=1.0 / math.sqrt(intermediate)),
        token_ids.reshape(shapes[4]).astype(dtypes.to_numpy(positions.dtype)),
        block_to_expert.astype(dtypes.to_numpy(block_map.dtype)),
    ]


def sample_graph_inputs(
    inputs: Iterable[str],
    tensors: Mapping[str, TensorLike],
    kernel_ops: Iterable[tuple[str, Sequence[str], Mapping[str, Any]]],
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """An array for every graph input. A tensor consumed by a kernel op gets that op's sampler's array for
    its operand position (the first such op, in graph order); any other input gets a normal array.

    kernel_ops: (func_name, operand tensor names, attrs) per InternalNkiKernel op, in graph order."""
    wanted = list(inputs)
    pending = set(wanted)
    values: dict[str, np.ndarray] = {}
    for func_name, operand_names, attrs in kernel_ops:
        if not pending.intersection(operand_names):
            continue
        arrays = sample_inputs(func_name, [tensors[n] for n in operand_names], attrs, rng)
        for name, array in zip(operand_names, arrays, strict=True):
            if name in pending:
                values[name] = array
                pending.discard(name)
    for name in wanted:
        if name in pending:
            values[name] = default_array(tensors[name], rng)
    return {name: values[name] for name in wanted}
