"""The macro-graph IR the codegen loop walks."""

from __future__ import annotations

from collections.abc import Sequence


class Tensor:
    """A graph tensor. Reading `.access_shape` raises AttributeError when none was given, so callers can
    prefer the access pattern and fall back to the raw shape, as the specification's key builder does."""

    def __init__(self, name: str, shape: Sequence[int], dtype: str, access_shape: Sequence[int] | None = None):
        self.name = name
        self.shape = tuple(shape)
        self.dtype = dtype
        if access_shape is not None:
            self.access_shape = tuple(access_shape)

    def __repr__(self) -> str:
        extra = f", access_shape={list(self.access_shape)}" if hasattr(self, "access_shape") else ""
        return f"Tensor({self.name!r}, {list(self.shape)}, {self.dtype!r}{extra})"
