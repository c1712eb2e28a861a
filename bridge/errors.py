"""The project's error types.

Every error a user can cause (a bad graph, an unsupported kernel construct, a corrupt binary) derives from
`NkiCacheError`, so the command line can print one clear line instead of a traceback.
"""

from __future__ import annotations


class NkiCacheError(Exception):
    """Base of every error nkicache raises on purpose."""


class KernelCompileError(NkiCacheError):
    """A kernel cannot be compiled: unsupported construct, bad shapes, bad attrs."""

    def __init__(self, message: str, *, kernel: str | None = None, location: str | None = None):
        self.kernel = kernel
        self.location = location
        prefix = ""
        if kernel:
            prefix += f"kernel {kernel}"
        if location:
            prefix += f" at {location}" if prefix else location
        super().__init__(f"{prefix}: {message}" if prefix else message)
        self.reason = message


class HardwareLimitError(KernelCompileError):
    """A kernel asks for more than the hardware has (partitions, PSUM, matmul sizes)."""


class BinaryFormatError(NkiCacheError):
    """A BIR or KLIR binary is malformed, truncated or of another version."""


class KernelRuntimeError(NkiCacheError):
    """A binary hit a bad value at run time (an index out of range, a missing input)."""


class UnknownKernelError(NkiCacheError):
    """No internal kernel is registered under a func_name."""
