"""Executes a compiled basic block (an `Artifact`) on given inputs, optionally checking every kernel
against its numpy reference.

A graph tensor's value has the shape the kernels see: its access_shape when it has one, else its shape.
Kernel instructions run their binary (BIR through `run_bir`, KLIR through `run_klir`) with inputs bound by
position from the instruction's graph operands to the binary's func_args, and outputs bound from func_outs
to the graph results; elementwise instructions run in numpy, in float32, cast to the result dtype.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence

import msgspec
import numpy as np

from bridge import dtypes
from bridge.artifact import Artifact, ElementwiseInstruction, KernelInstruction
from bridge.errors import KernelRuntimeError
from bridge.ir import view_shape
from bridge.references import reference
from bridge.sampling import sample_graph_inputs
from bridge.toolchain import run_bir, run_klir

# (rtol, atol) of the reference check, by the lowest-precision dtype an instruction touches.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    "bfloat16": (5e-2, 5e-2),
    "int32": (0.0, 0.0),
}
_PRECISION_ORDER = ("bfloat16", "float16", "float32", "int32")

RUNNERS: dict[str, Callable[[bytes, Mapping[str, np.ndarray]], dict[str, np.ndarray]]] = {
    "bir": run_bir,
    "klir": run_klir,
}

ELEMENTWISE: dict[str, Callable[..., np.ndarray]] = {
    "Add": np.add,
    "Multiply": np.multiply,
    "Relu": lambda x: np.maximum(x, np.float32(0)),
    "Copy": lambda x: x.copy(),
}


class InstructionReport(msgspec.Struct):
    index: int
    name: str  # kernel_name, or the elementwise op
    func_name: str | None  # None for elementwise instructions
    max_abs_err: float | None = None  # set when checked
    ok: bool | None = None  # None when not checked
    tolerance: tuple[float, float] | None = None
    error: str | None = None  # why the reference could not be computed

    def as_json(self) -> dict:
        err = self.max_abs_err
        return {
            "index": self.index,
            "name": self.name,
            "func_name": self.func_name,
            # JSON has no NaN or infinity: a non-finite error (or a shape mismatch) is null.
            "max_abs_err": err if err is not None and np.isfinite(err) else None,
            "ok": self.ok,
            "error": self.error,
        }


class RunReport(msgspec.Struct):
    graph: str
    checked: bool
    instructions: list[InstructionReport] = msgspec.field(default_factory=list)
    values: dict[str, np.ndarray] = msgspec.field(default_factory=dict)
    outputs: list[str] = msgspec.field(default_factory=list)  # produced tensors no later instruction reads
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(report.ok is not False for report in self.instructions)

    @property
    def failures(self) -> list[InstructionReport]:
        return [report for report in self.instructions if report.ok is False]

    def output_digests(self) -> dict[str, str]:
        """SHA-256 of each output's bytes: equal digests, equal results (for determinism checks)."""
        return {
            name: hashlib.sha256(np.ascontiguousarray(self.values[name]).tobytes()).hexdigest() for name in self.outputs
        }


def tolerance(dtype_names: Sequence[str]) -> tuple[float, float]:
    """(rtol, atol) of the reference check for a kernel touching `dtype_names`: the loosest one's."""
    loosest = min(dtype_names, key=_PRECISION_ORDER.index, default="float32")
    return TOLERANCES[loosest]


class OutputComparison(msgspec.Struct, frozen=True):
    """How a kernel's outputs compare with its numpy reference (see `compare_output`)."""

    ok: bool
    # Largest absolute error over the outputs compared; NaN when an output holds NaN, infinity when an
    # output is missing or its shape differs from the reference's (the outputs cannot be compared).
    max_abs_err: float
    tolerance: tuple[float, float]  # (rtol, atol) before atol is scaled by each output's largest value
    failed_output: int | None = None  # position of the first output that is missing, mis-shaped or out of tolerance
    problem: str | None = None  # what is wrong with that output, e.g. "has shape [2, 3], the reference [3, 2]"


def compare_output(
    got: Sequence[np.ndarray | None],
    want: Sequence[np.ndarray],
    dtype_names: Sequence[str],
    output_dtypes: Sequence[str],
) -> OutputComparison:
    """Compare a kernel's outputs `got` (None for an output the binary did not produce) with the reference's
    `want`, position by position.

    The tolerance is `tolerance(dtype_names)`, the dtypes the kernel touches (operands and results). Each
    reference output is first rounded to its `output_dtypes` entry, as the kernel's final store rounds. A
    count or shape mismatch fails at once; otherwise every output is compared, so `max_abs_err` covers all.
    """
    rtol, atol = tolerance(dtype_names)
    max_abs_err = 0.0
    failed: tuple[int, str] | None = None
    if len(got) != len(want):
        index = min(len(got), len(want))
        problem = "is missing" if len(got) < len(want) else "has no reference"
        return OutputComparison(False, math.inf, (rtol, atol), index, problem)
    for index, (actual, expected, dtype) in enumerate(zip(got, want, output_dtypes, strict=True)):
        if actual is None:
            return OutputComparison(False, math.inf, (rtol, atol), index, "is missing")
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(expected).astype(dtypes.to_numpy(dtype)).astype(np.float64)
        if actual.shape != expected.shape:
            problem = f"has shape {list(actual.shape)}, the reference {list(expected.shape)}"
            return OutputComparison(False, math.inf, (rtol, atol), index, problem)
        err = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
        # NaN never compares, so it sticks once seen instead of being lost to max().
        max_abs_err = math.nan if math.isnan(err) or math.isnan(max_abs_err) else max(max_abs_err, err)
        # Rounding in a long float32 sum scales with the magnitude of what is summed, not with each element:
        # the absolute tolerance is relative to the output's largest value (at least 1).
        scale = max(1.0, float(np.max(np.abs(expected)))) if expected.size else 1.0
        if failed is None and not np.allclose(actual, expected, rtol=rtol, atol=atol * scale):
            failed = (index, f"differs from the numpy reference: max abs err {err:.3g}")
    if failed is None:
        return OutputComparison(True, max_abs_err, (rtol, atol))
    return OutputComparison(False, max_abs_err, (rtol, atol), *failed)


def sample_artifact_inputs(artifact: Artifact, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Valid random inputs for every graph input of `artifact` (see bridge.sampling)."""
    kernel_ops = [(k.func_name, k.operands, k.attrs) for k in artifact.kernels]
    return sample_graph_inputs(artifact.inputs, artifact.tensors, kernel_ops, rng)


def run_compiled(artifact: Artifact, inputs: Mapping[str, np.ndarray], check: bool = False) -> RunReport:
    """Execute every instruction of `artifact` in order; with `check`, compare each kernel's outputs with
    bridge.references.reference(func_name, operand arrays, attrs)."""
    started = time.perf_counter()
    missing = [name for name in artifact.inputs if name not in inputs]
    if missing:
        raise KernelRuntimeError(f"graph {artifact.graph}: no value for input {missing[0]!r}")
    values = {name: _bind(artifact, name, inputs[name]) for name in artifact.inputs}
    report = RunReport(artifact.graph, check)
    for index, inst in enumerate(artifact.instructions):
        for name in inst.operands:
            if name not in values:
                raise KernelRuntimeError(f"graph {artifact.graph}: instruction {index} reads {name!r} before it is set")
        if isinstance(inst, ElementwiseInstruction):
            values.update(_run_elementwise(artifact, inst, values))
            report.instructions.append(InstructionReport(index, inst.op, None))
            continue
        produced = _run_kernel(inst, values)
        item = InstructionReport(index, inst.name, inst.func_name)
        if check:
            _check(artifact, inst, values, produced, item)
        values.update(produced)
        report.instructions.append(item)
    read_later: set[str] = set()
    produced_names: list[str] = []
    for inst in reversed(artifact.instructions):
        produced_names[:0] = [name for name in inst.results if name not in read_later]
        read_later.update(inst.operands)
    report.outputs = list(dict.fromkeys(produced_names))
    report.values = values
    report.seconds = time.perf_counter() - started
    return report


def _bind(artifact: Artifact, name: str, value: np.ndarray) -> np.ndarray:
    tensor = artifact.tensors[name]
    array = np.asarray(value)
    if array.shape != view_shape(tensor):
        raise KernelRuntimeError(
            f"graph {artifact.graph}: input {name!r} has shape {list(array.shape)}, expected {list(view_shape(tensor))}"
        )
    return array.astype(dtypes.to_numpy(tensor.dtype), copy=False)


def _run_kernel(inst: KernelInstruction, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    binary_inputs = {arg: values[name] for arg, name in zip(inst.func_args, inst.operands, strict=True)}
    outputs = RUNNERS[inst.kernel_format](inst.klir_binary, binary_inputs)
    return {name: outputs[out] for out, name in zip(inst.func_outs, inst.results, strict=True)}


def _run_elementwise(
    artifact: Artifact, inst: ElementwiseInstruction, values: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    args = [np.asarray(values[name], dtype=np.float32) for name in inst.operands]
    result = ELEMENTWISE[inst.op](*args)
    return {name: result.astype(dtypes.to_numpy(artifact.tensors[name].dtype)) for name in inst.results}


def _check(
    artifact: Artifact,
    inst: KernelInstruction,
    values: Mapping[str, np.ndarray],
    produced: Mapping[str, np.ndarray],
    item: InstructionReport,
) -> None:
    try:
        expected = reference(inst.func_name, [values[name] for name in inst.operands], dict(inst.attrs))
    except (TypeError, ValueError, IndexError) as exc:  # operands or attrs the reference cannot take
        item.ok, item.error = False, f"reference {inst.func_name} failed: {type(exc).__name__}: {exc}"
        return
    comparison = compare_output(
        [produced[name] for name in inst.results],
        expected,
        [artifact.tensors[name].dtype for name in (*inst.operands, *inst.results)],
        [artifact.tensors[name].dtype for name in inst.results],
    )
    item.tolerance, item.max_abs_err, item.ok = comparison.tolerance, comparison.max_abs_err, comparison.ok
