"""The internal kernels, written in the kernel language and registered under their func_names."""

from bridge.kernels import matmul, rmsnorm, softmax  # noqa: F401 - importing registers them
