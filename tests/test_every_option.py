"""Every option of every command, given a value it cannot take, fails in one error line with exit code 2
(click's usage error, or the project's `nkicache: error:` line), never a traceback: the option walker of
issue 35. In-process (click's CliRunner), every command found by walking the CLI itself, so that a new
option is walked without a test naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from workers.cli import main

HUGE = "9" * 5000  # past the digits Python converts to an int at all
BAD_NUMBERS = ["abc", "", HUGE, "1e400", "nan", "-inf", "-1", "1_0x"]
BAD_CHOICE = ["no-such-choice", "", "\n"]
BAD_URLS = ["redis://[::1", "redis://host:99999", "ftp://x", "local:", "dir:", "redis://h/0?socket_timeout=1"]
URL_OPTIONS = {"--tier", "--from"}


def commands(group: click.Group, context: click.Context, path: tuple[str, ...] = ()) -> Iterator[tuple]:
    for name in group.list_commands(context):
        command = group.get_command(context, name)
        if isinstance(command, click.Group):
            yield from commands(command, click.Context(command, parent=context), (*path, name))
        elif command is not None:
            yield (*path, name), command


def bad_values(option: click.Option) -> list[str]:
    kind = option.type
    if isinstance(kind, click.types.IntParamType | click.types.FloatParamType):
        bounded = isinstance(kind, click.IntRange | click.FloatRange)
        return [value for value in BAD_NUMBERS if bounded or value != "-1"]  # a plain number may be negative
    if isinstance(kind, click.Choice):
        return BAD_CHOICE
    if set(option.opts) & URL_OPTIONS:
        return BAD_URLS
    return []


def cases() -> list:
    root = click.Context(main)
    found = []
    for path, command in commands(main, root):
        arguments = []
        for param in command.params:
            if isinstance(param, click.Argument) and param.required:
                arguments.append("/nonexistent/nkicache-walker")
        for param in command.params:
            if isinstance(param, click.Option) and not param.is_flag and not param.hidden:
                for value in bad_values(param):
                    found.append(pytest.param(path, arguments, param.opts[-1], value,
                                              id=f"{' '.join(path)} {param.opts[-1]}={value[:12]!r}"))  # fmt: skip
    return found


CASES = cases()


def test_the_walker_walks_every_kind_of_option() -> None:
    walked = {(" ".join(path), option) for path, _, option, _ in (case.values for case in CASES)}
    assert len(walked) > 60  # every command's numbers, choices and tier URLs
    assert {("compile", "--workers"), ("serve-metrics", "--port"), ("inspect ls", "--tier")} <= walked


@pytest.mark.parametrize(("path", "arguments", "option", "value"), CASES)
def test_a_bad_option_value_is_one_error_line(
    tmp_path: Path, path: tuple[str, ...], arguments: list[str], option: str, value: str
) -> None:
    env = {
        "NKICACHE_TIER": f"local:{tmp_path / 'missing' / 'tier.sqlite'}",
        "NKICACHE_CONFIG": str(tmp_path / "none.toml"),
    }
    result = CliRunner().invoke(main, [*path, *arguments, option, value], env=env, catch_exceptions=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith(("Error: ", "nkicache: error: "))]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
