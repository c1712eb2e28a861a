"""`nkicache exec [tier options] -- COMMAND [ARGS]...`: COMMAND runs with the tier attached to every codegen loop
its Python processes create (workers.attach, through workers/exec_bootstrap/sitecustomize.py)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import click

from workers.cli_common import EXIT_PROJECT_ERROR, load_cli_settings, tier_options

BOOTSTRAP = Path(__file__).resolve().parent / "exec_bootstrap"
DEFAULT_LOOPS = (
    "bridge.codegen:BirCodeGenLoop",
    "neuronxcc.starfish.penguin.targets.codegen.BirCodeGenLoop:BirCodeGenLoop",
)
EXIT_NOT_FOUND = 127  # as a shell says a command is not found


def _loop(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    for value in values:
        module, _, class_name = value.partition(":")
        if not module or not class_name or "," in value:
            raise click.BadParameter(f"{value!r} is not MODULE:CLASS", ctx, param)
    return values


@click.command("exec", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@tier_options
@click.option(
    "--loop",
    "loops",
    multiple=True,
    callback=_loop,
    metavar="MODULE:CLASS",
    help="Attach to this loop class too (repeatable).",
)
@click.option("--check", is_flag=True, help="Say which loop classes and seams were found; run nothing.")
@click.option("--summary", is_flag=True, help="At exit, print the passes, traces and remote hits on stderr.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def exec_command(
    tier: tuple[str, ...],
    tier_mode: str | None,
    loops: tuple[str, ...],
    check: bool,
    summary: bool,
    command: tuple[str, ...],
) -> None:
    """Run COMMAND with the tier attached to every codegen loop its Python processes create, their Python child
    processes included: ccache's model, for a compiler you already run.

    The classes attached to are nkicache's own loop (bridge.codegen.BirCodeGenLoop) and neuronx-cc's
    (neuronxcc.starfish.penguin.targets.codegen.BirCodeGenLoop.BirCodeGenLoop), plus each --loop. The tier
    wraps the specification's four seams of the class when its module is imported: the bridge (an in-pass miss
    asks the tier before tracing; single flight through the tier's lease), the key builder, the store (a trace
    is published) and afterStmtTransform (the pass's record). The class's own counters, maps and statistics are
    what they are without nkicache. A foreign compiler's entries are kept under its own toolchain id (its
    distribution's name and version and a hash of the module file defining the class), so a new build never
    reads an old one's. neuronx-cc's seams are tested against a stand-in built from the specification's roster
    (tests/standin), not against neuronx-cc itself.

    Everything the command shows is its own: COMMAND replaces this process (exit code, stdout, stderr and
    signals are COMMAND's). The tier's settings travel in the environment (NKICACHE_TIER, ...), never in its
    argv. A class that lacks a seam, has other signatures or refuses attribute assignment runs as it would
    without nkicache, with one warning line on stderr. An existing sitecustomize still runs.

    --check imports each class here and says which seams it has and whether the tier would attach; it runs
    nothing. Turn the attachment off by running COMMAND without `nkicache exec` (or with --tier off).
    """
    targets = (*DEFAULT_LOOPS, *loops)
    if check:
        _check(targets, load_cli_settings(tier=tier, tier_mode=tier_mode))
        return
    if not command:
        raise click.UsageError("name the command to run after --: nkicache exec [OPTIONS] -- COMMAND [ARGS]...")
    environment = {**os.environ, **_tier_environment(tier, tier_mode)}
    environment["NKICACHE_EXEC_LOOPS"] = ",".join(targets)
    environment["NKICACHE_EXEC_SUMMARY"] = "1" if summary else "0"
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BOOTSTRAP), environment.get("PYTHONPATH")]))
    try:
        os.execvpe(command[0], list(command), environment)
    except OSError as exc:
        click.echo(f"nkicache: error: cannot run {command[0]!r}: {exc.strerror or exc}", err=True)
        sys.exit(EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_PROJECT_ERROR)


def _tier_environment(tier: tuple[str, ...], tier_mode: str | None) -> dict[str, str]:
    """The tier flags as the command's environment (its processes read their settings from it, as any nkicache
    process does); a bad URL is a usage error here. The rest of the settings are checked where they are read:
    this process only starts COMMAND, and loads no more than that needs."""
    from cachestore.tier_urls import redact_url, tier_url_problem

    environment = {}
    if tier:
        url = " ".join(level.strip() for level in tier)
        if (problem := tier_url_problem(url)) is not None:
            raise click.BadParameter(f"{redact_url(url)!r}: {problem}", param_hint="'--tier'")
        environment["NKICACHE_TIER"] = url
    if tier_mode:
        environment["NKICACHE_TIER_MODE"] = tier_mode
    return environment


def _check(targets: tuple[str, ...], settings: object) -> None:
    from bridge.tier_seam import SEAMS, missing_seams
    from workers.attach import loop_toolchain

    click.echo(f"tier: {settings.tier} ({settings.tier_mode})")
    for target in targets:
        module_name, _, class_name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception as exc:  # not installed here, or broken: said, and the others still checked
            click.echo(f"{target}: not importable here ({type(exc).__name__}: {exc})")
            continue
        problems = missing_seams(cls)
        found = [name for name in SEAMS if callable(getattr(cls, name, None))]
        verdict = "attaches" if not problems else f"would run without the tier: {'; '.join(problems)}"
        click.echo(f"{target}: {verdict}; toolchain {loop_toolchain(cls)}; seams found: {', '.join(found) or 'none'}")
