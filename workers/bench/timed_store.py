"""A KernelStore that times the calls a codegen loop makes into another one, for the figures that report the
seconds a compile's own thread spends in its tier. A wrapper, not patched methods: the tier stays as the
compile sees it, and only the port's calls are timed (a call a tier makes inside itself is part of its caller's).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from bridge.miss_causes import VariantFacts
from bridge.port import KernelStore, PassRecord, StoredTrace


class TimedStore:
    """Delegates each KernelStore call to `inner`, adding its wall time to `seconds[method name]`."""

    def __init__(self, inner: KernelStore) -> None:
        self.inner = inner
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def _since(self, name: str, started: float) -> None:
        self.seconds[name] += time.perf_counter() - started

    @property
    def total(self) -> float:
        """Seconds in every call so far."""
        return sum(self.seconds.values())

    @property
    def reads(self) -> bool:
        return self.inner.reads

    @property
    def writes(self) -> bool:
        return self.inner.writes

    @property
    def available(self) -> bool:
        return self.inner.available

    @property
    def single_flight(self) -> bool:
        return self.inner.single_flight

    def find_traces(self, cache_keys: Sequence[str]) -> tuple[dict[str, StoredTrace], set[str]]:
        started = time.perf_counter()
        try:
            return self.inner.find_traces(cache_keys)
        finally:
            self._since("find_traces", started)

    def acquire_lease(self, cache_key: str) -> bool:
        started = time.perf_counter()
        try:
            return self.inner.acquire_lease(cache_key)
        finally:
            self._since("acquire_lease", started)

    def release_lease(self, cache_key: str) -> None:
        started = time.perf_counter()
        try:
            self.inner.release_lease(cache_key)
        finally:
            self._since("release_lease", started)

    def wait_for_trace(self, cache_key: str) -> StoredTrace | None:
        started = time.perf_counter()
        try:
            return self.inner.wait_for_trace(cache_key)
        finally:
            self._since("wait_for_trace", started)

    def variant_facts(self, misses: Mapping[str, Mapping[str, Any]]) -> dict[str, VariantFacts] | None:
        started = time.perf_counter()
        try:
            return self.inner.variant_facts(misses)
        finally:
            self._since("variant_facts", started)

    def reject(self, cache_key: str, reason: str) -> None:
        started = time.perf_counter()
        try:
            self.inner.reject(cache_key, reason)
        finally:
            self._since("reject", started)

    def publish_trace(
        self,
        cache_key: str,
        result: dict,
        key_components: Mapping[str, Any],
        compile_seconds: float,
        release_lease: bool = False,
    ) -> None:
        started = time.perf_counter()
        try:
            self.inner.publish_trace(cache_key, result, key_components, compile_seconds, release_lease)
        finally:
            self._since("publish_trace", started)

    def record_pass(self, record: PassRecord) -> None:
        started = time.perf_counter()
        try:
            self.inner.record_pass(record)
        finally:
            self._since("record_pass", started)

    def flush(self) -> bool:
        started = time.perf_counter()
        try:
            return self.inner.flush()
        finally:
            self._since("flush", started)

    def counts(self) -> dict[str, int]:
        return self.inner.counts()

    def level_hits(self) -> dict[str, int]:
        return self.inner.level_hits()
