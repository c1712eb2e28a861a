"""`nkicache compile` and `run`: compiling graphs and running what was compiled."""

from __future__ import annotations

import sys
import time

import click

from workers.cli_common import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    PROCESS_COUNT,
    SEED,
    compile_and_summarize,
    echo_json,
    expand,
    load_cli_settings,
    plural,
    run_one,
    tier_options,
)

# -- compile ----------------------------------------------------------------------------------------
GRAPH_SUFFIX = ".json"
DEFAULT_OUT_DIR = "out"


@click.command("compile")
@click.argument("graphs", nargs=-1, required=True, metavar="GRAPH_OR_DIR...")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=DEFAULT_OUT_DIR,
    show_default=True,
    help="Folder the compiled basic blocks (<graph name>.nkibb) are written to.",
)
@click.option(
    "--workers",
    type=PROCESS_COUNT,
    default=None,
    help="Processes tracing the graphs' kernel variants in parallel (the passes then run in order, each handed "
    "what was traced for it; a single graph gets them all too). Default: the number of CPUs (at most one per graph).",
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
@click.option(
    "--retry-failed",
    is_flag=True,
    help="Trace again the kernels the tier knows fail to compile (negative entries, kept failure_ttl seconds), "
    "instead of failing at once with their message.",
)
@tier_options
def compile_command(
    graphs: tuple[str, ...],
    out_dir: str,
    workers: int | None,
    as_json: bool,
    target_name: str | None,
    retry_failed: bool,
    tier: tuple[str, ...],
    tier_mode: str | None,
) -> None:
    """Compile graph files to BIR basic blocks, one compilation pass per file, in parallel processes.

    A directory stands for its *.json files, sorted. Each pass runs a fresh codegen loop, so its kernel
    cache (the specification's) lives only as long as the pass. On a miss the loop asks the tier (by
    default an SQLite file under ~/.cache/nkicache) before tracing, and mirrors what it traced there, so
    a kernel variant traced once is not traced again by a later pass or another process. Each result is
    written atomically to OUT/<graph name>.nkibb (docs/artifact-format.md), which `nkicache run`
    executes. Ctrl-C stops handing out graphs; running passes finish and keep their artifacts, the summary
    of what finished is printed (with an "interrupted" line, or "interrupted": true) and the exit code is 130.

    A graph that fails (malformed file, unknown func_name, shapes a kernel cannot take) is reported as
    one line on stderr naming the file, the op and the cause; the other graphs are still compiled and
    the exit code is 1. A kernel that failed to compile is remembered by the tier for failure_ttl seconds
    (a negative entry: `inspect ls --failed`), and every pass that meets it fails at once with the same
    message (known_failures) instead of compiling it again; --retry-failed compiles it again. A tier that is
    down costs counted errors, never a failed compile.

    Two hit rates, never mixed: the shared-cache hit rate (remote_hits / tier_lookups: what the tier answered
    of the in-pass misses that asked it; n/a, null in JSON, when none did, as with --tier off) and the in-pass
    hit rate (the specification's cache_hits / kernels: the pass's own cache, which needs no tier).

    --json keys: passes, compiled, kernels, cache_hits, cache_misses, tier_lookups, remote_hits, traces (beta3
    compiles actually run), traces_refused (traces another process handed over from other code than this
    compiler's, traced again here), known_failures, compile_seconds, tier_saved_seconds,
    in_pass_saved_seconds, lease_waits, tier_errors, tier_timeouts,
    tier_rejected, tier_dropped, shared_hit_rate, in_pass_hit_rate, seconds, workers, tier, tier_mode,
    level_hits ({tier level: verified entries it answered}, nearest first), interrupted, artifacts,
    failed ([{file, error}]) and graphs (the same figures per pass). tier_dropped counts every write that did
    not reach the tier, the ones still queued when the compile ends with the tier down included: those are
    in the totals only, no pass's figures hold them.
    """
    import os

    files = expand(graphs, GRAPH_SUFFIX)
    if not files:
        raise click.UsageError(f"no {GRAPH_SUFFIX} graph files in {', '.join(graphs)}")
    settings = load_cli_settings(tier=tier, tier_mode=tier_mode, retry_failed=retry_failed or None)
    workers = workers or min(os.cpu_count() or 1, len(files))
    summary, failed = compile_and_summarize(
        files, settings=settings, workers=workers, out_dir=out_dir, target_name=target_name, as_json=as_json
    )
    if summary["interrupted"]:
        sys.exit(EXIT_INTERRUPTED)
    if failed:
        sys.exit(EXIT_CHECK_FAILED)


# -- run ------------------------------------------------------------------------------------------
@click.command("run")
@click.argument("compiled", nargs=-1, required=True, metavar="COMPILED...")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--check", is_flag=True, help="Compare every kernel's outputs with its numpy reference.")
@click.option("--verbose", "-v", is_flag=True, help="With --check, a line per kernel, not only per mismatch.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of lines.")
def run_command(compiled: tuple[str, ...], seed: int, check: bool, verbose: bool, as_json: bool) -> None:
    """Execute compiled basic blocks (.nkibb files from `nkicache compile`) on seeded random inputs.

    A directory stands for its *.nkibb files, sorted. Inputs are valid for the kernels that read them
    (e.g. BlockwiseMatmul token ids and expert map) and the same for the same seed. With --check every
    kernel instruction's outputs are compared with the kernel's numpy reference (float32 tight,
    bfloat16/float16 loose). Text output: a line per artifact, a line per kernel that does not match (every
    kernel with --verbose), and a summary line.

    Exit code 1 when a check fails or an artifact cannot be loaded or run (each such file is reported as
    one line on stderr naming it).

    --json keys: ok, seed, checked, seconds, artifacts ([{file, graph, target, ok, seconds, instructions:
    [{index, name, func_name, max_abs_err, ok}], outputs: {tensor: sha256}}]), failed ([{file, error}]).
    """
    started = time.perf_counter()
    files = expand(compiled, ".nkibb")
    if not files:
        raise click.UsageError(f"no .nkibb files in {', '.join(compiled)}")
    results = [run_one(path, seed, check) for path in files]
    failed = [r for r in results if "error" in r]
    ran = [r for r in results if "error" not in r]
    for r in failed:
        click.echo(f"nkicache: error: {r['error']}", err=True)
    ok = not failed and all(r["ok"] for r in ran)
    if as_json:
        echo_json(
            {
                "ok": ok,
                "seed": seed,
                "checked": check,
                "seconds": time.perf_counter() - started,
                "artifacts": ran,
                "failed": failed,
            }
        )
    else:
        for r in ran:
            kernels = [i for i in r["instructions"] if i["func_name"] is not None]
            verdict = ("OK" if r["ok"] else "FAILED") if check else "ran"
            click.echo(
                f"{r['file']}: {r['graph']} ({r['target']}), {len(r['instructions'])} instructions, "
                f"{plural(len(kernels), 'kernel')}, {r['seconds']:.2f} s -> {verdict}"
            )
            if check:
                for i in kernels:
                    if i["ok"] and not verbose:
                        continue
                    err = "n/a" if i["max_abs_err"] is None else f"{i['max_abs_err']:.1e}"
                    verdict = "ok" if i["ok"] else "MISMATCH" + (f" ({i['error']})" if i["error"] else "")
                    click.echo(f"  [{i['index']}] {i['func_name']} {i['name']}: max abs err {err} {verdict}")
        click.echo(_run_summary(ran, failed, check))
    if not ok:
        sys.exit(EXIT_CHECK_FAILED)


def _run_summary(ran: list[dict], failed: list[dict], check: bool) -> str:
    """'12 artifacts run, 210 kernel outputs checked: all OK' (or how many mismatched, and in how many)."""
    kernels = [i for r in ran for i in r["instructions"] if i["func_name"] is not None]
    line = f"{plural(len(ran), 'artifact')} run"
    if check:
        bad = sum(1 for i in kernels if not i["ok"])
        bad_artifacts = sum(1 for r in ran if not r["ok"])
        verdict = "all OK" if not bad else f"{bad} MISMATCHED in {plural(bad_artifacts, 'artifact')}"
        line += f", {len(kernels)} kernel outputs checked against numpy references: {verdict}"
    if failed:
        line += f"; {len(failed)} could not be loaded or run"
    return line
