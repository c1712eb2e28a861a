"""The tier attached to any codegen loop class through the specification's own seams: ours, neuronx-cc's, or
any class with the same roster (`nkicache exec`, workers/exec_cli.py).

Four methods of the class are wrapped, in place, once:

- the key builder `_compute_cache_key_from_components(self, key_components)`: the key is the class's own; the
  components it was built from are kept for the pass, to publish and to explain a miss;
- the bridge `_trace_internal_kernel_to_new_nki_frontend(self, inst, cache_key)`, which the orchestrator calls
  only on an in-pass miss: the tier is asked first, and a verified entry bound to this key (from this
  toolchain, its components hashing to the key through the class's own key builder) is returned instead of
  tracing; otherwise single flight through the tier's lease, then the class's own trace, timed;
- the store `_cache_new_nki_frontend_binary(self, cache_key, binary, key_components)`: the class's three maps
  first, then the trace published (a result the tier answered is not published back; one whose binary is not
  bytes or whose fields cannot be encoded without pickling is counted in tier_dropped, not stored);
- the teardown `afterStmtTransform(self)`: the class's own epilogues, then the pass's record to the tier (or at
  process exit, for a loop that never reached it).

The class's own state (cache_hits, cache_misses, the three maps, usage counts, its statistics and metrics) is
never written: what the attachment counts lives here, per loop, in a side table. A class that lacks a seam,
has other signatures or refuses attribute assignment (a compiled cdef class) is left as it is.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.metadata
import inspect
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bridge.identity import toolchain_id
from bridge.ir import freeze_key_components
from bridge.klir import VERSION_IDENTIFIERS
from bridge.miss_causes import MissObservation, classify_miss
from bridge.port import PASS_COUNTERS, TIER_COUNTERS, KernelStore, PassRecord, StoredTrace, VariantUse

logger = logging.getLogger(__name__)

BRIDGE = "_trace_internal_kernel_to_new_nki_frontend"
KEY_BUILDER = "_compute_cache_key_from_components"
STORE = "_cache_new_nki_frontend_binary"
TEARDOWN = "afterStmtTransform"
# Each seam and its parameters after self, as the specification gives them.
SEAMS = {
    BRIDGE: ("inst", "cache_key"),
    KEY_BUILDER: ("key_components",),
    STORE: ("cache_key", "binary", "key_components"),
    TEARDOWN: (),
}
OURS = "bridge.codegen:BirCodeGenLoop"
NEURONX_CC = "neuronxcc.starfish.penguin.targets.codegen.BirCodeGenLoop:BirCodeGenLoop"
MARK = "__nkicache_attached__"


def missing_seams(cls: type) -> list[str]:
    """What keeps the tier from attaching to `cls`, one phrase each; none when it can be attached."""
    problems = []
    for name, parameters in SEAMS.items():
        method = inspect.getattr_static(cls, name, None)
        if not callable(method):
            problems.append(f"no {name}")
            continue
        try:
            names = tuple(inspect.signature(method).parameters)[1:]
        except (TypeError, ValueError):
            continue  # a compiled method that does not say: called as the specification says
        if names != parameters:
            problems.append(f"{name}({', '.join(names)}) is not {name}({', '.join(parameters)})")
    if not problems and not _assignable(cls):
        problems.append(f"{cls.__qualname__} refuses attribute assignment (a compiled cdef class)")
    return problems


def _assignable(cls: type) -> bool:
    try:
        setattr(cls, MARK, False)
        delattr(cls, MARK)
    except (TypeError, AttributeError):
        return False
    return True


def loop_toolchain(cls: type) -> str:
    """The toolchain id of the compiler a loop class belongs to: ours (bridge.identity) for ours; for another,
    16 hex digits of a SHA-256 over its distribution's name and version and the bytes of the module file that
    defines it (the .so for neuronx-cc), so a new build of that compiler never reads an old build's entries."""
    module = sys.modules[cls.__module__]
    if module.__name__ == "bridge.codegen":
        return toolchain_id()
    top = module.__name__.partition(".")[0]
    names = importlib.metadata.packages_distributions().get(top, [])
    versions = sorted(f"{name}=={importlib.metadata.version(name)}" for name in names)
    digest = hashlib.sha256("\n".join(versions or [f"{top} (no distribution)"]).encode())
    digest.update(Path(module.__file__).read_bytes() if module.__file__ else module.__name__.encode())
    return digest.hexdigest()[:16]


@dataclass
class PassState:
    """What the attachment knows of one loop instance (one pass)."""

    started: float = field(default_factory=time.time)
    tier_counts_at_start: Mapping[str, int] = field(default_factory=dict)
    components: dict[str, dict] = field(default_factory=dict)  # cache key -> the components it was built from
    seconds: dict[str, float] = field(default_factory=dict)  # cache key -> what its trace took, until stored
    from_tier: set[str] = field(default_factory=set)  # keys the tier answered: not published back
    leases: set[str] = field(default_factory=set)
    counts: Counter = field(default_factory=Counter)
    kernel_misses: defaultdict = field(default_factory=lambda: defaultdict(Counter))
    recorded: bool = False


class Attachment:
    """The tier attached to one loop class, for this process."""

    def __init__(self, cls: type, tier: KernelStore, toolchain: str, label: str) -> None:
        self.cls, self.tier, self.toolchain, self.label = cls, tier, toolchain, label
        self.originals = {name: inspect.getattr_static(cls, name) for name in SEAMS}
        self.passes: weakref.WeakKeyDictionary[Any, PassState] = weakref.WeakKeyDictionary()
        self.recorded: list[Mapping[str, float]] = []  # every pass's counts, for the summary
        self._lock = threading.Lock()

    def install(self) -> None:
        for name, wrapper in (
            (BRIDGE, self._bridge),
            (KEY_BUILDER, self._key_builder),
            (STORE, self._store),
            (TEARDOWN, self._teardown),
        ):
            setattr(self.cls, name, _method(wrapper, self.originals[name]))
        setattr(self.cls, MARK, True)

    def _call(self, name: str, loop: Any, *args: Any) -> Any:
        return self.originals[name].__get__(loop, self.cls)(*args)

    def _state(self, loop: Any) -> PassState | None:
        """The pass state of `loop`; None for a loop with a tier of its own (our loop given tier=...)."""
        if getattr(loop, "tier", None) is not None:
            return None
        with self._lock:
            if loop not in self.passes:
                self.passes[loop] = PassState(tier_counts_at_start=self.tier.counts())
            return self.passes[loop]

    # -- the four seams ----------------------------------------------------------------------------
    def _key_builder(self, loop: Any, key_components: dict) -> str:
        cache_key = self._call(KEY_BUILDER, loop, key_components)
        state = self._state(loop)
        if state is not None and isinstance(cache_key, str):
            state.components[cache_key] = key_components
        return cache_key

    def _bridge(self, loop: Any, inst: Any, cache_key: str) -> dict:
        state = self._state(loop)
        components = state.components.get(cache_key) if state is not None else None
        if state is None or components is None:
            return self._call(BRIDGE, loop, inst, cache_key)
        found = self._read_through(loop, state, cache_key, components)
        if found is not None:
            return found
        started = time.perf_counter()
        try:
            result = self._call(BRIDGE, loop, inst, cache_key)
        except BaseException:
            if cache_key in state.leases:
                state.leases.discard(cache_key)
                self.tier.release_lease(cache_key)
            raise
        state.seconds[cache_key] = seconds = time.perf_counter() - started
        state.counts["traces"] += 1
        state.counts["compile_seconds"] += seconds
        return result

    def _store(self, loop: Any, cache_key: str, binary: Any, key_components: dict) -> None:
        self._call(STORE, loop, cache_key, binary, key_components)
        state = self._state(loop)
        if state is None or cache_key in state.from_tier or cache_key not in state.seconds:
            return
        holds_lease = cache_key in state.leases
        state.leases.discard(cache_key)
        problem = unstorable(binary, key_components)
        if problem is not None:
            state.counts["tier_dropped"] += 1
            logger.warning("nkicache: trace of %s... not stored: %s", cache_key[:16], problem)
            if holds_lease:
                self.tier.release_lease(cache_key)
            return
        seconds = state.seconds.pop(cache_key)
        self.tier.publish_trace(cache_key, binary, key_components, seconds, release_lease=holds_lease)

    def _teardown(self, loop: Any) -> None:
        self._call(TEARDOWN, loop)
        state = self._state(loop)
        if state is not None:
            self.record(loop, state)

    # -- the tier ----------------------------------------------------------------------------------
    def _read_through(self, loop: Any, state: PassState, cache_key: str, components: dict) -> dict | None:
        """The tier's verified trace for this miss (counted in remote_hits), else None with the miss's cause
        counted and, single flight, this process holding the lease."""
        if not self.tier.reads:
            return None
        state.counts["tier_lookups"] += 1
        traces, held = self.tier.find_traces([cache_key])
        stored, waited = self._accepted(loop, cache_key, traces.get(cache_key)), False
        if stored is None and self.tier.single_flight:
            if self.tier.acquire_lease(cache_key):
                state.leases.add(cache_key)
            else:
                state.counts["lease_waits"] += 1
                waited = True
                stored = self._accepted(loop, cache_key, self.tier.wait_for_trace(cache_key))
        if stored is None:
            facts = self.tier.variant_facts({cache_key: components}) or {}
            seen = MissObservation(not self.tier.available, cache_key in held, lease_timed_out=waited)
            cause = classify_miss(seen, facts.get(cache_key))
            state.counts[f"misses_{cause}"] += 1
            state.kernel_misses[str(components.get("kernel_name", ""))][cause] += 1
            return None
        state.counts["remote_hits"] += 1
        state.counts["tier_saved_seconds"] += stored.compile_seconds
        state.from_tier.add(cache_key)
        return dict(stored.result)

    def _accepted(self, loop: Any, cache_key: str, stored: StoredTrace | None) -> StoredTrace | None:
        if stored is None:
            return None
        problem = self.stored_trace_problem(loop, cache_key, stored)
        if problem is None:
            return stored
        self.tier.reject(cache_key, problem)
        return None

    def stored_trace_problem(self, loop: Any, cache_key: str, stored: StoredTrace) -> str | None:
        """Why a stored trace is not what this loop's bridge would return under `cache_key`, or None: it must
        come from this compiler, be BIR, and its components must hash to the key through the class's own key
        builder (as stored, or with msgpack's lists made tuples again, as a Python IR keeps shapes)."""
        if stored.toolchain != self.toolchain:
            return f"traced by toolchain {stored.toolchain!r}, not by this compiler ({self.toolchain})"
        if stored.result.get("format") != "bir" or not isinstance(stored.result.get("binary"), bytes):
            return "not a BIR binary"
        if not isinstance(stored.compile_seconds, int | float) or not 0 <= stored.compile_seconds < math.inf:
            return f"compile_seconds {stored.compile_seconds!r} is not a finite number >= 0"
        for components in (dict(stored.key_components), freeze_key_components(stored.key_components)):
            try:
                if self._call(KEY_BUILDER, loop, components) == cache_key:
                    return None
            except Exception as exc:  # the class's own builder refusing them: not its components
                return f"key components are malformed: {type(exc).__name__}: {exc}"
        return "key components hash to another key through the class's own key builder"

    def record(self, loop: Any, state: PassState) -> None:
        """Hand the pass's record to the tier, once: its counts (the class's own cache_hits and cache_misses,
        the attachment's counters) and how it used each variant."""
        if state.recorded:
            return
        state.recorded = True
        for cache_key in state.leases:
            self.tier.release_lease(cache_key)
        finished = time.time()
        counts = dict.fromkeys(PASS_COUNTERS, 0) | dict(state.counts)
        hits, misses = int(loop.cache_hits), int(loop.cache_misses)
        counts |= {"passes": 1, "kernels": hits + misses, "cache_hits": hits, "cache_misses": misses}
        now = self.tier.counts()
        for name in TIER_COUNTERS:
            counts[name] += now.get(name, 0) - state.tier_counts_at_start.get(name, 0)
        usage = loop._cache_usage_counts
        variants = {
            key: VariantUse(str(parts.get("kernel_name", "")), int(usage.get(key, 0)), state.started, finished)
            for key, parts in loop._cache_key_components.items()
        }
        misses_by_kernel = {kernel: dict(causes) for kernel, causes in state.kernel_misses.items()}
        self.tier.record_pass(PassRecord(self.label, None, state.started, finished, counts, variants, misses_by_kernel))
        self.recorded.append(counts)

    def close(self) -> None:
        """At process exit: the record of every pass that never reached its teardown, then the tier closed
        (what it queued stored)."""
        with self._lock:
            unrecorded = [(loop, state) for loop, state in self.passes.items() if not state.recorded]
        for loop, state in unrecorded:
            self.record(loop, state)
        self.tier.close()


def _method(wrapper: Callable[..., Any], original: Any) -> Callable[..., Any]:
    """A plain function for the class, calling `wrapper(self, ...)`, named and documented as the original."""

    def method(self: Any, *args: Any) -> Any:
        return wrapper(self, *args)

    method.__name__ = getattr(original, "__name__", "method")
    method.__qualname__ = getattr(original, "__qualname__", method.__name__)
    method.__doc__ = getattr(original, "__doc__", None)
    method.__wrapped__ = original
    return method


def unstorable(result: Any, key_components: Any) -> str | None:
    """Why a trace result cannot be stored without pickling, or None: the specification's dict with a bytes
    binary, lists of names, a known format, and components msgpack can encode."""
    if not isinstance(result, Mapping):
        return f"the trace result is a {type(result).__name__}, not a dict"
    if not isinstance(result.get("binary"), bytes):
        return f"its binary is a {type(result.get('binary')).__name__}, not bytes"
    if result.get("format") not in VERSION_IDENTIFIERS:
        return f"format {result.get('format')!r} is none of {', '.join(VERSION_IDENTIFIERS)}"
    for name in ("input_names", "output_names"):
        names = result.get(name)
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            return f"its {name} are not a list of strings"
    try:
        msgspec.msgpack.encode(key_components)
    except (TypeError, ValueError, OverflowError) as exc:
        return f"its key components cannot be encoded without pickling: {exc}"
    return None


# -- attaching in a process that `nkicache exec` started --------------------------------------------------
_attachments: list[Attachment] = []


def attach(cls: type, tier: KernelStore, toolchain: str, label: str) -> Attachment | None:
    """Attach `tier` to `cls` (once); None, with one warning line on stderr, when it cannot be."""
    if inspect.getattr_static(cls, MARK, False):
        return None
    problems = missing_seams(cls)
    if problems:
        print(
            f"nkicache exec: not attached to {cls.__module__}.{cls.__qualname__}: {'; '.join(problems)}; it runs "
            "without the tier",
            file=sys.stderr,
        )
        return None
    attachment = Attachment(cls, tier, toolchain, label)
    attachment.install()
    if not _attachments:
        atexit.register(_at_exit)
    _attachments.append(attachment)
    return attachment


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
    totals: Counter = Counter()
    for attachment in _attachments:
        attachment.close()
        for counts in attachment.recorded:
            totals.update(counts)
    if os.environ.get("NKICACHE_EXEC_SUMMARY") == "1":
        print(
            f"nkicache: {int(totals['passes'])} passes, {int(totals['traces'])} traces, "
            f"{int(totals['remote_hits'])} remote hits of {int(totals['tier_lookups'])} tier lookups",
            file=sys.stderr,
        )
