"""The fleet's Redis connection: the queue, the results and the trace tasks live on the tier's shared level,
which must be Redis."""

from __future__ import annotations

from bridge.errors import NkiCacheError
from cachestore.backends.redis import RedisClient, connect
from cachestore.settings import Settings
from cachestore.tier_urls import is_redis, redact_url, shared_level

BLOCK_MS = 1000  # how long an idle worker's read of the job streams blocks


class FleetError(NkiCacheError):
    """A fleet operation cannot proceed (a graph too large to submit, a tier that is not Redis)."""


def fleet_client(settings: Settings) -> RedisClient:
    """A Redis client for the fleet's keys, its timeout longer than one blocking read of the job streams."""
    url = shared_level(settings.tier)  # a stack's shared level holds the queue
    if not is_redis(url):
        raise FleetError(f"the fleet runs on Redis; --tier must be a redis:// URL, got {redact_url(settings.tier)!r}")
    op_timeout = max(settings.op_timeout, BLOCK_MS / 1000 + 1)
    return connect(
        url, connect_timeout=settings.connect_timeout, op_timeout=op_timeout, password=settings.redis_password
    )
