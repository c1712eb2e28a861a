"""The element types the kernel language knows, their sizes, and (on demand) their numpy equivalents.

Names and sizes are plain data so that a compile that only checks or hashes dtypes (every warm hit) loads
neither numpy nor ml_dtypes, and a trace loads numpy only: ml_dtypes' C extension alone takes 0.6-0.8 s to
import, and only running a bfloat16 binary (bridge.executor) needs it.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from bridge.errors import KernelCompileError

if TYPE_CHECKING:
    import numpy as np

ITEM_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int32": 4}
DTYPE_NAMES: tuple[str, ...] = tuple(ITEM_BYTES)


def check_dtype(name: object) -> str:
    """Return `name` when it is a supported dtype name, else raise a compile error."""
    if not isinstance(name, str) or name not in ITEM_BYTES:
        raise KernelCompileError(f"unsupported dtype {name!r}; supported: {', '.join(DTYPE_NAMES)}")
    return name


@functools.cache
def to_numpy(name: str) -> np.dtype:
    """The numpy dtype of `name`; ml_dtypes is imported only for bfloat16."""
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(check_dtype(name))


def from_numpy(dtype: np.dtype) -> str:
    import numpy as np

    name = np.dtype(dtype).name
    if name in ITEM_BYTES and to_numpy(name) == dtype:
        return name
    raise KernelCompileError(f"unsupported numpy dtype {dtype}")
