"""Independent numpy references for every internal kernel (DESIGN.md section 5).

They share nothing with the kernels or the executor: plain numpy on whole arrays in float32 (matmuls
accumulate in float32), cast to the output dtype at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from bridge.errors import UnknownKernelError

Reference = Callable[..., list[np.ndarray]]
_REFERENCES: dict[str, Reference] = {}


def reference_for(func_name: str) -> Callable[[Reference], Reference]:
    def register(function: Reference) -> Reference:
        _REFERENCES[func_name] = function
        return function

    return register


def reference(func_name: str, inputs: Sequence[np.ndarray], attrs: dict | None = None) -> list[np.ndarray]:
    """The expected outputs of `func_name` on `inputs`, in float32."""
    try:
        function = _REFERENCES[func_name]
    except KeyError:
        raise UnknownKernelError(f"no numpy reference for func_name {func_name!r}") from None
    return function(*[np.asarray(x, dtype=np.float32) if x.dtype != np.int32 else x for x in inputs], **(attrs or {}))


@reference_for("Matmul")
def matmul(lhsT: np.ndarray, rhs: np.ndarray) -> list[np.ndarray]:
    return [lhsT.T @ rhs]


@reference_for("Softmax")
def softmax(x: np.ndarray) -> list[np.ndarray]:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return [e / e.sum(axis=-1, keepdims=True)]


@reference_for("RMSNorm")
def rmsnorm(a: np.ndarray, g: np.ndarray, eps: float = 1e-6) -> list[np.ndarray]:
    return [a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + np.float32(eps)) * g]


@reference_for("BlockwiseMatmul")
def blockwise_matmul(
    hidden: np.ndarray,
    expert_affinities_masked: np.ndarray,
    gate_up_proj_weight: np.ndarray,
    down_proj_weight: np.ndarray,
    token_position_to_id: np.ndarray,
    block_to_expert: np.ndarray,
    block_size: int,
) -> list[np.ndarray]:
    """DESIGN.md section 5, block by block; `output[ids] += y` with numpy's fancy-index semantics."""
    num_experts = gate_up_proj_weight.shape[0]
    output = np.zeros(hidden.shape, dtype=np.float32)
    for n, expert in enumerate(block_to_expert[:, 0]):
        ids = token_position_to_id[n * block_size : (n + 1) * block_size]
        x = hidden[ids]
        gate = x @ gate_up_proj_weight[expert, :, 0, :]
        up = x @ gate_up_proj_weight[expert, :, 1, :]
        inter = gate / (np.float32(1) + np.exp(-gate)) * up
        output[ids] += (inter @ down_proj_weight[expert]) * expert_affinities_masked[ids * num_experts + expert]
    return [output]


@reference_for("Conv2d")
def conv2d(
    input: np.ndarray,
    weight: np.ndarray,
    stride: Sequence[int] = (1, 1),
    padding: Sequence[Sequence[int]] = ((0, 0), (0, 0)),
    dilation: Sequence[int] = (1, 1),
) -> list[np.ndarray]:
    """Cross-correlation over the zero-padded input, one (kh, kw) tap at a time."""
    (sh, sw), (dh, dw) = stride, dilation
    padded = np.pad(input, ((0, 0), (0, 0), tuple(padding[0]), tuple(padding[1])))
    kernel_h, kernel_w = weight.shape[2:]
    out_h = (padded.shape[2] - dh * (kernel_h - 1) - 1) // sh + 1
    out_w = (padded.shape[3] - dw * (kernel_w - 1) - 1) // sw + 1
    out = np.zeros((input.shape[0], weight.shape[0], out_h, out_w), dtype=np.float32)
    for kh in range(kernel_h):
        for kw in range(kernel_w):
            rows = slice(kh * dh, kh * dh + (out_h - 1) * sh + 1, sh)
            cols = slice(kw * dw, kw * dw + (out_w - 1) * sw + 1, sw)
            out += np.einsum("nchw,oc->nohw", padded[:, :, rows, cols], weight[:, :, kh, kw])
    return [out]


@reference_for("ResizeNearest")
def resize_nearest(data: np.ndarray, out_shape: Sequence[int]) -> list[np.ndarray]:
    """src = floor(float32(o) * float32(in / out)) per spatial axis, in numpy float32 arithmetic."""

    def sources(size_in: int, size_out: int) -> np.ndarray:
        scale = np.float32(size_in) / np.float32(size_out)
        src = np.floor(np.arange(size_out, dtype=np.float32) * scale).astype(np.int64)
        return np.minimum(src, size_in - 1)

    _, height, width, _ = data.shape
    return [data[:, sources(height, out_shape[1])][:, :, sources(width, out_shape[2])]]


@reference_for("Transpose10")
def transpose10(x: np.ndarray) -> list[np.ndarray]:
    return [np.swapaxes(x, -1, -2)]
