"""`nkicache keygen` (a writer's Ed25519 key) and `nkicache trust` (the trust policy), issue 22."""

from __future__ import annotations

from pathlib import Path

import click

from workers.cli_common import TIER_MODES, echo_json, plural


@click.command("keygen")
@click.argument("path", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", default=None, help="The writer's name in the trust policy (default: the file's name).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: key_id, public_key, name, files.")
def keygen_command(path: Path, name: str | None, as_json: bool) -> None:
    """Make a writer key: the Ed25519 private key at PATH (mode 0600, never overwritten) and, at PATH.pub, the
    [[writer]] table that trusts it, to append to readers' trust policy files. Point a writer's
    writer_key_file setting (NKICACHE_WRITER_KEY_FILE) at PATH: it signs every entry it stores."""
    from cachestore.trust import write_writer_key

    name = name or path.stem
    key = write_writer_key(path, name)
    shown = {
        "key_id": key.key_id_hex,
        "public_key": key.public_base64(),
        "name": name,
        "private_key_file": str(path),
        "policy_file": f"{path}.pub",
    }
    if as_json:
        echo_json(shown)
        return
    click.echo(f"writer key {key.key_id_hex} ({name}) written to {path}; trust it with {path}.pub:")
    click.echo(key.policy_entry(name), nl=False)


@click.group("trust")
def trust_group() -> None:
    """Show or change a trust policy file (the writers whose entries readers accept)."""


def _policy_file(policy: Path | None) -> Path:
    """--policy, else the trust_policy setting."""
    from workers.cli_common import load_cli_settings

    if policy is None:
        configured = load_cli_settings().trust_policy
        if not configured:
            raise click.UsageError("no --policy given and no trust_policy setting (NKICACHE_TRUST_POLICY)")
        policy = Path(configured)
    return policy


POLICY_OPTION = click.option(
    "--policy",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE",
    help="The trust policy file (default: the trust_policy setting).",
)


@trust_group.command("show")
@POLICY_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of {key_id, name}.")
def trust_show(policy: Path | None, as_json: bool) -> None:
    """The writers the trust policy trusts."""
    from cachestore.trust import load_trust_policy

    writers = [
        {"key_id": w.key_id.hex(), "name": w.name} for w in load_trust_policy(_policy_file(policy)).writers.values()
    ]
    if as_json:
        echo_json(writers)
        return
    for writer in writers:
        click.echo(f"{writer['key_id']}  {writer['name']}")


@trust_group.command("distrust")
@click.argument("key_id")
@POLICY_OPTION
def trust_distrust(key_id: str, policy: Path | None) -> None:
    """Remove writer KEY_ID from the trust policy (rewritten in place): clients that load it from then on (a
    new compile, a fleet worker's next job) reject that writer's entries. Its entries stay stored until
    `nkicache inspect gc --writer KEY_ID`."""
    from cachestore.trust import without_writer

    policy = _policy_file(policy)
    removed = without_writer(policy, key_id)
    if not removed:
        raise click.UsageError(f"{policy}: no writer {key_id} to remove")
    click.echo(f"{policy}: writer {key_id} removed; readers that load it reject its entries")


@click.command("sentinel")
@click.option("--tier", default=None, metavar="URL", help="The tier to check (default: the configured one).")
@click.option(
    "--rate",
    type=float,
    default=None,
    metavar="R",
    help="Share of the entries in use to trace again, 0 to 1 (default: setting sentinel_rate).",
)
@click.option(
    "--since",
    default=None,
    metavar="D",
    help="Only entries the fleet used within D (1h, 2d); default: every trusted entry.",
)
@click.option(
    "--tier-mode",
    type=click.Choice(TIER_MODES),
    default=None,
    help="read-only: send no write (report what it would quarantine, count nothing); default: the tier_mode setting.",
)
@click.option("--seed", type=int, default=None, help="Seed of the sampling (default: random).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def sentinel_command(
    tier: str | None, rate: float | None, since: str | None, tier_mode: str | None, seed: int | None, as_json: bool
) -> None:
    """Trace again a sample of this compiler's trusted entries in use and compare each binary with the stored
    one; quarantine every mismatch (moved to the quarantine scope: never served again, kept for `nkicache
    inspect`; counted per writer and toolchain in `report` and Prometheus). Runs one sweep; schedule it
    (cron, a systemd timer) on spare capacity. Exits 1 when it quarantined anything. Under tier_mode
    read-only it writes nothing (it can run as the reader ACL user) and lists what it would quarantine.

    --json keys: toolchain, rate, entries, sampled, matched, quarantined ([{key, writer, toolchain, reason}]),
    failed ([{key, reason}]: could not be traced again), rejected (refused by the trust policy), seconds,
    read_only (true: `quarantined` is what it would have quarantined).
    """
    import random

    from bridge.identity import toolchain_id
    from cachestore.credentials import settings_credentials
    from cachestore.entry import SignaturePolicy
    from cachestore.keys import partition
    from cachestore.report import parse_duration
    from cachestore.stores import open_backend
    from workers.cli_common import EXIT_CHECK_FAILED, load_cli_settings
    from workers.sentinel import run_sentinel

    try:
        window = None if since is None else parse_duration(since)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--since") from None
    settings = load_cli_settings(tier=tier, tier_mode=tier_mode)
    if settings.tier_mode == "off":
        raise click.UsageError("`nkicache sentinel` checks the tier's entries; tier_mode is off")
    rate = settings.sentinel_rate if rate is None else rate
    if not 0 <= rate <= 1:
        raise click.BadParameter(f"{rate} is not from 0 to 1", param_hint="--rate")
    trust = settings_credentials(settings, writes=False).trust
    policy = SignaturePolicy(settings.hmac_key, settings.require_signed, settings.reject_unverifiable, trust)
    reader = open_backend(settings, reading=True, partition=partition(toolchain_id()))
    try:
        report = run_sentinel(
            reader,
            policy,
            rate=rate,
            since=window,
            host=settings.host,
            quarantine_ttl=settings.entry_ttl,
            rng=random.Random(seed),
            read_only=settings.read_only,
        )
    finally:
        reader.close()
    if as_json:
        echo_json(report.as_json())
    else:
        click.echo(
            f"sentinel over toolchain {report.toolchain}: {plural(report.entries, 'entry')}, "
            f"{report.sampled} traced "
            f"again at rate {rate:g}: {report.matched} matched, {len(report.quarantined)} "
            f"{'to quarantine (read-only: none moved)' if report.read_only else 'quarantined'}, "
            f"{len(report.failed)} could not be traced, {report.rejected} rejected by the policy "
            f"({report.seconds:.1f} s)"
        )
        verb = "would quarantine (read-only)" if report.read_only else "quarantined"
        for item in report.quarantined:
            click.echo(f"{verb} {item['key'][:16]} (writer {item['writer'] or 'none'}): {item['reason']}")
    if report.quarantined:
        raise SystemExit(EXIT_CHECK_FAILED)
