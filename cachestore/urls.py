"""Tier URLs: `off`, `local:PATH`, `redis://`, `rediss://`, `unix://`, `redis+cluster://h:p[,h:p...]`."""

from __future__ import annotations

from functools import partial

from cachestore.client import TierClient
from cachestore.keys import KeySpace
from cachestore.settings import Settings, SettingsError
from cachestore.tier import Backend

REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


def make_backend(settings: Settings) -> Backend:
    url = settings.tier
    if url.startswith("local:"):
        from cachestore.local_tier import LocalTier

        return LocalTier(url[len("local:") :], op_timeout=settings.op_timeout)
    if url.startswith(REDIS_SCHEMES):
        from cachestore.redis_tier import RedisTier, connect

        client = connect(
            url, connect_timeout=settings.connect_timeout, op_timeout=settings.op_timeout,
            password=settings.redis_password,
        )  # fmt: skip
        return RedisTier(client, KeySpace(settings.namespace), describe(url))
    raise SettingsError(f"unknown tier {url!r}; use off, local:PATH, redis://, rediss://, unix:// or redis+cluster://")


def describe(url: str) -> str:
    """The URL without its password, for logs and errors."""
    scheme, sep, rest = url.partition("://")
    credentials, at, hosts = rest.rpartition("@")
    if not at:
        return url
    user = credentials.partition(":")[0]
    return f"{scheme}{sep}{user + '@' if user else ''}{hosts}"


def open_tier(settings: Settings) -> TierClient | None:
    """The tier client for these settings, or None for `off`. Nothing connects until first used, so an
    unreachable tier costs a compile only counted errors."""
    if settings.tier == "off" or settings.tier_mode == "off":
        return None
    if not (settings.tier.startswith("local:") or settings.tier.startswith(REDIS_SCHEMES)):
        make_backend(settings)  # raises the clear error for an unknown scheme
    return TierClient(partial(make_backend, settings), settings, describe(settings.tier))
