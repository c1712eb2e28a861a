"""The compiler side of nkicache: IR, targets, the kernel language, the two NKI frontends, the executor,
the internal kernel registry and (in `bridge.codegen`) the codegen loop with its per-pass cache."""

from bridge.errors import NkiCacheError
from bridge.ir import Tensor
from bridge.toolchain import binary_info, compile_kernel, run_bir, run_klir

__all__ = ["NkiCacheError", "Tensor", "binary_info", "compile_kernel", "run_bir", "run_klir"]
