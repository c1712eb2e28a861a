"""The `nkicache` command line.

Each command lives in a module of its own, imported only when that command runs (or when `--help` lists
them all), so that a command loads only what it needs: `nkicache --version` loads neither the compiler nor
the storage side, and `nkicache --help` works even when the compiler side is broken.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import click

from workers.cli_common import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_PROJECT_ERROR, LOG_LEVELS, configure_logging

# Every command: its name -> "module:attribute" of its click command.
COMMANDS = {
    "batch": "workers.fleet_cli:batch_group",
    "compile": "workers.compile_cli:compile_command",
    "config": "workers.config_cli:config_command",
    "demo": "workers.demo_cli:demo",
    "exec": "workers.exec_cli:exec_command",
    "inspect": "workers.report_cli:inspect_group",
    "job": "workers.fleet_cli:job_group",
    "keygen": "workers.trust_cli:keygen_command",
    "purge": "workers.fleet_cli:purge_command",
    "queue": "workers.fleet_cli:queue_command",
    "quickstart": "workers.quickstart_cli:quickstart_command",
    "report": "workers.report_cli:report_command",
    "requeue": "workers.fleet_cli:requeue_command",
    "run": "workers.compile_cli:run_command",
    "sentinel": "workers.trust_cli:sentinel_command",
    "serve-metrics": "workers.report_cli:serve_metrics_command",
    "submit": "workers.fleet_cli:submit_command",
    "trust": "workers.trust_cli:trust_group",
    "warm": "workers.warm_cli:warm_command",
    "worker": "workers.fleet_cli:worker_command",
    "workload": "workers.quickstart_cli:workload_command",
}

# Commands that trace kernels in several processes at once: each process runs numpy's BLAS on one thread
# (workers.blas).
TRACING_COMMANDS = {"compile", "quickstart", "warm", "worker"}

# Commands of the development tooling: packages of the source checkout beside bridge/, cachestore/ and workers/,
# which no wheel ships (pyproject.toml). An editable install (`pip install -e '.[dev]'`) finds them there.
DEV_COMMANDS = {"bench": "bench.cli:bench_command"}
# This package's parent folder: the source checkout in an editable install, site-packages in a wheel's.
CHECKOUT = Path(__file__).resolve().parent.parent


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
        except KeyboardInterrupt:
            # Commands that can stop cleanly report what they finished and exit 130 themselves; this is
            # Ctrl-C anywhere else (click would print "Aborted!" and exit 1, like a failed check).
            click.echo("nkicache: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            # The reader of stdout went away (`nkicache queue | head -1`): nothing is wrong, and nothing more can
            # be printed. Python's own advice: point stdout at devnull so the exit's flush cannot fail again.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(EXIT_CHECK_FAILED)
        except Exception as exc:
            if not _is_project_error(exc):
                raise
            click.echo(f"nkicache: error: {exc}", err=True)
            ctx.exit(EXIT_PROJECT_ERROR)


class _Main(_Group):
    """The `nkicache` group: its commands are imported by name from COMMANDS when asked for (click's lazy
    loading pattern), and its epilog (which reads every setting) is written only when help is shown."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS, *DEV_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attribute = COMMANDS[cmd_name].split(":")
            self.add_command(getattr(importlib.import_module(module), attribute), cmd_name)
        elif cmd_name not in self.commands and cmd_name in DEV_COMMANDS:
            self.add_command(dev_command(cmd_name, DEV_COMMANDS[cmd_name]), cmd_name)
        return self.commands.get(cmd_name)

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.epilog = environment_help()
        super().format_epilog(ctx, formatter)


def dev_command(name: str, target: str) -> click.Command:
    """The click command `target` ("package.module:attribute") names, its package loaded from the source checkout
    this package is part of (CHECKOUT/package/, beside a pyproject.toml); where there is none (a wheel's
    install), a stand-in that says in one line where the command comes from."""
    module, attribute = target.split(":")
    package = module.split(".")[0]
    folder = CHECKOUT / package
    if not ((CHECKOUT / "pyproject.toml").is_file() and (folder / "__init__.py").is_file()):
        return _not_installed(name)
    if package not in sys.modules:
        # Loaded from that folder by its path, not found on sys.path (an editable install maps only the packages
        # pyproject.toml lists), and never another installed package of the same name.
        spec = importlib.util.spec_from_file_location(
            package, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        loaded = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[package] = loaded
        spec.loader.exec_module(loaded)  # type: ignore[union-attr]
    return getattr(importlib.import_module(module), attribute)


def _not_installed(name: str) -> click.Command:
    """A stand-in for a development command this install does not have: run, with any arguments (--help too), it
    is one line on stderr and exit 2."""
    why = f"`nkicache {name}` comes with a source checkout: install one with `pip install -e '.[dev]'`"

    def refuse() -> None:
        from bridge.errors import NkiCacheError

        raise NkiCacheError(why)

    context = {"ignore_unknown_options": True, "allow_extra_args": True}
    return click.Command(name, callback=refuse, help=why, add_help_option=False, context_settings=context)


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from bridge.identity import toolchain_id
    from workers import __version__

    click.echo(f"nkicache {__version__}, toolchain {toolchain_id()}")
    ctx.exit()


def environment_help() -> str:
    """The settings' part of `nkicache --help`, with every NKICACHE_* variable named (from the settings
    themselves, so that a new setting is never missing from it)."""
    import textwrap

    from cachestore.settings import SECRET_SETTINGS, Settings

    settings = [name for name in Settings.__struct_fields__ if name not in SECRET_SETTINGS]
    names = ", ".join(f"NKICACHE_{name.upper()}" for name in settings)
    secrets = sorted(f"NKICACHE_{name.upper()}" for name in SECRET_SETTINGS)
    return "\n".join(
        [
            "\b",
            "Settings (`nkicache config` shows each one's value and source), later winning:",
            "  defaults < a TOML config file < NKICACHE_* environment variables < flags.",
            "  Config file: $NKICACHE_CONFIG, else ./nkicache.toml, else ~/.config/nkicache/config.toml.",
            "\b",
            "Environment variables (NKICACHE_ + the setting's name in capitals):",
            *textwrap.wrap(names + ".", 100, initial_indent="  ", subsequent_indent="  "),
            f"  Secrets, only from the environment: {', '.join(secrets)}",
            f"  (or {', '.join(name + '_FILE' for name in secrets)} naming a file).",
            "  NKICACHE_TARGET: the compile target (Trn1, Trn2) of a graph that names none.",
        ]
    )


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and the toolchain id (the tier keeps binaries apart by it).",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    envvar="NKICACHE_LOG_LEVEL",
    default=None,
    help="Log at this level on stderr ($NKICACHE_LOG_LEVEL). Default: INFO for `worker`, else only warnings.",
)
@click.pass_context
def main(ctx: click.Context, log_level: str | None) -> None:
    """nkicache: a distributed build cache for a kernel compiler's NKI-frontend bridge."""
    ctx.obj = {"log_level": log_level}
    if ctx.invoked_subcommand in TRACING_COMMANDS:
        from workers.blas import one_blas_thread

        one_blas_thread()
    if log_level is not None:
        configure_logging(log_level)


if __name__ == "__main__":
    main()
