"""`nkicache workload` and `nkicache quickstart`, the main job on the embedded default tier."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import click

from workers.cli_common import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    MODEL_COUNT,
    PROCESS_COUNT,
    SEED,
    compile_and_summarize,
    echo_json,
    load_cli_settings,
    plural,
    rates_text,
    run_one,
)


@click.command("workload")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="Folder for the graphs.")
@click.option("--models", type=MODEL_COUNT, default=12, show_default=True, help="Graph files to write.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="The same seed writes the same files.")
@click.option("--json", "as_json", is_flag=True, help="Print {out, models, seed, graphs: [path]}.")
def workload_command(out_dir: str, models: int, seed: int, as_json: bool) -> None:
    """Write realistic graph files: MoE transformer layers and UNet-like blocks, with layers repeated
    inside a model and shapes shared across models in a Zipf-like way (docs/workload.md)."""
    from workers.workload import generate_workload

    paths = generate_workload(out_dir, models, seed)
    if as_json:
        echo_json({"out": str(out_dir), "models": models, "seed": seed, "graphs": [str(p) for p in paths]})
    else:
        click.echo(f"{plural(len(paths), 'graph')} written to {out_dir}")


@click.command("quickstart")
@click.option(
    "--dir",
    "work_dir",
    type=click.Path(file_okay=False),
    default="nkicache-quickstart",
    show_default=True,
    help="Folder for the graphs, the artifacts and the tier file.",
)
@click.option("--models", type=MODEL_COUNT, default=12, show_default=True, help="Graphs to generate.")
@click.option("--workers", type=PROCESS_COUNT, default=2, show_default=True, help="Pool processes.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Workload and input seed.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object: cold, warm, check, warm_speedup and paths."
)
def quickstart_command(work_dir: str, models: int, workers: int, seed: int, as_json: bool) -> None:
    """The main job on the embedded tier, end to end: generate a workload, compile it cold with a pool
    (a fresh tier file in DIR), compile it again warm (every variant comes from the tier, nothing is
    traced), and run every compiled graph against the numpy references. Exit 1 if anything fails."""
    from workers.workload import generate_workload

    root = Path(work_dir)
    graphs, out, tier_path = root / "graphs", root / "out", root / "tier.sqlite"
    # A fresh start: a previous run's graphs and artifacts (more models, another seed) are not this run's.
    shutil.rmtree(graphs, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    for stale in root.glob("tier.sqlite*"):
        stale.unlink()
    files = [str(p) for p in generate_workload(graphs, models, seed)]
    settings = load_cli_settings(tier=f"local:{tier_path}", tier_mode="read-through")
    report: dict = {}
    failed = False
    for run in ("cold", "warm"):
        if not as_json:
            click.echo(
                f"== {run} compile: {plural(len(files), 'graph')}, {plural(workers, 'worker')}, tier local:{tier_path}"
            )
        summary, run_failed = compile_and_summarize(
            files,
            settings=settings,
            workers=workers,
            out_dir=str(out),
            target_name=None,
            as_json=as_json,
            print_json=False,
        )
        if summary["interrupted"]:  # Ctrl-C: stop here, not go on to the next run
            sys.exit(EXIT_INTERRUPTED)
        report[run] = {k: v for k, v in summary.items() if k not in ("graphs", "artifacts")}
        artifacts = summary["artifacts"]
        failed |= run_failed
    speedup = report["cold"]["seconds"] / report["warm"]["seconds"] if report["warm"]["seconds"] else 0.0
    checks = [run_one(path, seed, check=True) for path in sorted(artifacts)]  # this run's, and only those
    bad = [c for c in checks if "error" in c or not c["ok"]]
    kernels = sum(1 for c in checks if "error" not in c for i in c["instructions"] if i["func_name"] is not None)
    report["check"] = {"artifacts": len(checks), "kernels": kernels, "failed": [c["file"] for c in bad]}
    report["warm_speedup"] = round(speedup, 2)
    report["paths"] = {"graphs": str(graphs), "artifacts": str(out), "tier": f"local:{tier_path}"}
    failed |= bool(bad)
    if as_json:
        echo_json(report)
    else:
        warm_rates = rates_text(report["warm"])
        click.echo(
            f"== cold compile took {report['cold']['seconds']:.2f} s, warm {report['warm']['seconds']:.2f} s "
            "(wall times of the two compiles inside this process; a separate `nkicache compile` also "
            f"starts Python, `nkicache bench` times whole commands); traces {_traced(report['cold'])} -> "
            f"{_traced(report['warm'])}; warm {warm_rates}"
        )
        click.echo(
            f"== check: {len(checks)} compiled graphs run, {kernels} kernel outputs compared with numpy "
            f"references: {'all OK' if not bad else f'{len(bad)} FAILED'}"
        )
        click.echo(
            f"== everything is in {root}/: graphs in {graphs}, compiled artifacts in {out} (nkicache run "
            f"{out} --check), the tier in {tier_path} (nkicache report --tier local:{tier_path})"
        )
    if failed:
        sys.exit(EXIT_CHECK_FAILED)


def _traced(summary: dict) -> int:
    """Variants a compile traced, by its passes or by its processes in parallel (`parallel_traces`)."""
    return int(summary.get("traces", 0))  # every trace, the parallel ones included
