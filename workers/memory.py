"""How much memory `nkicache run` of an artifact needs, and how much this process can have.

Running an artifact holds every tensor of its graph in numpy, and --check adds the references' float64
copies; the decoded instructions take far more than their msgpack bytes. Measured on softmax graphs (`nkicache
run` peak RSS): about 5 bytes per tensor element, 22 with --check, over a base of 150 MiB. The estimate keeps
a margin over those, so a refusal errs on the side of running what it can.
"""

from __future__ import annotations

import math
import resource
from pathlib import Path

BASE_BYTES = 150 * 1024 * 1024  # the interpreter, numpy and the compiler, before any tensor
BYTES_PER_ELEMENT = 6
BYTES_PER_ELEMENT_CHECKED = 24
BYTES_PER_ARTIFACT_BYTE = 40  # decoded instructions (Python lists) against their msgpack encoding


def run_bytes(artifact: object, artifact_bytes: int, check: bool) -> int:
    """Bytes a run of `artifact` (of `artifact_bytes` on disk) is estimated to need at its peak."""
    elements = sum(math.prod(tensor.shape) for tensor in artifact.tensors.values())
    per_element = BYTES_PER_ELEMENT_CHECKED if check else BYTES_PER_ELEMENT
    return BASE_BYTES + elements * per_element + artifact_bytes * BYTES_PER_ARTIFACT_BYTE


def available_bytes() -> int | None:
    """What this process can still allocate: the least of the machine's available memory, its cgroup's
    headroom (a container's limit) and its address-space limit; None when none of them can be read."""
    bounds = [_meminfo_available(), _cgroup_headroom(), _address_space_headroom()]
    known = [bound for bound in bounds if bound is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def _address_space_headroom() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        size = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None
    return soft - size
