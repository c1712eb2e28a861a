"""The kernel metrics collector the codegen loop exports to (a process-wide singleton, as in the compiler)."""

from __future__ import annotations

import enum
import threading

import msgspec


class KernelCategory(enum.Enum):
    """Metric buckets. NEW_NKI_FE is where internal kernels re-traced by the bridge land."""

    NEW_NKI_FE = "new_nki_fe"
    NKI_BETA3_FE = "nki_beta3_fe"
    NKI_BETA2_FE = "nki_beta2_fe"
    NATIVE = "native"


class KernelRecord(msgspec.Struct, frozen=True):
    kernel_name: str
    category: KernelCategory
    call_count: int
    number_of_variances: int


class KernelMetricsCollector:
    _instance: KernelMetricsCollector | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[KernelRecord] = []

    @classmethod
    def get_instance(cls) -> KernelMetricsCollector:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def record_kernel(
        self, *, kernel_name: str, category: KernelCategory, call_count: int, number_of_variances: int
    ) -> None:
        with self._lock:
            self._records.append(KernelRecord(kernel_name, category, call_count, number_of_variances))

    @property
    def records(self) -> list[KernelRecord]:
        with self._lock:
            return list(self._records)

    def reset(self) -> None:
        with self._lock:
            self._records.clear()
