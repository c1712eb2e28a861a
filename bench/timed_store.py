"""A KernelStore that times the calls a codegen loop makes into another one, for the figures that report the
seconds a compile's own thread spends in its tier. A wrapper, not patched methods: the tier stays as the
compile sees it, and only the port's calls are timed (a call a tier makes inside itself is part of its caller's).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from bridge.miss_causes import VariantFacts
from bridge.port import KernelStore, PassRecord, StoredTrace


class TimedStore:
    """Delegates each KernelStore call to `inner`, adding its wall time to `seconds[method name]`."""

    def __init__(self, inner: KernelStore) -> None:
        self.inner = inner
        self.seconds: defaultdict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
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

    def overdue(self, caller: int, patience: float) -> bool:
        return self.inner.overdue(caller, patience)

    def give_up(self, why: str) -> None:
        self.inner.give_up(why)

    @property
    def single_flight(self) -> bool:
        return self.inner.single_flight

    def find_traces(self, cache_keys: Sequence[str]) -> tuple[dict[str, StoredTrace], set[str]]:
        with self._timed("find_traces"):
            return self.inner.find_traces(cache_keys)

    def acquire_lease(self, cache_key: str) -> bool:
        with self._timed("acquire_lease"):
            return self.inner.acquire_lease(cache_key)

    def release_lease(self, cache_key: str) -> None:
        with self._timed("release_lease"):
            self.inner.release_lease(cache_key)

    def wait_for_trace(self, cache_key: str) -> StoredTrace | None:
        with self._timed("wait_for_trace"):
            return self.inner.wait_for_trace(cache_key)

    def variant_facts(self, misses: Mapping[str, Mapping[str, Any]]) -> dict[str, VariantFacts] | None:
        with self._timed("variant_facts"):
            return self.inner.variant_facts(misses)

    def reject(self, cache_key: str, reason: str) -> bool:
        with self._timed("reject"):
            return self.inner.reject(cache_key, reason)

    def publish_trace(
        self,
        cache_key: str,
        result: dict,
        key_components: Mapping[str, Any],
        compile_seconds: float,
        release_lease: bool = False,
    ) -> None:
        with self._timed("publish_trace"):
            self.inner.publish_trace(cache_key, result, key_components, compile_seconds, release_lease)

    def publish_failure(
        self, cache_key: str, key_components: Mapping[str, Any], message: str, release_lease: bool = False
    ) -> None:
        with self._timed("publish_failure"):
            self.inner.publish_failure(cache_key, key_components, message, release_lease)

    def record_pass(self, record: PassRecord) -> None:
        with self._timed("record_pass"):
            self.inner.record_pass(record)

    def flush(self) -> bool:
        with self._timed("flush"):
            return self.inner.flush()

    def counts(self) -> dict[str, int]:
        return self.inner.counts()

    def level_hits(self) -> dict[str, int]:
        return self.inner.level_hits()
