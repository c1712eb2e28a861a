"""What one compilation pass tells the fleet: the metrics batch built from the loop's three maps."""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import TYPE_CHECKING

from cachestore.tier import KeyUsage, MetricsBatch

if TYPE_CHECKING:
    from bridge.codegen import BirCodeGenLoop


def pass_summary(loop: BirCodeGenLoop) -> dict[str, float]:
    """The pass's counters under the names `nkicache compile --json` and the reports use."""
    return {
        "passes": 1,
        "kernels": loop.cache_hits + loop.cache_misses,
        "cache_hits": loop.cache_hits,
        "cache_misses": loop.cache_misses,
        "remote_hits": loop.remote_hits,
        "traces": loop.traces,
        "compile_seconds": round(loop.trace_seconds, 6),
        "saved_seconds": round(loop.saved_seconds, 6),
        "lease_waits": loop.lease_waits,
        **loop.tier_counts(),
    }


def pass_metrics(loop: BirCodeGenLoop, graph_name: str, started: float, finished: float) -> MetricsBatch:
    """One batch per pass, with a fresh id: applying it twice (a retried flush) counts once."""
    settings = loop.tier.settings
    kernel_calls: dict[str, int] = defaultdict(int)
    keys = {}
    for cache_key, components in loop._cache_key_components.items():
        usage = loop._cache_usage_counts.get(cache_key, 0)
        kernel_name = components["kernel_name"]
        kernel_calls[kernel_name] += usage
        first, last = loop.key_use_times.get(cache_key, (started, finished))
        keys[cache_key] = KeyUsage(kernel_name, usage, first, last)
    totals = pass_summary(loop)
    # A pass's id is its batch id: applied once. The fleet names a pass after its job, so a job compiled to
    # the end twice (reclaimed from a worker that was slow, not dead) still counts once.
    pass_id = loop.pass_id or uuid.uuid4().hex
    record = {"pass_id": pass_id, "graph": graph_name, "host": settings.host, "worker": settings.worker,
              "started": started, "finished": finished, **totals}  # fmt: skip
    return MetricsBatch(pass_id, settings.host, settings.worker, totals, dict(kernel_calls), keys, record)
