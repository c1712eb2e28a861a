"""Platform targets.

The cache key folds in the target's class name and its neuroncore count (see the specification), so the
class names are part of the cache contract: rename one and every cached entry for it misses.
"""

from __future__ import annotations

import os

from bridge.errors import NkiCacheError

TARGET_ENV = "NKICACHE_TARGET"


class Target:
    """A platform the kernels are compiled for."""

    num_neuroncores_per_sengine: int = 1
    # SBUF bytes per partition; a single tile may not exceed it.
    sbuf_partition_bytes: int = 192 * 1024

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self).__name__)


class Trn1(Target):
    num_neuroncores_per_sengine = 1


class Trn2(Target):
    num_neuroncores_per_sengine = 2
    sbuf_partition_bytes = 192 * 1024


TARGETS: dict[str, type[Target]] = {"Trn1": Trn1, "Trn2": Trn2}
DEFAULT_TARGET = "Trn2"


def make_target(name: str) -> Target:
    """The target called `name` ("Trn1", "Trn2"), with a clear error for anything else."""
    try:
        return TARGETS[name]()
    except KeyError:
        raise NkiCacheError(f"unknown target {name!r}; known targets: {', '.join(TARGETS)}") from None


def get_platform_target() -> Target:
    """The target of this process: $NKICACHE_TARGET when set, else Trn2."""
    return make_target(os.environ.get(TARGET_ENV) or DEFAULT_TARGET)
