"""The compiler side of nkicache: IR, targets, the kernel language, the two NKI frontends, the executor,
the internal kernel registry and (in `bridge.codegen`) the codegen loop with its per-pass cache.

The entry points of `bridge.toolchain` are loaded on first use: they bring the executor and numpy, which a
process that only reads the cache never needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bridge.errors import NkiCacheError
from bridge.ir import Tensor

if TYPE_CHECKING:
    from bridge.toolchain import binary_info, compile_kernel, run_bir, run_klir

__all__ = ["NkiCacheError", "Tensor", "binary_info", "compile_kernel", "run_bir", "run_klir"]
_TOOLCHAIN = frozenset({"binary_info", "compile_kernel", "run_bir", "run_klir"})


def __getattr__(name: str) -> object:
    if name in _TOOLCHAIN:
        from bridge import toolchain

        return getattr(toolchain, name)
    raise AttributeError(f"module 'bridge' has no attribute {name!r}")
