"""The compiler's entry points: compile a registered kernel, run a binary, describe a binary."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from bridge.executor import LoadedProgram
from bridge.frontends.beta3 import trace_beta3
from bridge.kernels import get_internal_kernel_registry
from bridge.klir import decode_klir
from bridge.program import decode_bir
from bridge.registry import TensorLike
from bridge.targets import Target, get_platform_target


def compile_kernel(
    func_name: str,
    operands: Sequence[TensorLike],
    results: Sequence[TensorLike],
    attrs: Mapping | None = None,
    *,
    target: Target | None = None,
) -> dict:
    """Resolve `func_name` in the registry and compile it with beta3: {'binary', 'input_names',
    'output_names', 'format'}, as the bridge's trace leaf returns it."""
    config = get_internal_kernel_registry().resolve(func_name)
    call = config.marshal(operands, results, attrs or {})
    return trace_beta3(call, target or get_platform_target())


def run_bir(binary: bytes, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute a BIR binary; inputs and outputs are keyed by the binary's input and output names."""
    return LoadedProgram(decode_bir(binary)).run(dict(inputs))


def run_klir(binary: bytes, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute a KLIR binary from the beta2 tracer, on the same executor as BIR."""
    return LoadedProgram(decode_klir(binary)).run(dict(inputs))


def binary_info(binary: bytes) -> dict:
    """What a BIR binary holds: kernel, target, tensors, instruction and buffer counts, size."""
    program = decode_bir(binary)
    return {
        "kernel": program.kernel,
        "target": program.target,
        "inputs": program.inputs,
        "outputs": program.outputs,
        "instructions": len(program.code),
        "buffers": len(program.buffers),
        "bytes": len(binary),
    }
