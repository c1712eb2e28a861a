"""The persistent tier attached to a codegen loop through the specification's own seams, for nkicache's loop and
for any other class with the same roster (neuronx-cc's, under `nkicache exec`: workers/attach.py).

Four methods of the class are wrapped, once per class (`install`); each wrapper finds the pass (`PassSeam`)
attached to the loop it is called on and leaves a loop without one to the original method:

- the key builder `_compute_cache_key_from_components(self, key_components)`: the key is the class's own; the
  pass keeps the components it was built from, and each use of the key (a repeated key is an in-pass hit);
- the bridge `_trace_internal_kernel_to_new_nki_frontend(self, inst, cache_key)`, which the orchestrator calls
  only on an in-pass miss: a trace another process made for the pass (a fleet job's trace task, a variant traced
  ahead by `compile --workers N`), else the tier's verified entry for the key (a remote hit), else single flight
  through the tier's lease, then the class's own bridge, timed. A negative entry (bridge.failures) fails the
  miss at once with its message;
- the store `_cache_new_nki_frontend_binary(self, cache_key, binary, key_components)`: the class's three maps,
  then what the pass traced published to the tier (what the tier or another process's trace task answered is
  not published again);
- the teardown `afterStmtTransform(self)`: the class's epilogues, then the pass's record to the tier.

The class's own state (cache_hits, cache_misses, the three maps, usage counts, statistics, metrics export) is
never written here: what the pass counts lives in its PassSeam. This module knows the tier only through the
port (bridge.port.KernelStore).
"""

from __future__ import annotations

import inspect
import logging
import math
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from bridge.errors import KernelCompileError
from bridge.failures import FAILED, MAX_FAILURE_BYTES, lasting
from bridge.identity import toolchain_id
from bridge.klir import VERSION_IDENTIFIERS
from bridge.miss_causes import MISS_CAUSES, MissObservation, VariantFacts, classify_miss, facts_of_absent
from bridge.port import PASS_COUNTERS, TIER_COUNTERS, KernelStore, PassRecord, StoredTrace, TracedVariant, VariantUse

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
KEY_LOG_PREFIX = 16
# Why a stored trace is not what a loop's bridge would return under a key (None: it is): (loop, key, trace).
Verifier = Callable[[Any, str, StoredTrace], "str | None"]

_originals: dict[type, dict[str, Any]] = {}  # class -> its four original methods, once installed
_passes: weakref.WeakKeyDictionary[Any, PassSeam] = weakref.WeakKeyDictionary()  # loop -> its pass
# class -> a factory of the pass of each loop of it that has none yet (`nkicache exec`: the process's tier).
_defaults: dict[type, Callable[[Any], PassSeam]] = {}


def missing_seams(cls: type) -> list[str]:
    """What keeps a tier from attaching to `cls`, one phrase each; none when it can be attached."""
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
    if not problems and cls not in _originals and not _assignable(cls):
        problems.append(f"{cls.__qualname__} refuses attribute assignment (a compiled cdef class)")
    return problems


def _assignable(cls: type) -> bool:
    probe = "__nkicache_probe__"
    try:
        setattr(cls, probe, None)
        delattr(cls, probe)
    except (TypeError, AttributeError):
        return False
    return True


def install(cls: type) -> None:
    """Wrap the four seams of `cls` (once): each wrapper serves the pass attached to its loop, if any. A seam a
    subclass inherits already wrapped is left as it is."""
    if cls in _originals:
        return
    originals = {}
    for name in SEAMS:
        method = inspect.getattr_static(cls, name)
        originals[name] = getattr(method, WRAPPED, method)
        if not hasattr(method, WRAPPED):
            setattr(cls, name, _wrapper(name, SERVE[name], method))
    _originals[cls] = originals


def original(cls: type, name: str) -> Callable[..., Any]:
    """The seam `name` of `cls` as the class defines it, unwrapped."""
    install(cls)
    return _originals[cls][name]


WRAPPED = "__nkicache_wrapped__"


def _wrapper(name: str, serve: Callable[..., Any], original: Any) -> Callable[..., Any]:
    def method(loop: Any, *args: Any) -> Any:
        bound = original.__get__(loop, type(loop))
        seam = of(loop)
        if seam is None or name in seam.serving:  # (an override calling super() reaches a wrapper twice)
            return bound(*args)
        seam.serving.add(name)
        try:
            return serve(seam, loop, bound, *args)
        finally:
            seam.serving.discard(name)

    method.__name__ = name
    method.__qualname__ = getattr(original, "__qualname__", name)
    method.__doc__ = getattr(original, "__doc__", None)
    method.__wrapped__ = original
    setattr(method, WRAPPED, original)
    return method


def attach(loop: Any, seam: PassSeam) -> PassSeam:
    """Make `seam` the pass of `loop` (its class's seams installed first)."""
    install(type(loop))
    _passes[loop] = seam
    return seam


def of(loop: Any) -> PassSeam | None:
    """The pass attached to `loop`; for a loop of a class with a default (`nkicache exec`), made on first use."""
    seam = _passes.get(loop)
    if seam is None and type(loop) in _defaults:
        seam = _passes[loop] = _defaults[type(loop)](loop)
    return seam


def begin_pass(loop: Any, tier: KernelStore | None, verify: Verifier) -> PassSeam:
    """The pass of a loop that attaches its own seam as it is made (nkicache's, `BirCodeGenLoop(tier=...)`): on
    `tier`; with none, its class's default tier when there is one (`nkicache exec`), else none."""
    default = _defaults.get(type(loop)) if tier is None else None
    return attach(loop, default(loop) if default is not None else PassSeam(tier, verify))


def set_default(cls: type, factory: Callable[[Any], PassSeam]) -> None:
    """Every loop of `cls` gets `factory(loop)` as its pass when first used (its seams installed now)."""
    install(cls)
    _defaults[cls] = factory


def passes() -> list[tuple[Any, PassSeam]]:
    """Every live loop with its pass."""
    return list(_passes.items())


class PassSeam:
    """One pass of a loop with a tier (or none: the traces other processes made for it, and its counts)."""

    def __init__(self, tier: KernelStore | None, verify: Verifier, label: str | None = None) -> None:
        """`verify`: why a stored trace is not what the loop would emit under a key. `label`: the pass's name in
        the tier's metrics; a pass without one is recorded by `finish` only, not by its teardown."""
        self.tier, self.verify, self.label = tier, verify, label
        self.started = time.time()
        self.pass_id: str | None = None  # names this pass's metrics batch in the tier (default: a fresh id)
        self.recorded = False
        self.recorded_counts: Mapping[str, float] = {}  # what the record said, once recorded
        self.serving: set[str] = set()  # the seams being served now (a wrapper reached again runs the original)
        # Counters beyond the specification (bridge.port.PASS_COUNTERS).
        self.traces = 0  # every trace made for the pass, wherever it ran
        self.trace_seconds = 0.0
        self.remote_hits = 0
        self.tier_lookups = 0  # in-pass misses that asked the tier: the shared-cache hit rate's denominator
        self.lease_waits = 0
        self.parallel_traces = 0  # of `traces`, those made in another process
        self.traces_refused = 0  # handed-over traces another compiler made (bridge.port), traced here instead
        self.known_failures = 0  # kernels the tier knew this compiler fails on (negative entries): failed at once
        self.tier_dropped = 0  # traces the tier cannot store (not bytes, not encodable without pickling)
        self.tier_saved_seconds = 0.0
        self.in_pass_saved_seconds = 0.0
        self.miss_causes: dict[str, int] = dict.fromkeys(MISS_CAUSES, 0)
        self.kernel_miss_causes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.key_use_times: dict[str, tuple[float, float]] = {}
        self.tier_counts_at_start: Mapping[str, int] = tier.counts() if tier is not None else {}
        # Variants traced for this pass by another process: by a fleet job's trace tasks (published by them), or
        # ahead by `compile --workers N` (published by the pass). A miss takes one instead of tracing.
        self.traced_elsewhere: dict[str, TracedVariant] = {}
        self.traced_ahead: dict[str, TracedVariant] = {}
        # How the graph's prefetch is read: here by default; a driver with other work for this process (tracing,
        # `compile --workers N`) reads it on a thread of its own and does that work while it waits.
        self.read_tier: Callable[[Callable[[], Any]], Any] = lambda read: read()
        self._components: dict[str, dict] = {}
        self._compile_seconds: dict[str, float] = {}
        self._unpublished: set[str] = set()  # keys whose result came from the tier or a trace task
        self._leases: set[str] = set()
        # The tier's answers for a whole graph, fetched at once (`prefetch`): key -> verified trace or None.
        self._prefetched: dict[str, StoredTrace | None] = {}
        self._prefetch_stored: set[str] = set()  # keys the tier held something under, rejected or not
        self._tier_down = False
        self._variant_facts: dict[str, VariantFacts] | None = None
        self._graph_prefetched = False  # the prefetch asked the index: a miss it did not explain is not asked again

    def reads(self) -> bool:
        return self.tier is not None and self.tier.reads

    # -- the four seams ----------------------------------------------------------------------------
    def key_built(self, loop: Any, build: Callable[[dict], str], key_components: dict) -> str:
        cache_key = build(key_components)
        now = time.time()
        if cache_key in self.key_use_times:  # the orchestrator's probe will hit: what tracing it again would cost
            self.in_pass_saved_seconds += self._compile_seconds.get(cache_key, 0.0)
        first, _ = self.key_use_times.get(cache_key, (now, now))
        self.key_use_times[cache_key] = (first, now)
        self._components[cache_key] = key_components
        return cache_key

    def bridge(self, loop: Any, trace: Callable[[Any, str], dict], inst: Any, cache_key: str) -> dict:
        # The key names the kernel, not the func_name: with a tier, the op is resolved first (the bridge's own first
        # step), so that an unknown func_name or a kernel_name the registry would not select fails as it would
        # without a tier, and is never remembered as the variant's failure.
        try:
            resolve = loop._resolve_kernel_config  # (the specification's roster; a class without it is not asked)
        except AttributeError:
            resolve = None
        if resolve is not None and self.tier is not None:
            resolve(inst)
        result = self._take_traced_elsewhere(inst, cache_key)
        if result is None:
            # A variant this compiler traced ahead for the pass is in hand: it takes no lease (single flight would
            # only make it wait for another process's trace of it, and cost two round trips).
            traced = self.traced_ahead.get(cache_key)
            in_hand = traced is not None and traced.toolchain == toolchain_id()
            result = self._read_through(loop, inst, cache_key, lease=not in_hand)
        if result is not None:
            self._unpublished.add(cache_key)
            return result
        ahead = self._own_compilers(cache_key, self.traced_ahead.pop(cache_key, None))
        if ahead is not None:
            self._count_trace(ahead)
            self._compile_seconds[cache_key] = ahead.seconds
            if ahead.failure is not None:  # traced ahead and failed: remembered here, the pass fails the same way
                self._failed(cache_key, ahead.failure)
                raise KernelCompileError(ahead.failure)
            return dict(ahead.result)
        started = time.perf_counter()
        try:
            result = trace(inst, cache_key)
        except BaseException as exc:
            if lasting(exc):  # the kernel cannot compile: a negative entry (the lease released with it)
                self._failed(cache_key, " ".join(str(exc).split()))
            elif cache_key in self._leases:
                self._leases.discard(cache_key)
                self.tier.release_lease(cache_key)
            raise
        seconds = self._compile_seconds[cache_key] = time.perf_counter() - started
        self.traces += 1
        self.trace_seconds += seconds
        return result

    def stored(self, loop: Any, store: Callable[..., None], cache_key: str, binary: Any, key_components: dict) -> None:
        store(cache_key, binary, key_components)
        if cache_key in self._unpublished:
            self._unpublished.discard(cache_key)
            return
        holds_lease = cache_key in self._leases
        self._leases.discard(cache_key)
        if self.tier is None:
            return
        problem = unstorable(binary, key_components)
        if problem is not None:
            self.tier_dropped += 1
            logger.warning("trace of %s... not stored: %s", cache_key[:KEY_LOG_PREFIX], problem)
            if holds_lease:
                self.tier.release_lease(cache_key)
            return
        seconds = self._compile_seconds.get(cache_key, 0.0)
        self.tier.publish_trace(cache_key, binary, key_components, seconds, release_lease=holds_lease)

    def teardown(self, loop: Any, epilogues: Callable[[], None]) -> None:
        epilogues()
        if self.label is not None:
            self.finish(loop)

    # -- what only a driver can do -----------------------------------------------------------------
    def prefetch(self, loop: Any, ops: Iterable[Any], key_of: Callable[[Any], tuple[dict, str]]) -> None:
        """Ask the tier for every kernel variant of a graph in one round trip, instead of one per miss; entries
        are taken (and counted as remote hits) only when the orchestrator misses on them. `key_of(op)`: the
        op's (key components, cache key), computed with the class's own (unwrapped) key builder."""
        if not self.reads():
            return
        components = {}
        for op in ops:
            key_components, cache_key = key_of(op)
            components[cache_key] = key_components
        self._graph_prefetched = True
        tier = self.tier

        def read() -> tuple[dict[str, StoredTrace], set[str], tuple[bool, dict[str, VariantFacts] | None]]:
            traces, stored = tier.find_traces(sorted(components))
            # For a pass that will miss, one more round trip: what the tier's index knows of the absent keys.
            return traces, stored, facts_of_absent(tier, components, stored)

        traces, self._prefetch_stored, (self._tier_down, self._variant_facts) = self.read_tier(read)
        self._prefetched = {key: traces.get(key) for key in components}

    def tier_counts(self) -> dict[str, int]:
        """Tier errors, timeouts, rejections and drops during this pass (the traces it could not store too)."""
        now = self.tier.counts() if self.tier is not None else {}
        counts = {name: now.get(name, 0) - self.tier_counts_at_start.get(name, 0) for name in TIER_COUNTERS}
        counts["tier_dropped"] += self.tier_dropped
        return counts

    def summary(self, loop: Any) -> dict[str, float]:
        """The pass's counters (bridge.port.PASS_COUNTERS): the class's own cache_hits and cache_misses, and
        this pass's."""
        hits, misses = int(loop.cache_hits), int(loop.cache_misses)
        counts = {
            "passes": 1,
            "kernels": hits + misses,
            "cache_hits": hits,
            "cache_misses": misses,
            "remote_hits": self.remote_hits,
            "tier_lookups": self.tier_lookups,
            "traces": self.traces,
            "parallel_traces": self.parallel_traces,
            "traces_refused": self.traces_refused,
            "known_failures": self.known_failures,
            "compile_seconds": round(self.trace_seconds, 6),
            "tier_saved_seconds": round(self.tier_saved_seconds, 6),
            "in_pass_saved_seconds": round(self.in_pass_saved_seconds, 6),
            "lease_waits": self.lease_waits,
            **self.tier_counts(),
            **{f"misses_{cause}": count for cause, count in self.miss_causes.items()},
        }
        return {name: counts.get(name, 0) for name in PASS_COUNTERS}

    def record(self, loop: Any, graph_name: str, started: float, finished: float) -> PassRecord:
        """What the pass tells the store: its counts and how it used each kernel variant."""
        variants = {}
        usage = loop._cache_usage_counts
        for cache_key, components in loop._cache_key_components.items():
            first, last = self.key_use_times.get(cache_key, (started, finished))
            variants[cache_key] = VariantUse(str(components["kernel_name"]), int(usage.get(cache_key, 0)), first, last)
        kernel_misses = {kernel: dict(causes) for kernel, causes in sorted(self.kernel_miss_causes.items())}
        return PassRecord(graph_name, self.pass_id, started, finished, self.summary(loop), variants, kernel_misses)

    def finish(self, loop: Any, graph_name: str | None = None, started: float | None = None) -> None:
        """Hand the pass's record to the tier, once, without waiting for the tier to store it: the store writes
        behind, and a caller that needs it stored (a fleet job acknowledged) calls the store's flush itself."""
        if self.recorded or self.tier is None:
            return
        self.recorded = True
        for cache_key in self._leases:
            self.tier.release_lease(cache_key)
        self._leases.clear()
        label = graph_name or self.label or type(loop).__name__
        record = self.record(loop, label, started or self.started, time.time())
        self.recorded_counts = record.counts
        self.tier.record_pass(record)
        self._prefetched.clear()  # (binaries the pass did not need: a finished pass keeps only its counts)

    # -- the tier ----------------------------------------------------------------------------------
    def _read_through(self, loop: Any, inst: Any, cache_key: str, lease: bool = True) -> dict | None:
        """On an in-pass miss, the tier's verified entry (counted in remote_hits), else None: trace it, holding
        the lease when single flight and `lease`."""
        if not self.reads():
            return None
        self.tier_lookups += 1
        if cache_key in self._prefetched:
            stored = self._accepted(loop, cache_key, self._prefetched.pop(cache_key))
            held = cache_key in self._prefetch_stored
        else:
            stored, held = self._find(loop, cache_key)
        waited = False
        if stored is None and self.tier.single_flight and lease:
            if self.tier.acquire_lease(cache_key):
                # On a plain miss, the previous holder may have published and released between our lookup and
                # our lease: look once more (an entry just rejected is not read, nor counted, twice).
                stored = None if held else self._find(loop, cache_key)[0]
                if stored is None:
                    self._leases.add(cache_key)
                    self._count_miss(inst, cache_key, MissObservation(self._tier_down, rejected=held))
                    return None
                self.tier.release_lease(cache_key)
            else:
                self.lease_waits += 1
                waited = True
                stored = self._accepted(loop, cache_key, self.tier.wait_for_trace(cache_key))
        if stored is None:
            self._count_miss(inst, cache_key, MissObservation(self._tier_down, held, lease_timed_out=waited))
            return None
        if stored.result["format"] == FAILED:  # this compiler fails on it: the same error, without compiling it again
            self.known_failures += 1
            raise KernelCompileError(stored.result["binary"].decode())
        self.remote_hits += 1
        self.tier_saved_seconds += stored.compile_seconds
        self._compile_seconds[cache_key] = stored.compile_seconds
        return dict(stored.result)

    def _find(self, loop: Any, cache_key: str) -> tuple[StoredTrace | None, bool]:
        traces, held = self.tier.find_traces([cache_key])
        return self._accepted(loop, cache_key, traces.get(cache_key)), cache_key in held

    def _accepted(self, loop: Any, cache_key: str, stored: StoredTrace | None) -> StoredTrace | None:
        """`stored` when it is what a fresh trace under `cache_key` would give, else the next copy the tier has
        that is (a stack's farther level), else None. Each refused one is told to the tier, which counts it in
        tier_rejected: a store's digest and signature say an entry is intact, not that it belongs under the key
        it was read from."""
        while stored is not None:
            problem = self.verify(loop, cache_key, stored)
            if problem is None:
                return stored
            if not self.tier.reject(cache_key, problem):
                return None
            stored = self.tier.find_traces([cache_key])[0].get(cache_key)
        return None

    def _count_miss(self, inst: Any, cache_key: str, seen: MissObservation) -> None:
        """Count a tier miss under its cause (bridge.miss_causes), for the pass and for its kernel; without the
        graph's prefetch (a loop a driver does not prefetch for), the tier's index is asked for this key alone."""
        facts = self._variant_facts
        if facts is None and not self._graph_prefetched and not seen.tier_unavailable and cache_key in self._components:
            facts = self.tier.variant_facts({cache_key: self._components[cache_key]})
        self._count_cause(inst, cache_key, classify_miss(seen, None if facts is None else facts.get(cache_key)))

    def _count_cause(self, inst: Any, cache_key: str, cause: str) -> None:
        self.miss_causes[cause] += 1
        self.kernel_miss_causes[inst.kernel_name][cause] += 1
        logger.debug("Tier miss for %s (cache key: %s...): %s", inst.func_name, cache_key[:KEY_LOG_PREFIX], cause)

    def _failed(self, cache_key: str, message: str) -> None:
        """A negative entry for the key (the lease released with it); without a tier, nothing."""
        holds_lease = cache_key in self._leases
        self._leases.discard(cache_key)
        if self.tier is not None:
            self.tier.publish_failure(cache_key, self._components.get(cache_key, {}), message, holds_lease)

    # -- traces made elsewhere ---------------------------------------------------------------------
    def _take_traced_elsewhere(self, inst: Any, cache_key: str) -> dict | None:
        """On an in-pass miss, the trace a trace task made of this variant for this pass, else None. It is taken
        as a remote hit is taken, and counted apart: the tier did not hold it (when the tier reads, it was asked,
        for the whole compile at once, and missed: a tier lookup, whose cause the plan found), and the pass did
        not trace it."""
        traced = self._own_compilers(cache_key, self.traced_elsewhere.pop(cache_key, None))
        if traced is None:
            return None
        if self.reads():
            self.tier_lookups += 1
            self._count_cause(inst, cache_key, traced.miss_cause)
        self._count_trace(traced)
        if traced.failure is not None:  # its trace task failed, and stored the failure: the pass fails the same way
            raise KernelCompileError(traced.failure)
        self._compile_seconds[cache_key] = traced.seconds
        return dict(traced.result)

    def _own_compilers(self, cache_key: str, traced: TracedVariant | None) -> TracedVariant | None:
        """`traced` when the loop's own compiler made it, else None, counted in traces_refused: the process that
        traced it ran other code (imported from elsewhere), and the pass traces it itself."""
        if traced is None or traced.toolchain == toolchain_id():
            return traced
        self.traces_refused += 1
        logger.warning(
            "Refused a trace of %s... handed over by toolchain %r, not this compiler's (%s): traced here",
            cache_key[:KEY_LOG_PREFIX],
            traced.toolchain,
            toolchain_id(),
        )
        return None

    def _count_trace(self, traced: TracedVariant) -> None:
        """A trace made for this pass by another process or ahead of it: counted as the pass's own trace."""
        self.traces += 1
        self.parallel_traces += int(traced.elsewhere)
        self.trace_seconds += traced.seconds


def trace_problem(
    stored: StoredTrace, toolchain: str, cache_key: str, key_of: Callable[[Mapping[str, Any]], str]
) -> str | None:
    """Why a stored trace is not what a loop of `toolchain` would return under `cache_key`, or None: it must come
    from that very compiler, be BIR (or a negative entry with one readable line), its compile seconds a finite
    number, and its key components must hash to the key through the loop's key rule (`key_of`, raising
    TypeError, ValueError, KeyError or AttributeError for components it cannot have built)."""
    if stored.toolchain != toolchain:
        return f"traced by toolchain {stored.toolchain!r}, not by this compiler ({toolchain})"
    binary, form = stored.result.get("binary"), stored.result.get("format")
    if form == FAILED:
        if not readable(binary):
            return "a failure entry without a readable message"
    elif form != "bir" or not isinstance(binary, bytes):
        return f"format {form!r} with a {type(binary).__name__}: the bridge only emits 'bir' bytes"
    if not isinstance(stored.compile_seconds, int | float) or not 0 <= stored.compile_seconds < math.inf:
        return f"compile_seconds {stored.compile_seconds!r} is not a finite number >= 0"  # it enters every sum
    try:
        actual = key_of(stored.key_components)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        return f"key components are malformed: {exc}"
    if actual != cache_key:
        return f"key components hash to {actual[:16]}..., not to the key it was read under"
    return None


def readable(message: object) -> bool:
    """Whether a negative entry's message is one line of text a pass can fail with."""
    if not isinstance(message, bytes) or not 0 < len(message) <= MAX_FAILURE_BYTES:
        return False
    try:
        return message.decode().isprintable()
    except UnicodeDecodeError:
        return False


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


SERVE = {BRIDGE: PassSeam.bridge, KEY_BUILDER: PassSeam.key_built, STORE: PassSeam.stored, TEARDOWN: PassSeam.teardown}
