"""The internal kernels, written in the kernel language, and the registry that holds them under their
func_names: each kernel module's CONFIG says how its macro op is compiled."""

from bridge.kernels import blockwise_mm, conv2d, matmul, resize, rmsnorm, softmax, transpose
from bridge.registry import KernelRegistry

KERNEL_MODULES = (blockwise_mm, conv2d, matmul, resize, rmsnorm, softmax, transpose)

_INTERNAL_KERNEL_REGISTRY = KernelRegistry()
for _module in KERNEL_MODULES:
    _INTERNAL_KERNEL_REGISTRY.register(_module.CONFIG)


def get_internal_kernel_registry() -> KernelRegistry:
    """The registry of the internal kernels (the specification's `get_internal_kernel_registry`)."""
    return _INTERNAL_KERNEL_REGISTRY
