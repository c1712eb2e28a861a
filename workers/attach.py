"""`nkicache exec`'s attachment: the process's tier attached to every loop of a class with the specification's
roster (ours, neuronx-cc's, any --loop), through the one seam every loop uses (bridge.tier_seam).

For a loop class that is not ours, the tier reads and writes under that compiler's own toolchain id (its
distribution and the module file defining the class, `loop_toolchain`), and a stored trace is taken only when
its components hash to its key through the class's own key builder. Each loop of the class gets its pass on
first use; a pass that never reached its teardown is recorded at process exit, when the tier is closed.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from bridge import tier_seam
from bridge.identity import toolchain_id
from bridge.ir import freeze_key_components
from bridge.port import KernelStore, StoredTrace

OURS = "bridge.codegen"
_tiers: list[tuple[type, KernelStore]] = []  # the classes attached in this process, with their tier
_seams: list[tier_seam.PassSeam] = []  # every pass on them, for the summary (a loop may be gone by the exit)


def loop_toolchain(cls: type) -> str:
    """The toolchain id of the compiler a loop class belongs to: ours (bridge.identity) for ours; for another,
    16 hex digits of a SHA-256 over its distribution's name and version and the bytes of the module file that
    defines it (the .so for neuronx-cc), so a new build of that compiler never reads an old build's entries."""
    module = sys.modules[cls.__module__]
    if module.__name__ == OURS:
        return toolchain_id()
    top = module.__name__.partition(".")[0]
    names = importlib.metadata.packages_distributions().get(top, [])
    versions = sorted(f"{name}=={importlib.metadata.version(name)}" for name in names)
    digest = hashlib.sha256("\n".join(versions or [f"{top} (no distribution)"]).encode())
    digest.update(Path(module.__file__).read_bytes() if module.__file__ else module.__name__.encode())
    return digest.hexdigest()[:16]


def foreign_trace_problem(toolchain: str) -> tier_seam.Verifier:
    """Why a stored trace is not what a foreign loop's bridge would return under a key (tier_seam.trace_problem),
    its components hashed through the class's own key builder: as stored, or with msgpack's lists made tuples
    again, as a Python IR keeps shapes."""

    def problem(loop: Any, cache_key: str, stored: StoredTrace) -> str | None:
        build = tier_seam.original(type(loop), tier_seam.KEY_BUILDER)

        def key_of(components: Any) -> str:
            try:
                as_stored = build(loop, dict(components))
                return as_stored if as_stored == cache_key else build(loop, freeze_key_components(components))
            except Exception as exc:  # the class's own builder refusing them: not its components
                raise ValueError(f"{type(exc).__name__}: {exc}") from None

        return tier_seam.trace_problem(stored, toolchain, cache_key, key_of)

    return problem


def attach(cls: type, tier: KernelStore, toolchain: str, label: str) -> bool:
    """Give every loop of `cls` a pass on `tier`; False, with one warning line on stderr, when it cannot be."""
    problems = tier_seam.missing_seams(cls)
    if problems:
        print(
            f"nkicache exec: not attached to {cls.__module__}.{cls.__qualname__}: {'; '.join(problems)}; it runs "
            "without the tier",
            file=sys.stderr,
        )
        return False
    if cls.__module__ == OURS:
        from bridge.codegen import _verify as verify
    else:
        verify = foreign_trace_problem(toolchain)

    def own_pass(loop: Any) -> tier_seam.PassSeam:
        _seams.append(tier_seam.PassSeam(tier, verify, label))
        return _seams[-1]

    tier_seam.set_default(cls, own_pass)
    if not _tiers:
        atexit.register(_at_exit)
    _tiers.append((cls, tier))
    return True


def attach_from_environment(module: Any, class_name: str) -> None:
    """The post-import hook of `nkicache exec`'s bootstrap: attach the tier its settings name (the environment)
    to `class_name` of the module just imported. Never raises: the command runs as it would without nkicache."""
    try:
        from cachestore.settings import load_settings
        from cachestore.stores import open_tier

        cls = getattr(module, class_name, None)
        if not isinstance(cls, type):
            print(f"nkicache exec: {module.__name__} has no class {class_name}; nothing attached", file=sys.stderr)
            return
        toolchain = loop_toolchain(cls)
        tier = open_tier(load_settings(), toolchain)
        if tier is not None:
            label = os.environ.get("NKICACHE_EXEC_LABEL") or Path(sys.argv[0] or cls.__name__).name
            attach(cls, tier, toolchain, label)
    except Exception as exc:  # the compile it serves must run, whatever went wrong here
        print(f"nkicache exec: not attached to {module.__name__}.{class_name}: {exc}", file=sys.stderr)


def _at_exit() -> None:
    """Record every pass that never reached its teardown, close the tiers (what they queued is stored), and
    print the summary when asked."""
    mine = {id(seam) for seam in _seams}
    for loop, seam in tier_seam.passes():
        if id(seam) in mine:
            seam.finish(loop)
    totals: Counter = Counter()
    for seam in _seams:
        totals.update(seam.recorded_counts)
    for _, tier in _tiers:
        tier.close()
    if os.environ.get("NKICACHE_EXEC_SUMMARY") == "1":
        print(
            f"nkicache: {int(totals['passes'])} passes, {int(totals['traces'])} traces, "
            f"{int(totals['remote_hits'])} remote hits of {int(totals['tier_lookups'])} tier lookups",
            file=sys.stderr,
        )
