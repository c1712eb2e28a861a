"""`nkicache config`: the effective settings, each with where its value came from (as ccache -p)."""

from __future__ import annotations

from typing import Any

import click

from workers.cli_common import echo_json, tier_options

MASK = "********"


def _shown(name: str, value: Any, secret: bool) -> Any:
    """A setting's value as `config` prints it: secrets masked, passwords taken out of URLs."""
    from cachestore.tier_urls import redact_url

    if secret:
        return None if value is None else MASK
    if name == "tier":
        return redact_url(value)
    return value


def effective_settings(flags: dict[str, Any]) -> dict[str, Any]:
    """{config_file, config_files, settings: {name: {value, source}}}; source is `default`, the config
    file's path, `$NKICACHE_NAME` (or `$NKICACHE_NAME_FILE`) or `command line`."""
    from cachestore.settings import (
        SECRET_SETTINGS,
        Settings,
        config_candidates,
        config_file,
        load_settings_with_sources,
    )

    settings, sources = load_settings_with_sources(flags)
    config = config_file()
    shown = {}
    for name in Settings.__struct_fields__:
        value = getattr(settings, name)
        shown[name] = {
            "value": _shown(name, value, name in SECRET_SETTINGS),
            "source": sources.get(name, "default"),
        }
    return {
        "config_file": str(config) if config is not None else None,
        "config_files": [str(path) for path in config_candidates()],
        "settings": shown,
    }


@click.command("config")
@tier_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def config_command(tier: tuple[str, ...], tier_mode: str | None, as_json: bool) -> None:
    """Show the effective settings, each with where its value came from: default, the config file (its
    path), an NKICACHE_* environment variable, or the command line. Secrets are masked.

    Sources, later winning: defaults < the config file (the first of $NKICACHE_CONFIG, ./nkicache.toml,
    ~/.config/nkicache/config.toml; TOML, the setting names as keys) < NKICACHE_<SETTING> environment
    variables < flags. Secrets (NKICACHE_HMAC_KEY, NKICACHE_REDIS_PASSWORD, or their _FILE forms naming a
    file) come only from the environment.

    --json keys: config_file (null when none), config_files (where one is looked for, in order), settings
    ({name: {value, source}}, secrets' values "********" when set, null when not).
    """
    shown = effective_settings({"tier": tier, "tier_mode": tier_mode})
    if as_json:
        echo_json(shown, indent=2)
        return
    looked = ", ".join(shown["config_files"])
    click.echo(f"config file: {shown['config_file'] or f'none (looked for {looked})'}")
    width = max(len(name) for name in shown["settings"])
    for name, item in shown["settings"].items():
        value = item["value"]
        text = "(not set)" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        click.echo(f"{name:<{width}}  {text:<48}  {item['source']}")
