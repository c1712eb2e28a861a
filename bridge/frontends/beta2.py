"""The beta2 frontend: `TraceKernel`, which traces a kernel by running it on tracer tensors (the legacy way)
and returns a KLIR binary.

In the specification this path is intact but has no caller from the bridge: the dispatcher always takes
beta3. It is kept complete and tested so that the two frontends can be compared instruction for
instruction.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

from bridge.errors import KernelCompileError
from bridge.frontends.beta3 import eliminate_dead_code, program_of
from bridge.frontends.interpreter import display_path
from bridge.klir import KLIR_VERSION_IDENTIFIER, encode_klir
from bridge.nki.builder import KernelBuilder
from bridge.registry import KernelCall, TensorSpec
from bridge.targets import Target

_LANGUAGE_DIR = Path(__file__).resolve().parents[1] / "nki"


class TraceKernel:
    """with TraceKernel(target=..., num_neuroncores_per_sengine=...) as tk:
    tk.bind_arguments(call_args); tk.specialize_and_call(kernel_func, additional_args); klir = tk.trace()"""

    def __init__(self, target: Target, num_neuroncores_per_sengine: int | None = None, kernel_name: str = "kernel"):
        self.target = target
        self.num_neuroncores_per_sengine = num_neuroncores_per_sengine or target.num_neuroncores_per_sengine
        self.kernel_name = kernel_name
        self._builder: KernelBuilder | None = None
        self._arguments: list = []
        self._traced = False

    def __enter__(self) -> TraceKernel:
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self._builder = None

    def bind_arguments(self, call_args: Mapping[str, list[TensorSpec]]) -> None:
        """Create tracer tensors for {'inputs': [...], 'outputs': [...]}."""
        builder = KernelBuilder(self.kernel_name, self.target)
        self._arguments = [
            builder.add_tensor(spec.name, spec.shape, spec.dtype, is_output=is_output)
            for is_output, key in ((False, "inputs"), (True, "outputs"))
            for spec in call_args[key]
        ]
        self._builder = builder

    def specialize_and_call(self, kernel_func: Callable, additional_args: Mapping[str, object]) -> None:
        """Run the kernel function on the tracer tensors; every language call records an instruction."""
        if self._builder is None:
            raise KernelCompileError("bind_arguments must come before specialize_and_call")
        with self._builder.activate():
            try:
                kernel_func(*self._arguments, **dict(additional_args))
            except KernelCompileError as exc:
                if exc.location is not None:
                    raise
                raise type(exc)(exc.reason, kernel=self.kernel_name, location=_kernel_location(exc)) from None
            except AssertionError as exc:
                raise KernelCompileError(
                    str(exc) or "assertion failed", kernel=self.kernel_name, location=_kernel_location(exc)
                ) from None
        self._traced = True

    def trace(self) -> bytes:
        if self._builder is None or not self._traced:
            raise KernelCompileError("trace() needs bind_arguments and specialize_and_call first")
        program = program_of(self._builder)
        program.code = eliminate_dead_code(program.code)
        return encode_klir(program)


def trace_beta2(call: KernelCall, target: Target) -> dict:
    """Trace `call` the way the dormant beta2 leaf does; returns the trace-result dict with format 'klir'."""
    with TraceKernel(
        target=target, num_neuroncores_per_sengine=target.num_neuroncores_per_sengine, kernel_name=call.kernel_name
    ) as tk:
        tk.bind_arguments({"inputs": list(call.inputs), "outputs": list(call.outputs)})
        tk.specialize_and_call(call.kernel_func, call.attrs)
        binary = tk.trace()
    return {
        "binary": binary,
        "input_names": [spec.name for spec in call.inputs],
        "output_names": [spec.name for spec in call.outputs],
        "format": "klir",
    }


def _kernel_location(exc: BaseException) -> str | None:
    """file:line of the innermost frame outside the language implementation: the kernel's own line."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not Path(f.filename).resolve().is_relative_to(_LANGUAGE_DIR) and not f.filename.endswith(("beta2.py",))
    ]
    if not frames:
        return None
    return f"{display_path(frames[-1].filename)}:{frames[-1].lineno}"


__all__ = ["KLIR_VERSION_IDENTIFIER", "TraceKernel", "trace_beta2"]
