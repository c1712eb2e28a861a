"""The `nkicache` command line.

The bridge is imported inside each command, not at module level, so `nkicache --help` and
`nkicache --version` work even when the compiler side is broken.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import click

# Exit codes: 1 = a check failed (the command ran, the answer is wrong); 2 = a project error
# (bad kernel, corrupt binary, ...) reported as one line; click's usage errors also exit 2.
EXIT_CHECK_FAILED = 1
EXIT_PROJECT_ERROR = 2

# Tolerance of the demo's comparison with the numpy reference (float32 kernels).
DEMO_RTOL = 1e-4
DEMO_ATOL = 1e-4


@dataclass(frozen=True)
class DemoCase:
    """One internal kernel call: operand and result tensors as (name, shape), float32 throughout."""

    kernel_name: str
    operands: tuple[tuple[str, tuple[int, ...]], ...]
    results: tuple[tuple[str, tuple[int, ...]], ...]
    attrs: dict[str, Any] = field(default_factory=dict)


DEMO_CASES: dict[str, DemoCase] = {
    "Matmul": DemoCase(
        kernel_name="matmul_tiled",
        operands=(("lhsT", (256, 200)), ("rhs", (256, 300))),
        results=(("out", (200, 300)),),
    ),
    "Softmax": DemoCase(
        kernel_name="softmax",
        operands=(("x", (300, 1000)),),
        results=(("out", (300, 1000)),),
    ),
    "RMSNorm": DemoCase(
        kernel_name="rmsnorm",
        operands=(("a", (300, 700)), ("g", (700,))),
        results=(("out", (300, 700)),),
        attrs={"eps": 1e-6},
    ),
}


def _is_project_error(exc: BaseException) -> bool:
    try:
        from bridge.errors import NkiCacheError
    except ImportError:
        return False
    return isinstance(exc, NkiCacheError)


class _Group(click.Group):
    """A click group that prints the project's own errors as one line on stderr and exits 2."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            if not _is_project_error(exc):
                raise
            click.echo(f"nkicache: error: {exc}", err=True)
            ctx.exit(EXIT_PROJECT_ERROR)


@click.group(cls=_Group)
@click.version_option(package_name="nkicache", prog_name="nkicache")
def main() -> None:
    """nkicache: a distributed build cache for a kernel compiler's NKI-frontend bridge."""


def _describe(names_and_shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
    return " ".join(f"{name}[{','.join(str(d) for d in shape)}]" for name, shape in names_and_shapes)


@main.command()
@click.option(
    "--func-name",
    type=click.Choice(sorted(DEMO_CASES)),
    default="Matmul",
    show_default=True,
    help="Internal kernel to compile and run.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a line.")
def demo(func_name: str, seed: int, as_json: bool) -> None:
    """Compile one internal kernel, run the binary and check it against the numpy reference.

    Exits 1 when the outputs differ from the reference.
    """
    import numpy as np

    import bridge
    from bridge.references import reference

    case = DEMO_CASES[func_name]
    operands = [bridge.Tensor(name, shape, "float32") for name, shape in case.operands]
    results = [bridge.Tensor(name, shape, "float32") for name, shape in case.results]
    rng = np.random.default_rng(seed)
    inputs = [rng.standard_normal(shape).astype(np.float32) for _, shape in case.operands]

    started = time.perf_counter()
    compiled = bridge.compile_kernel(func_name, operands, results, dict(case.attrs))
    compile_seconds = time.perf_counter() - started

    binary = compiled["binary"]
    outputs = bridge.run_bir(binary, dict(zip(compiled["input_names"], inputs, strict=True)))
    actual = [outputs[name] for name in compiled["output_names"]]
    expected = reference(func_name, inputs, dict(case.attrs))
    max_abs_err, ok = _compare(actual, expected)
    instructions = bridge.binary_info(binary)["instructions"]

    if as_json:
        click.echo(
            json.dumps(
                {
                    "func_name": func_name,
                    "kernel_name": case.kernel_name,
                    "bytes": len(binary),
                    "instructions": instructions,
                    "compile_seconds": compile_seconds,
                    # JSON has no NaN or infinity: a non-finite error (or a shape mismatch) is null.
                    "max_abs_err": max_abs_err if math.isfinite(max_abs_err) else None,
                    "ok": ok,
                }
            )
        )
    else:
        click.echo(
            f"{func_name} {case.kernel_name} {_describe(case.operands)} -> {_describe(case.results)}: "
            f"binary {len(binary)} bytes, {instructions} instructions, "
            f"compiled in {compile_seconds:.2f} s, max abs err {max_abs_err:.1e} -> "
            f"{'OK' if ok else 'FAILED'}"
        )
    if not ok:
        sys.exit(EXIT_CHECK_FAILED)


def _compare(actual: list, expected: list) -> tuple[float, bool]:
    """Largest absolute error over all outputs, and whether every output is within tolerance.

    A shape mismatch or a missing output fails the check; NaN never compares equal.
    """
    import numpy as np

    if len(actual) != len(expected):
        return float("inf"), False
    max_abs_err = 0.0
    ok = True
    for got, want in zip(actual, expected, strict=True):
        got = np.asarray(got, dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            return float("inf"), False
        if got.size:
            err = float(np.max(np.abs(got - want)))
            max_abs_err = err if np.isnan(err) else max(max_abs_err, err)
        ok = ok and bool(np.allclose(got, want, rtol=DEMO_RTOL, atol=DEMO_ATOL))
    return max_abs_err, ok


if __name__ == "__main__":
    main()
