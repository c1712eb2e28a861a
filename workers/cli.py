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


# -- compile ----------------------------------------------------------------------------------------
GRAPH_SUFFIX = ".json"
DEFAULT_OUT_DIR = "out"


@dataclass
class PassReport:
    """One compilation pass: one graph file, one fresh BirCodeGenLoop."""

    file: str
    graph: str | None = None
    target: str | None = None
    kernels: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    traces: int = 0
    seconds: float = 0.0
    artifact: str | None = None
    error: str | None = None


def _expand(paths: tuple[str, ...], suffix: str) -> list[str]:
    """Files in command-line order; a directory stands for its *suffix files, sorted by name."""
    from pathlib import Path

    files: list[str] = []
    for path in paths:
        if Path(path).is_dir():
            files.extend(str(p) for p in sorted(Path(path).glob(f"*{suffix}")) if p.is_file())
        else:
            files.append(path)
    return files


def _compile_pass(path: str, out_dir: str, target_name: str | None, written: dict[str, str]) -> PassReport:
    """Load, lower and write one graph. Project errors end up in `report.error`, one line naming the file."""
    from bridge.artifact import ArtifactError, artifact_filename, build_artifact, write_artifact
    from bridge.codegen import BirCodeGenLoop
    from bridge.errors import NkiCacheError
    from bridge.graph import load_graph
    from bridge.targets import get_platform_target, make_target

    report = PassReport(path)
    started = time.perf_counter()
    loop = None
    try:
        graph = load_graph(path)
        report.graph = graph.name
        target = make_target(target_name or graph.target) if (target_name or graph.target) else get_platform_target()
        report.target = type(target).__name__
        loop = BirCodeGenLoop(target)  # a fresh loop: the cache is per-pass and dies with it
        bb = loop.run(graph)
        artifact = build_artifact(graph, bb, report.target)
        name = artifact_filename(graph.name)
        if name in written:
            raise ArtifactError(
                f"{path}: graph name {graph.name!r} was already compiled from {written[name]} "
                f"in this call; its artifact {name} would be overwritten"
            )
        report.artifact = str(write_artifact(artifact, out_dir))
        written[name] = path
    except NkiCacheError as exc:
        report.error = " ".join(str(exc).split())  # one line, whatever the cause's message holds
    except Exception as exc:  # a bug in one pass must not cost the other graphs their compile
        report.error = " ".join(f"{path}: internal error (a bug, please report): {type(exc).__name__}: {exc}".split())
    finally:
        if loop is not None:
            report.cache_hits, report.cache_misses = loop.cache_hits, loop.cache_misses
            report.kernels = loop.cache_hits + loop.cache_misses  # one of the two per kernel op seen
            report.traces = loop.traces
        report.seconds = time.perf_counter() - started
    return report


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 'es' if word.endswith('s') else 's'}"


@main.command("compile")
@click.argument("graphs", nargs=-1, required=True, metavar="GRAPH_OR_DIR...")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=DEFAULT_OUT_DIR,
    show_default=True,
    help="Folder the compiled basic blocks (<graph name>.nkibb) are written to.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (totals, artifacts, failures).")
@click.option(
    "--target",
    "target_name",
    type=click.Choice(["Trn1", "Trn2"]),
    default=None,
    help="Compile for this target, overriding the graph files' own. Default: each graph's target, "
    "else $NKICACHE_TARGET, else Trn2.",
)
def compile_command(graphs: tuple[str, ...], out_dir: str, as_json: bool, target_name: str | None) -> None:
    """Compile graph files to BIR basic blocks, one compilation pass per file.

    A directory stands for its *.json files, sorted. Each pass runs a fresh codegen loop, so its kernel
    cache lives only as long as the pass: identical kernels within one graph are traced once, across
    graphs again. Each result is written atomically to OUT/<graph name>.nkibb (see
    docs/artifact-format.md), which `nkicache run` executes.

    A graph that fails (malformed file, unknown func_name, shapes a kernel cannot take) is reported as
    one line on stderr naming the file, the op and the cause; the other graphs are still compiled and
    the exit code is 1.

    --json keys: passes, compiled, kernels, cache_hits, cache_misses, traces (beta3 compiles actually
    run), seconds, artifacts, failed ([{file, error}]) and graphs (the same figures per pass).
    """
    started = time.perf_counter()
    written: dict[str, str] = {}
    reports = [_compile_pass(path, out_dir, target_name, written) for path in _expand(graphs, GRAPH_SUFFIX)]
    if not reports:
        raise click.UsageError(f"no {GRAPH_SUFFIX} graph files in {', '.join(graphs)}")
    seconds = time.perf_counter() - started
    failed = [r for r in reports if r.error]
    for report in failed:
        click.echo(f"nkicache: error: {report.error}", err=True)
    totals = {key: sum(getattr(r, key) for r in reports) for key in ("kernels", "cache_hits", "cache_misses", "traces")}
    if as_json:
        click.echo(
            json.dumps(
                {
                    "passes": len(reports),
                    "compiled": len(reports) - len(failed),
                    **totals,
                    "seconds": seconds,
                    "artifacts": [r.artifact for r in reports if r.artifact],
                    "failed": [{"file": r.file, "error": r.error} for r in failed],
                    "graphs": [r.__dict__ for r in reports],
                }
            )
        )
    else:
        for r in reports:
            if r.artifact:
                click.echo(
                    f"{r.file} -> {r.artifact}: {r.target}, {_plural(r.kernels, 'kernel')}, "
                    f"{_plural(r.cache_hits, 'hit')}, {_plural(r.cache_misses, 'miss')}, "
                    f"{_plural(r.traces, 'trace')}, {r.seconds:.2f} s"
                )
        click.echo(
            f"{_plural(len(reports), 'pass')} ({len(reports) - len(failed)} compiled, {len(failed)} failed): "
            f"{_plural(totals['kernels'], 'kernel')}, {_plural(totals['cache_hits'], 'hit')}, "
            f"{_plural(totals['cache_misses'], 'miss')}, {_plural(totals['traces'], 'trace')}, {seconds:.2f} s"
        )
    if failed:
        sys.exit(EXIT_CHECK_FAILED)


# -- run ------------------------------------------------------------------------------------------
def _run_one(path: str, seed: int, check: bool) -> dict:
    """Load, sample, execute (and check) one artifact; a project error becomes {'error': one line}."""
    import numpy as np

    from bridge.artifact import load_artifact
    from bridge.errors import NkiCacheError
    from bridge.graph_runner import run_compiled, sample_artifact_inputs

    try:
        artifact = load_artifact(path)
        inputs = sample_artifact_inputs(artifact, np.random.default_rng(seed))
        report = run_compiled(artifact, inputs, check=check)
    except NkiCacheError as exc:
        return {"file": path, "error": " ".join(str(exc).split())}
    return {
        "file": path,
        "graph": report.graph,
        "target": artifact.target,
        "ok": report.ok,
        "seconds": report.seconds,
        "instructions": [item.as_json() for item in report.instructions],
        "outputs": report.output_digests(),
    }


@main.command("run")
@click.argument("compiled", nargs=-1, required=True, metavar="COMPILED...")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--check", is_flag=True, help="Compare every kernel's outputs with its numpy reference.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of lines.")
def run_command(compiled: tuple[str, ...], seed: int, check: bool, as_json: bool) -> None:
    """Execute compiled basic blocks (.nkibb files from `nkicache compile`) on seeded random inputs.

    A directory stands for its *.nkibb files, sorted. Inputs are valid for the kernels that read them
    (e.g. BlockwiseMatmul token ids and expert map) and the same for the same seed. With --check every
    kernel instruction's outputs are compared with the kernel's numpy reference (float32 tight,
    bfloat16/float16 loose).

    Exit code 1 when a check fails or an artifact cannot be loaded or run (each such file is reported as
    one line on stderr naming it).

    --json keys: ok, seed, checked, seconds, artifacts ([{file, graph, target, ok, seconds, instructions:
    [{index, name, func_name, max_abs_err, ok}], outputs: {tensor: sha256}}]), failed ([{file, error}]).
    """
    started = time.perf_counter()
    files = _expand(compiled, ".nkibb")
    if not files:
        raise click.UsageError(f"no .nkibb files in {', '.join(compiled)}")
    results = [_run_one(path, seed, check) for path in files]
    failed = [r for r in results if "error" in r]
    ran = [r for r in results if "error" not in r]
    for r in failed:
        click.echo(f"nkicache: error: {r['error']}", err=True)
    ok = not failed and all(r["ok"] for r in ran)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ok": ok,
                    "seed": seed,
                    "checked": check,
                    "seconds": time.perf_counter() - started,
                    "artifacts": ran,
                    "failed": failed,
                }
            )
        )
    else:
        for r in ran:
            kernels = [i for i in r["instructions"] if i["func_name"] is not None]
            verdict = ("OK" if r["ok"] else "FAILED") if check else "ran"
            click.echo(
                f"{r['file']}: {r['graph']} ({r['target']}), {len(r['instructions'])} instructions, "
                f"{_plural(len(kernels), 'kernel')}, {r['seconds']:.2f} s -> {verdict}"
            )
            if check:
                for i in kernels:
                    err = "n/a" if i["max_abs_err"] is None else f"{i['max_abs_err']:.1e}"
                    verdict = "ok" if i["ok"] else "MISMATCH" + (f" ({i['error']})" if i["error"] else "")
                    click.echo(f"  [{i['index']}] {i['func_name']} {i['name']}: max abs err {err} {verdict}")
    if not ok:
        sys.exit(EXIT_CHECK_FAILED)


if __name__ == "__main__":
    main()
