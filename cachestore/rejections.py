"""How a client reports the entries it refuses: the first of each cause as a warning, the rest at debug level,
and one line with the counts when the client closes, so that a tier full of bad entries costs a few lines of
stderr, not two a read (each refusal is counted in tier_rejected as well)."""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter

from bridge.port import plural

logger = logging.getLogger("cachestore.client")

MAX_CAUSES = 32  # distinct causes kept apart; the rest are counted together (a writer chooses its reasons' text)
OTHER = "other causes"
# Numbers and quoted values in a reason (sizes, field values, a writer's text) do not make another cause.
_VARIABLE = re.compile(r"'[^']*'|\"[^\"]*\"|\d+(?:\.\d+)?(?:e[+-]?\d+)?")


def cause_of(reason: str) -> str:
    """The cause of a refusal: its reason before any ': detail', its numbers and quoted values elided."""
    return _VARIABLE.sub("…", reason.split(": ", 1)[0])


class RejectionLog:
    """The refusals of one client, by cause."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, cache_key: str, reason: str) -> None:
        cause = cause_of(reason)
        with self._lock:
            if cause not in self.counts and len(self.counts) >= MAX_CAUSES:
                cause = OTHER
            self.counts[cause] += 1
            first = self.counts[cause] == 1
        if first:
            logger.warning(
                "rejected tier entry %s...: %s (more refused for this cause are counted, shown at debug level)",
                cache_key[:16],
                reason,
            )
        else:
            logger.debug("rejected tier entry %s...: %s", cache_key[:16], reason)

    def log_summary(self) -> None:
        """One line with the count of each cause, when any cause refused more than one entry."""
        with self._lock:
            counts = dict(self.counts)
        if any(count > 1 for count in counts.values()):
            causes = "; ".join(f"{count} {cause}" for cause, count in sorted(counts.items(), key=lambda c: -c[1]))
            logger.warning("tier %s: rejected %s in all: %s", self.tier, plural(sum(counts.values()), "entry"), causes)
