"""What a client signs with, what it trusts, and the scope it works in, as its settings name them.

cachestore.trust (keys, policy files) is loaded only when the settings name a writer key or a trust policy.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import msgspec

from cachestore.settings import Settings, SettingsError

if TYPE_CHECKING:
    from cachestore.trust import TrustPolicy, WriterKey

logger = logging.getLogger(__name__)


class Credentials(msgspec.Struct, frozen=True):
    """What a client signs with, what it trusts, and the scope it reads and writes in."""

    writer: WriterKey | None
    trust: TrustPolicy | None
    scope: str  # cachestore.keys.TRUSTED_SCOPE ("") or an untrusted scope's name


def settings_credentials(settings: Settings, *, writes: bool = True) -> Credentials:
    """`load_credentials` of what the settings name. A read-only client does not write; nor does a command that
    only reads entries (`writes=False`)."""
    writes = writes and not settings.read_only
    return load_credentials(settings.writer_key_file, settings.trust_policy, settings.scope, writes)


def load_credentials(writer_key_file: str, trust_policy: str, scope: str, writes: bool) -> Credentials:
    """The writer key and trust policy in these files ("": none), and the scope (`resolve_scope`); a file that
    cannot be used is a SettingsError naming it."""
    writer = trust = None
    if writer_key_file or trust_policy:
        from cachestore.trust import TrustError, load_trust_policy, load_writer_key

        try:
            writer = load_writer_key(writer_key_file) if writer_key_file else None
            trust = load_trust_policy(trust_policy) if trust_policy else None
        except TrustError as exc:
            raise SettingsError(str(exc)) from None
    scope = resolve_scope(scope, writer, trust, writes)
    if scope == UNSIGNED_SCOPE and writer is None and trust is not None:
        _warn_unsigned_with_policy(trust_policy)
    if scope and writer is not None and trust is not None and not trust.trusts(writer.key_id):
        trust = trust.adding(writer, "this client")  # in its own (untrusted) scope it reads what it wrote
    return Credentials(writer, trust, scope)


def resolve_scope(setting: str, writer: WriterKey | None, trust: TrustPolicy | None, writes: bool) -> str:
    """The scope a client works in. `auto`: the trusted one ("") for a client that does not write, for one with
    neither a writer key nor a trust policy (a set-up without per-writer keys), and for a writer its own trust
    policy lists; any other writer gets a scope of its own (`w-` and its key id, or `unsigned`), so that its
    entries and leases never stand where a trusted reader looks."""
    if setting == "trusted":
        return ""
    if setting != "auto":
        return setting
    if not writes or (writer is None and trust is None):
        return ""
    if writer is not None and trust is not None and trust.trusts(writer.key_id):
        return ""
    return f"w-{writer.key_id_hex}" if writer is not None else UNSIGNED_SCOPE


UNSIGNED_SCOPE = "unsigned"


@functools.cache  # once per process and policy file: every client of a process resolves the same settings
def _warn_unsigned_with_policy(trust_policy: str) -> None:
    """A client that writes with a trust policy and no writer key works in the `unsigned` scope: what it stores
    there is unsigned, so its own policy refuses it on the next read, and the trusted entries are in another
    scope. Nothing it could read verifies: said once, with the two settings that make it useful."""
    logger.warning(
        "trust_policy %r is set without a writer_key_file: this client writes to scope %r, where its policy "
        "accepts nothing, and does not read the trusted entries; use --tier-mode read-only to read them, or give "
        "it a writer key",
        trust_policy,
        UNSIGNED_SCOPE,
    )
