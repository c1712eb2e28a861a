"""Why a pass's tier lookup missed: one cause per tier miss, from what the pass saw and what the tier knows.

A tier miss is an in-pass miss that asked the tier and was not answered (tier_lookups - remote_hits). Its
cause comes from two sources, both gathered without a round trip per miss:

- what the pass itself saw: the tier could not be asked, it held an entry the pass rejected, or the pass
  waited on another worker's lease and nothing came;
- what the tier's variant index says about the key, asked once per pass for every key the prefetch found
  absent: which toolchain last stored this exact key (ours: it was evicted or expired since; another: that
  compiler holds it), and whether our toolchain stored this kernel with the same shapes, dtypes and attrs
  (then only the target or the neuroncore count differs), the same shapes and dtypes (the attrs differ), or
  any shape at all (a new shape), or never (a new variant).

The causes are checked in the order of MISS_CAUSES, so each miss gets the first that applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from bridge.ir import freeze_key_components
from bridge.key_rule import key_digest

if TYPE_CHECKING:
    from bridge.port import KernelStore

# Each cause and what it means, in the order they are checked (and shown).
MISS_CAUSE_MEANINGS = {
    "tier_unavailable": "the tier was down, slow or off (its breaker) when the pass asked",
    "rejected": "the tier held an entry under the key and it failed a check (the warning says why)",
    "lease_timeout": "another worker held the key's lease and no trace came within lease_wait",
    "evicted": "this toolchain stored the key before: evicted, expired or deleted since",
    "other_toolchain": "another compiler (toolchain) stored this very key last",
    "target_differs": "stored with these shapes, dtypes and attrs for another target or neuroncore count",
    "attrs_differ": "this kernel is stored with these shapes and dtypes, but other attrs",
    "new_shape": "this kernel is stored, never with these shapes and dtypes",
    "new_variant": "this toolchain never stored this kernel with any shape",
    "unknown": "the tier's variant index could not be read for this pass",
}
MISS_CAUSES = tuple(MISS_CAUSE_MEANINGS)
MISS_COUNTERS = tuple(f"misses_{cause}" for cause in MISS_CAUSES)  # the pass and fleet counters, one per cause
# Key components that say where a variant runs, not what it computes: the target-free fingerprint leaves them out.
PLACEMENT_COMPONENTS = ("target", "num_neuroncores")
FINGERPRINT_HEX = 16


class VariantFingerprints(msgspec.Struct, frozen=True):
    """A variant at three levels of detail: the kernel alone, with its tensors' shapes and dtypes, and with its
    attrs too (everything in the cache key but the target and neuroncore count)."""

    kernel_name: str
    shapes: str
    attrs: str


class VariantFacts(msgspec.Struct, frozen=True):
    """What the tier's variant index knows about a key this pass missed on (see the module docstring)."""

    stored_here_before: bool = False
    stored_by_other_toolchain: bool = False
    same_attrs_stored: bool = False
    same_shapes_stored: bool = False
    kernel_stored: bool = False


class MissObservation(msgspec.Struct, frozen=True):
    """What the pass itself saw of one tier miss."""

    tier_unavailable: bool = False
    rejected: bool = False
    lease_timed_out: bool = False


def variant_fingerprints(key_components: Mapping[str, Any]) -> VariantFingerprints:
    """The fingerprints of a variant from its key components (as the loop builds them, or a stored copy)."""
    components = freeze_key_components(key_components)
    placement_free = {name: value for name, value in components.items() if name not in PLACEMENT_COMPONENTS}
    shapes = {name: value for name, value in placement_free.items() if name != "attrs"}
    return VariantFingerprints(str(components.get("kernel_name", "")), _digest(shapes), _digest(placement_free))


def _digest(components: Mapping[str, Any]) -> str:
    # The key rule's own canonical form, so equal components always match.
    return key_digest(components)[:FINGERPRINT_HEX]


def facts_of_absent(
    tier: KernelStore, components: Mapping[str, Mapping[str, Any]], stored: set[str]
) -> tuple[bool, dict[str, VariantFacts] | None]:
    """(whether the tier was down for a lookup of `components`' keys, what its variant index knows of those it
    held nothing under): one more round trip, made only when some were absent and the tier is up."""
    down = not tier.available
    absent = {key: parts for key, parts in components.items() if key not in stored}
    return down, tier.variant_facts(absent) if absent and not down else None


def facts_of_stored(
    cache_key: str, key_components: Mapping[str, Any], stored: Mapping[str, Mapping[str, Any]]
) -> VariantFacts:
    """What the variant index would say of a miss on `cache_key` once the entries `stored` (cache key -> key
    components, all this toolchain's) are in it: a store's queued entries count as stored, as its reads do."""
    prints = variant_fingerprints(key_components)
    others = [variant_fingerprints(components) for components in stored.values()]
    same_kernel = [other for other in others if other.kernel_name == prints.kernel_name]
    return VariantFacts(
        stored_here_before=cache_key in stored,
        same_attrs_stored=any(other.attrs == prints.attrs for other in same_kernel),
        same_shapes_stored=any(other.shapes == prints.shapes for other in same_kernel),
        kernel_stored=bool(same_kernel),
    )


def merged_facts(one: VariantFacts, other: VariantFacts) -> VariantFacts:
    """Facts of two sources of the same index (what it holds, what is on its way to it): each fact of either."""
    return VariantFacts(
        *(a or b for a, b in zip(msgspec.structs.astuple(one), msgspec.structs.astuple(other), strict=True))
    )


def classify_miss(seen: MissObservation, facts: VariantFacts | None) -> str:
    """The cause of one tier miss (one of MISS_CAUSES): the first that applies, in their order."""
    if seen.tier_unavailable:
        return "tier_unavailable"
    if seen.rejected:
        return "rejected"
    if seen.lease_timed_out:
        return "lease_timeout"
    if facts is None:
        return "unknown"
    if facts.stored_here_before:
        return "evicted"
    if facts.stored_by_other_toolchain:
        return "other_toolchain"
    if facts.same_attrs_stored:
        return "target_differs"
    if facts.same_shapes_stored:
        return "attrs_differ"
    if facts.kernel_stored:
        return "new_shape"
    return "new_variant"
