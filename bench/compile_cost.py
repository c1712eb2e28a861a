"""Compile cost per kernel and shape: instructions, binary bytes, compile time and run time.

A benchmark, not a test: it prints a Markdown table for bench/RESULTS.md.

    python bench/compile_cost.py            # every case, median of 5 compiles and 5 runs
    python bench/compile_cost.py --quick    # the smaller cases, 1 compile and 1 run each
    python bench/compile_cost.py --kernel Matmul --runs 9

Later kernels add rows by appending a `Case` to `CASES` (here, or from another script that imports this
module and calls `main`). A case whose inputs need real values (int32 indices, say) passes `make_inputs`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

import bridge
from bridge import Tensor
from bridge.dtypes import to_numpy

Spec = tuple[tuple[int, ...], str]  # (shape, dtype)


@dataclass(frozen=True)
class Case:
    func_name: str
    operands: tuple[Spec, ...]
    results: tuple[Spec, ...]
    attrs: dict = field(default_factory=dict)
    shape: str = ""  # how the table shows the problem size, e.g. "K=M=N=1024"
    quick: bool = True  # part of --quick
    # Inputs in operand order; the default fills floats with N(0, 1) and int32 operands with zeros.
    make_inputs: Callable[[np.random.Generator], list[np.ndarray]] | None = None

    @property
    def dtype(self) -> str:
        return "/".join(sorted({dtype for _, dtype in self.operands + self.results}))

    def inputs(self, rng: np.random.Generator) -> list[np.ndarray]:
        if self.make_inputs is not None:
            return self.make_inputs(rng)
        arrays = []
        for shape, dtype in self.operands:
            if dtype == "int32":
                arrays.append(np.zeros(shape, np.int32))
            else:
                arrays.append(rng.standard_normal(shape, dtype=np.float32).astype(to_numpy(dtype)))
        return arrays


def matmul(k: int, m: int, n: int, dtype: str = "float32", quick: bool = False) -> Case:
    return Case(
        "Matmul", (((k, m), dtype), ((k, n), dtype)), (((m, n), dtype),), shape=f"K={k} M={m} N={n}", quick=quick
    )


def softmax(rows: int, cols: int, dtype: str = "float32", quick: bool = False) -> Case:
    return Case("Softmax", (((rows, cols), dtype),), (((rows, cols), dtype),), shape=f"{rows}x{cols}", quick=quick)


def rmsnorm(rows: int, cols: int, dtype: str = "float32", quick: bool = False) -> Case:
    return Case(
        "RMSNorm",
        (((rows, cols), dtype), ((cols,), dtype)),
        (((rows, cols), dtype),),
        {"eps": 1e-6},
        shape=f"{rows}x{cols}",
        quick=quick,
    )


CASES: list[Case] = [
    matmul(300, 200, 700, quick=True),  # ragged on every axis
    matmul(1024, 1024, 1024, quick=True),
    matmul(1024, 1024, 1024, "bfloat16"),
    matmul(4096, 512, 512),
    matmul(512, 4096, 512),
    softmax(1000, 1000, quick=True),
    softmax(4096, 4096),
    softmax(4096, 4096, "bfloat16"),
    rmsnorm(1000, 1000, quick=True),
    rmsnorm(4096, 4096),
    rmsnorm(4096, 4096, "bfloat16"),
]


@dataclass
class Row:
    kernel: str
    shape: str
    dtype: str
    instructions: int
    binary_bytes: int
    compile_seconds: float
    run_seconds: float


def compile_case(case: Case) -> dict:
    return bridge.compile_kernel(
        case.func_name,
        [Tensor(f"operand{i}", shape, dtype) for i, (shape, dtype) in enumerate(case.operands)],
        [Tensor(f"result{i}", shape, dtype) for i, (shape, dtype) in enumerate(case.results)],
        case.attrs,
    )


def median_seconds(action: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, value = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        value = action()
        times.append(time.perf_counter() - start)
    return statistics.median(times), value


def measure(case: Case, compile_runs: int = 5, run_runs: int = 5, seed: int = 0) -> Row:
    """Compile `case` compile_runs times and run the binary run_runs times; medians of each. One untimed
    compile first, so the first case does not also pay for imports and parsing the kernel source."""
    compile_case(case)
    compile_seconds, result = median_seconds(lambda: compile_case(case), compile_runs)
    binary = result["binary"]
    info = bridge.binary_info(binary)
    inputs = dict(zip(result["input_names"], case.inputs(np.random.default_rng(seed)), strict=True))
    run_seconds, _ = median_seconds(lambda: bridge.run_bir(binary, inputs), run_runs)
    return Row(
        kernel=f"{case.func_name} ({info['kernel']})",
        shape=case.shape,
        dtype=case.dtype,
        instructions=info["instructions"],
        binary_bytes=len(binary),
        compile_seconds=compile_seconds,
        run_seconds=run_seconds,
    )


def format_table(rows: Sequence[Row]) -> str:
    header = "| kernel | shape | dtype | instructions | binary bytes | compile s (median) | run s (median) |"
    lines = [header, "|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row.kernel} | {row.shape} | {row.dtype} | {row.instructions:,} | {row.binary_bytes:,} "
            f"| {row.compile_seconds:.4f} | {row.run_seconds:.4f} |"
        )
    return "\n".join(lines)


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, numpy {np.__version__}"
    )


def main(argv: Sequence[str] | None = None, cases: Sequence[Case] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the smaller cases, one compile and one run each")
    parser.add_argument("--runs", type=int, default=None, help="compiles per case (default 5, 1 with --quick)")
    parser.add_argument("--run-runs", type=int, default=None, help="runs per case (default 5, 1 with --quick)")
    parser.add_argument("--kernel", action="append", default=None, help="only this func_name (repeatable)")
    args = parser.parse_args(argv)
    compile_runs = args.runs or (1 if args.quick else 5)
    run_runs = args.run_runs or (1 if args.quick else 5)
    selected = [
        case
        for case in (CASES if cases is None else cases)
        if (case.quick or not args.quick) and (args.kernel is None or case.func_name in args.kernel)
    ]
    if not selected:
        parser.error("no case matches the given --kernel/--quick")
    print(f"machine: {machine_description()}")
    print(f"compiles per case: {compile_runs}, runs per case: {run_runs}\n")
    rows = []
    for case in selected:
        rows.append(measure(case, compile_runs, run_runs))
        print(f"  measured {rows[-1].kernel} {rows[-1].shape} {rows[-1].dtype}", file=sys.stderr, flush=True)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
