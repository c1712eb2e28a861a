"""`nkicache config` (the effective settings, each with its source, secrets masked) and where the settings
are documented: `--help` names every NKICACHE_* variable, the README every config file location."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachestore.settings import Settings
from workers.cli import main

ROOT = Path(__file__).resolve().parents[1]
PASSWORD = "hunter2-not-for-printing"
HMAC_KEY = "k3y-not-for-printing"


@pytest.fixture(autouse=True)
def no_ambient_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No config file or NKICACHE_* variable of the machine running the tests leaks in."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in [n for n in os.environ if n.startswith("NKICACHE_")]:
        monkeypatch.delenv(name)


def config(*args: str, env: dict[str, str] | None = None):
    result = CliRunner().invoke(main, ["config", *args], env=env or {})
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def test_each_setting_shows_its_value_and_source(tmp_path: Path) -> None:
    config_file = tmp_path / "team.toml"
    config_file.write_text('namespace = "team"\nop_timeout = 2.5\n')
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    env = {"NKICACHE_CONFIG": str(config_file), "NKICACHE_OP_TIMEOUT": "3", "NKICACHE_HMAC_KEY": HMAC_KEY,
           "NKICACHE_REDIS_PASSWORD_FILE": str(password_file)}  # fmt: skip
    shown = json.loads(config("--json", "--tier-mode", "mirror", env=env).stdout)

    assert shown["config_file"] == str(config_file) and shown["config_files"] == [str(config_file)]
    settings = shown["settings"]
    assert list(settings) == list(Settings.__struct_fields__)
    assert settings["namespace"] == {"value": "team", "source": str(config_file)}
    assert settings["op_timeout"] == {"value": 3.0, "source": "$NKICACHE_OP_TIMEOUT"}  # env beats the file
    assert settings["tier_mode"] == {"value": "mirror", "source": "command line"}
    assert settings["lease_ttl"] == {"value": 6.0, "source": "default"}
    assert settings["hmac_key"] == {"value": "********", "source": "$NKICACHE_HMAC_KEY"}
    assert settings["redis_password"] == {"value": "********", "source": "$NKICACHE_REDIS_PASSWORD_FILE"}

    text = config("--tier", "redis://user:pw-in-url@h:6379/0", env=env).stdout
    for secret in (PASSWORD, HMAC_KEY, "pw-in-url"):
        assert secret not in text
    assert f"config file: {config_file}" in text
    lines = {line.split()[0]: line.split()[1:] for line in text.splitlines()[1:]}
    assert lines["namespace"] == ["team", str(config_file)]
    assert lines["tier"] == ["redis://user@h:6379/0", "command", "line"]
    assert lines["redis_password"] == ["********", "$NKICACHE_REDIS_PASSWORD_FILE"]


def test_read_only_is_a_tier_mode_from_every_source(tmp_path: Path) -> None:
    config_file = tmp_path / "reader.toml"
    config_file.write_text('tier_mode = "read-only"\n')
    for args, env, source in (
        (["--tier-mode", "read-only"], {}, "command line"),
        ([], {"NKICACHE_TIER_MODE": "read-only"}, "$NKICACHE_TIER_MODE"),
        ([], {"NKICACHE_CONFIG": str(config_file)}, str(config_file)),
    ):
        shown = json.loads(config("--json", *args, env=env).stdout)["settings"]
        assert shown["tier_mode"] == {"value": "read-only", "source": source}
    lines = {line.split()[0]: line.split()[1:] for line in config("--tier-mode", "read-only").stdout.splitlines()[1:]}
    assert lines["tier_mode"] == ["read-only", "command", "line"]


def test_the_config_file_is_found_where_the_readme_says(tmp_path: Path) -> None:
    assert json.loads(config("--json").stdout)["config_file"] is None
    assert "config file: none (looked for nkicache.toml, " in config().stdout
    home = tmp_path / "home" / ".config" / "nkicache" / "config.toml"
    home.parent.mkdir(parents=True)
    home.write_text('namespace = "from-home"\n')
    shown = json.loads(config("--json").stdout)
    assert shown["config_file"] == str(home) and shown["settings"]["namespace"]["value"] == "from-home"
    (tmp_path / "nkicache.toml").write_text('namespace = "from-cwd"\n')  # ./nkicache.toml comes first
    shown = json.loads(config("--json").stdout)
    assert shown["config_file"] == "nkicache.toml" and shown["settings"]["namespace"]["source"] == "nkicache.toml"


def test_help_names_every_environment_variable_and_the_readme_every_config_location() -> None:
    help_text = CliRunner().invoke(main, ["--help"]).stdout
    readme = (ROOT / "README.md").read_text()
    for name in Settings.__struct_fields__:
        assert f"NKICACHE_{name.upper()}" in help_text, name
    for secret in ("NKICACHE_HMAC_KEY_FILE", "NKICACHE_REDIS_PASSWORD_FILE", "NKICACHE_CONFIG"):
        assert secret in help_text and secret in readme
    for location in ("$NKICACHE_CONFIG", "./nkicache.toml", "~/.config/nkicache/config.toml", "nkicache config"):
        assert location in readme and location in help_text
