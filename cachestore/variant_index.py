"""The tier's variant index: what each kernel's stored variants looked like, for the cause of a miss.

One small hash per kernel name (a Redis hash, rows of a table in the local tier), written with every entry
stored and read once per pass for the keys the pass's prefetch found absent (bridge.miss_causes says what
each cause means). Fields, for a partition TC (a toolchain in a scope: cachestore.keys.partition) and a
variant's fingerprints (bridge.miss_causes):

    h:<first 16 hex digits of the cache key>   TC of the last toolchain that stored this very key
    k:<TC>                                     TC stored this kernel with some shape
    s:<TC>:<shapes fingerprint>                TC stored it with these shapes and dtypes
    a:<TC>:<attrs fingerprint>                 ... and these attrs (any target or neuroncore count)

The index only ever says what was stored once, not what is stored now: that is what tells an evicted key
from a new one. It expires with the entries (each store gives the kernel's hash the entry TTL again), and a
16-digit prefix of a cache key is plenty to tell keys apart for a diagnosis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bridge.miss_causes import VariantFacts, variant_fingerprints
from cachestore.keys import split_partition

KEY_PREFIX_HEX = 16


def stored_fields(cache_key: str, key_components: Mapping[str, Any], toolchain: str) -> dict[str, str]:
    """The fields a store of `cache_key` in `toolchain`'s partition (its toolchain in its scope, as
    cachestore.keys.partition names it) sets in its kernel's hash."""
    prints = variant_fingerprints(key_components)
    return {
        f"h:{cache_key[:KEY_PREFIX_HEX]}": toolchain,
        f"k:{toolchain}": "1",
        f"s:{toolchain}:{prints.shapes}": "1",
        f"a:{toolchain}:{prints.attrs}": "1",
    }


def query_fields(cache_key: str, key_components: Mapping[str, Any], toolchain: str) -> tuple[str, list[str]]:
    """(kernel name, the fields to read) for a miss on `cache_key` by `toolchain`, in the order `facts` takes."""
    prints = variant_fingerprints(key_components)
    return prints.kernel_name, [
        f"h:{cache_key[:KEY_PREFIX_HEX]}",
        f"a:{toolchain}:{prints.attrs}",
        f"s:{toolchain}:{prints.shapes}",
        f"k:{toolchain}",
    ]


def facts(values: Sequence[str | bytes | None], partition: str) -> VariantFacts:
    """The facts a miss's fields (as `query_fields` listed them for `partition`) hold. A key last stored in
    another scope of this toolchain (cachestore.keys.partition) is neither evicted from here nor another
    toolchain's: for this partition it was never stored."""
    last_holder, same_attrs, same_shapes, kernel = (_text(value) for value in values)
    other = last_holder is not None and split_partition(last_holder)[0] != split_partition(partition)[0]
    return VariantFacts(
        stored_here_before=last_holder == partition,
        stored_by_other_toolchain=other,
        same_attrs_stored=same_attrs is not None,
        same_shapes_stored=same_shapes is not None,
        kernel_stored=kernel is not None,
    )


def _text(value: str | bytes | None) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else value
