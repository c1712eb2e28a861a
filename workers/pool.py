"""The local pool: `nkicache compile --workers N`, all processes sharing the configured tier.

With one worker every pass runs here, one after the other. With N, this process and N - 1 pool processes
trace the compile's distinct kernel variants (workers/variant_pool.py, bridge/parallel.py), and this process
runs each pass, in order, with a fresh BirCodeGenLoop handed the variants traced for it. Each pool process
opens its own tier client once. Pool processes ignore Ctrl-C: the parent stops tracing and starting passes,
lets the running ones finish (artifacts are written atomically) and reports what was done.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from pathlib import Path

from cachestore.settings import Settings
from cachestore.stores import open_tier
from workers.compile_run import CompileRun, CtrlC, import_tier_library
from workers.passes import PassResult, compile_graph


def duplicate_names(paths: Sequence[str], max_bytes: int) -> dict[str, str]:
    """{path: error} for graph files whose artifact name an earlier file in `paths` already takes; a
    file that cannot be read or is larger than `max_bytes` is left to its pass to report."""
    from bridge.artifact import artifact_filename
    from bridge.graph import GraphError, parse_graph_json, read_graph_file

    seen: dict[str, str] = {}
    errors: dict[str, str] = {}
    for path in paths:
        try:
            name = parse_graph_json(read_graph_file(path, max_bytes), path).get("name") or Path(path).stem
        except GraphError:
            continue
        filename = artifact_filename(str(name))
        if filename in seen:
            errors[path] = (
                f"{path}: graph name {name!r} was already compiled from {seen[filename]} in this call; "
                f"its artifact {filename} would be overwritten"
            )
        else:
            seen[filename] = path
    return errors


def compile_run(
    paths: Sequence[str],
    *,
    settings: Settings,
    workers: int,
    out_dir: str,
    target_name: str | None = None,
    on_result: Callable[[PassResult], None] = lambda result: None,
) -> CompileRun:
    """Compile every path (results in input order, whether Ctrl-C stopped it, what the tier dropped outside
    the passes), and close the tier clients the compile opened."""
    from bridge.artifact import ArtifactError

    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # before any pass: every artifact would fail the same way
        raise ArtifactError(f"{out_dir}: cannot create the output folder: {exc.strerror or exc}") from None
    refused = duplicate_names(paths, settings.max_graph_bytes)
    # What the imports and settings made lives until the process exits: frozen, the collector does not walk it
    # again on every full collection and at exit (~5% of a warm one-graph compile's instructions), and forked
    # helpers do not copy its pages by touching their reference counts.
    gc.freeze()
    run = _compile_all(
        [p for p in paths if p not in refused],
        settings=settings,
        workers=workers,
        out_dir=out_dir,
        target_name=target_name,
        on_result=on_result,
    )
    by_path = {result.file: result for result in run.results}
    results = []
    for path in paths:
        if path in refused:
            results.append(PassResult(path, error=refused[path]))
            on_result(results[-1])
        elif path in by_path:
            results.append(by_path[path])
    run.results = results
    return run


def _compile_all(
    paths: Sequence[str],
    *,
    settings: Settings,
    workers: int,
    out_dir: str,
    target_name: str | None,
    on_result: Callable[[PassResult], None],
) -> CompileRun:
    if workers <= 1:
        return _compile_serially(paths, settings, out_dir, target_name, on_result)
    from workers.variant_pool import compile_in_parallel

    return compile_in_parallel(
        paths, settings=settings, workers=workers, out_dir=out_dir, target_name=target_name, on_result=on_result
    )


def _compile_serially(
    paths: Sequence[str],
    settings: Settings,
    out_dir: str,
    target_name: str | None,
    on_result: Callable[[PassResult], None],
) -> CompileRun:
    tier = open_tier(settings)
    if tier is not None:
        import_tier_library(settings)
    results: list[PassResult] = []
    try:
        with CtrlC() as ctrl_c:
            for path in paths:
                if ctrl_c.pressed:
                    break
                result, _ = compile_graph(
                    path, tier=tier, target_name=target_name, out_dir=out_dir, limits=settings.limits()
                )
                results.append(result)
                on_result(result)
    finally:
        if tier is not None:
            tier.close()
    run = CompileRun(results, ctrl_c.pressed)
    if tier is not None:
        # The client counts every drop of its life; the passes counted theirs: the rest happened outside them.
        passes_dropped = sum(int(r.counts.get("tier_dropped", 0)) for r in results)
        run.tier_dropped_outside_passes = tier.counts()["tier_dropped"] - passes_dropped
    return run
