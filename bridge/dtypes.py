"""The element types the kernel language knows and their numpy equivalents."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from bridge.errors import KernelCompileError

NUMPY_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int32": np.dtype(np.int32),
}

ITEM_BYTES = {name: dtype.itemsize for name, dtype in NUMPY_DTYPES.items()}


def check_dtype(name: object) -> str:
    """Return `name` when it is a supported dtype name, else raise a compile error."""
    if not isinstance(name, str) or name not in NUMPY_DTYPES:
        raise KernelCompileError(f"unsupported dtype {name!r}; supported: {', '.join(NUMPY_DTYPES)}")
    return name


def to_numpy(name: str) -> np.dtype:
    return NUMPY_DTYPES[name]


def from_numpy(dtype: np.dtype) -> str:
    for name, candidate in NUMPY_DTYPES.items():
        if candidate == dtype:
            return name
    raise KernelCompileError(f"unsupported numpy dtype {dtype}")
