"""The internal kernels, written in the kernel language and registered under their func_names."""

# Importing a kernel module registers it.
from bridge.kernels import (  # noqa: F401
    blockwise_mm,
    conv2d,
    matmul,
    resize,
    rmsnorm,
    softmax,
    transpose,
)
