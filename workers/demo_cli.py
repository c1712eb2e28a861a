"""`nkicache demo`: one internal kernel compiled, run and checked against its numpy reference."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import click
import msgspec

from workers.cli_common import EXIT_CHECK_FAILED, SEED, echo_json


class DemoCase(msgspec.Struct, frozen=True):
    """One internal kernel call: operand and result tensors as (name, shape), float32 throughout."""

    kernel_name: str
    operands: tuple[tuple[str, tuple[int, ...]], ...]
    results: tuple[tuple[str, tuple[int, ...]], ...]
    attrs: dict[str, Any] = msgspec.field(default_factory=dict)


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


def _describe(names_and_shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> str:
    return " ".join(f"{name}[{','.join(str(d) for d in shape)}]" for name, shape in names_and_shapes)


@click.command()
@click.option(
    "--func-name",
    type=click.Choice(sorted(DEMO_CASES)),
    default="Matmul",
    show_default=True,
    help="Internal kernel to compile and run.",
)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a line.")
def demo(func_name: str, seed: int, as_json: bool) -> None:
    """Compile one internal kernel, run the binary and check it against the numpy reference.

    Exits 1 when the outputs differ from the reference.
    """
    import numpy as np

    import bridge
    from bridge.graph_runner import compare_output
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
    # The same check as `nkicache run --check`: every demo tensor is float32.
    comparison = compare_output(actual, expected, ["float32"], ["float32"] * len(actual))
    max_abs_err, ok = comparison.max_abs_err, comparison.ok
    instructions = bridge.binary_info(binary)["instructions"]

    if as_json:
        echo_json(
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
    else:
        click.echo(
            f"{func_name} {case.kernel_name} {_describe(case.operands)} -> {_describe(case.results)}: "
            f"binary {len(binary)} bytes, {instructions} instructions, "
            f"compiled in {compile_seconds:.2f} s, max abs err {max_abs_err:.1e} -> "
            f"{'OK' if ok else 'FAILED'}"
        )
    if not ok:
        sys.exit(EXIT_CHECK_FAILED)
