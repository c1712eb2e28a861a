"""The beta3 frontend: `ParserFrontend.compile_to_bir`, the "new NKI frontend" the bridge calls.

It reads the kernel json (input/output specs and attrs) that the caller wrote under a temporary
directory, parses the kernel's source with `ast`, interprets it on those specs (never running the kernel
function), and serializes the flat instruction list as a BIR binary.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from bridge.errors import KernelCompileError
from bridge.frontends.interpreter import KernelInterpreter
from bridge.frontends.kernel_folder import kernel_folder
from bridge.nki.builder import KernelBuilder
from bridge.nki.isa import reads_and_writes
from bridge.program import Program, decode_bir, encode_bir
from bridge.registry import KernelCall, TensorSpec
from bridge.targets import Target, make_target


class CompileOptions:
    """What the compile pipeline does after the kernel is interpreted."""

    def __init__(self, target: Target, num_neuroncores_per_sengine: int | None = None):
        self.target = target
        self.num_neuroncores_per_sengine = (
            target.num_neuroncores_per_sengine if num_neuroncores_per_sengine is None else num_neuroncores_per_sengine
        )
        self.eliminate_dead_code = True
        self.validate_binary = True

    def set_pipeline_options(self, *, eliminate_dead_code: bool = True, validate_binary: bool = True) -> None:
        """eliminate_dead_code drops instructions whose results never reach an output; validate_binary
        decodes and validates the emitted binary before returning it."""
        self.eliminate_dead_code = eliminate_dead_code
        self.validate_binary = validate_binary


def write_kernel_json(directory: str | Path, call: KernelCall, target: Target) -> Path:
    """The kernel json the frontend compiles from: specs and attrs, nothing machine-specific."""
    path = Path(directory) / "kernel.json"
    document = {
        "kernel_name": call.kernel_name,
        "target": type(target).__name__,
        "inputs": [spec.as_json() for spec in call.inputs],
        "outputs": [spec.as_json() for spec in call.outputs],
        "attrs": call.attrs,
    }
    try:
        path.write_text(json.dumps(document, sort_keys=True))
    except TypeError as exc:
        raise KernelCompileError(f"attrs of {call.kernel_name} must be JSON values: {exc}") from None
    return path


class ParserFrontend:
    """Compiles one kernel function from its source."""

    def __init__(self, kernel_func: Callable, options: CompileOptions):
        self.kernel_func = kernel_func
        self.options = options

    def compile_to_bir(self, kernel_json_path: str | Path) -> bytes:
        spec = json.loads(Path(kernel_json_path).read_text())
        builder = KernelBuilder(spec["kernel_name"], make_target(spec["target"]))
        args = [
            builder.add_tensor(t["name"], tuple(t["shape"]), t["dtype"], is_output=is_output)
            for is_output, group in ((False, spec["inputs"]), (True, spec["outputs"]))
            for t in group
        ]
        attrs = {name: _as_tuples(value) for name, value in spec["attrs"].items()}
        with builder.activate():
            KernelInterpreter(builder.kernel_name).call(self.kernel_func, tuple(args), attrs)
        program = program_of(builder)
        if self.options.eliminate_dead_code:
            program.code = eliminate_dead_code(program.code)
        binary = encode_bir(program)
        if self.options.validate_binary:
            from bridge.executor import LoadedProgram  # numpy: loaded by the first trace, not by a warm hit

            LoadedProgram(decode_bir(binary))
        return binary


def trace_beta3(call: KernelCall, target: Target) -> dict:
    """Compile `call` the way the bridge's beta3 leaf does; returns the specification's trace-result dict."""
    options = CompileOptions(target)
    options.set_pipeline_options(eliminate_dead_code=True, validate_binary=True)
    with kernel_folder() as directory:
        json_path = write_kernel_json(directory, call, target)
        binary = ParserFrontend(call.kernel_func, options).compile_to_bir(json_path)
    return {
        "binary": binary,
        "input_names": [spec.name for spec in call.inputs],
        "output_names": [spec.name for spec in call.outputs],
        "format": "bir",
    }


def program_of(builder: KernelBuilder) -> Program:
    return Program(
        kernel=builder.kernel_name,
        target=type(builder.target).__name__,
        inputs=[[t.name, list(t.shape), t.dtype] for t in builder.inputs],
        outputs=[[t.name, list(t.shape), t.dtype] for t in builder.outputs],
        buffers=builder.buffers,
        registers=builder.registers,
        code=builder.instructions,
    )


def eliminate_dead_code(code: list[list]) -> list[list]:
    """Keep stores and whatever feeds them, walking backwards with buffer-level liveness."""
    live: set[tuple[str, int]] = set()
    kept = []
    for instruction in reversed(code):
        reads, writes = reads_and_writes(instruction)
        if instruction[0] == "store" or any(w in live for w in writes):
            kept.append(instruction)
            live.update(reads)
    return kept[::-1]


def _as_tuples(value: object) -> object:
    """JSON gives lists back; kernels see attrs as the tuples they were written as."""
    if isinstance(value, list):
        return tuple(_as_tuples(v) for v in value)
    return value


__all__ = ["CompileOptions", "ParserFrontend", "TensorSpec", "trace_beta3", "write_kernel_json"]
