"""The one place a tier URL becomes a store: `open_backend` opens the store a URL names (its backend module is
imported only then), `open_tier` the client the compile path uses (a stack of them for a stack of levels)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial

from bridge.identity import toolchain_id
from cachestore.api import Backend, Store
from cachestore.client import TierClient
from cachestore.credentials import Credentials, settings_credentials
from cachestore.keys import partition
from cachestore.read_only import ReadOnlyTier
from cachestore.settings import Settings, SettingsError
from cachestore.stacked import StackedTier, level_settings
from cachestore.tier_urls import (
    TIER_SCHEMES_TEXT,
    Scheme,
    redact_url,
    scheme_of,
    shared_level,
    tier_levels,
    tier_path,
)


def open_backend(
    settings: Settings, *, reading: bool = False, partition: str | None = None, writable: bool = True
) -> Store:
    """The backend the settings' tier URL names, in the partition `partition` (default: this compiler's).
    `reading` opens it for reports and inspection: longer timeouts, and an embedded tier that does not exist
    yet is an error instead of a new file. `writable=False` (a read-only client's compile path): an embedded
    tier is opened read-only, neither created nor upgraded, and one that does not exist reads as empty; a
    Redis tier is only sent reads by such a client anyway."""
    url = shared_level(settings.tier)  # a stack of levels: the shared one holds the fleet's entries and metrics
    scheme = known_scheme(url)
    store = importlib.import_module(scheme.module)  # only the named store's library is imported
    location = tier_path(url) if scheme.names_path else url
    return store.open_store(settings, location, reading=reading, partition=partition, writable=writable)


def import_store_library(settings: Settings) -> None:
    """Import the library of every store `settings.tier` names, and connect to none: `open_backend` would at its
    first call. `compile --workers N` imports it while its helpers trace (redis-py takes 60-70 ms)."""
    for level in tier_levels(settings.tier):
        importlib.import_module(known_scheme(level).module)


def known_scheme(url: str) -> Scheme:
    scheme = scheme_of(url)
    if scheme is None:
        raise SettingsError(f"unknown tier {redact_url(url)!r}; use {TIER_SCHEMES_TEXT}")
    return scheme


def open_tier(settings: Settings, toolchain: str | None = None) -> TierClient | ReadOnlyTier | StackedTier | None:
    """The tier client for these settings, or None for `off`; wrapped in a ReadOnlyTier for `read-only`; a
    StackedTier for a stack of levels (nearest first). Nothing connects until first used, so an unreachable
    tier costs a compile only counted errors. `toolchain`: the compiler whose entries it holds (default: this
    package's)."""
    if settings.tier == "off" or settings.tier_mode == "off":
        return None
    levels = tier_levels(settings.tier)
    if len(levels) > 1:
        return StackedTier([_one_level(level_settings(settings, levels, i), toolchain) for i in range(len(levels))])
    return _one_level(settings, toolchain)


def _one_level(settings: Settings, toolchain: str | None) -> TierClient | ReadOnlyTier:
    """The client of the one store `settings.tier` names."""
    known_scheme(settings.tier)  # an unknown one is an error now, not at the first call
    credentials = settings_credentials(settings)
    backend = level_backend(settings, credentials, toolchain)
    return tier_client(backend, settings, redact_url(settings.tier), credentials, toolchain)


def level_backend(settings: Settings, credentials: Credentials, toolchain: str | None = None) -> Callable[[], Store]:
    """How a client of these credentials opens the one store `settings.tier` names: in its scope's partition of
    `toolchain`'s entries (default: this package's), read-only for a read-only client."""
    scope_partition = partition(toolchain or toolchain_id(), credentials.scope)
    return partial(open_backend, settings, writable=not settings.read_only, partition=scope_partition)


def tier_client(
    backend_factory: Callable[[], Backend],
    settings: Settings,
    description: str = "tier",
    credentials: Credentials | None = None,
    toolchain: str | None = None,
) -> TierClient | ReadOnlyTier:
    """The client of the store `backend_factory` opens, as these settings' tier_mode wants it: wrapped in a
    ReadOnlyTier for `read-only`."""
    client = TierClient(backend_factory, settings, description, credentials, toolchain)
    return ReadOnlyTier(client) if settings.read_only else client
