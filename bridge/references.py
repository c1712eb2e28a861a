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
