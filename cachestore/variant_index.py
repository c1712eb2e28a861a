"""The tier's variant index: what each kernel's stored variants looked like, for the cause of a miss.

One small hash per kernel name (a Redis hash, rows of a table in the local tier), written with every entry
stored and read once per pass for the keys the pass's prefetch found absent (bridge.miss_causes says what
each cause means). Fields, for a partition (a toolchain in a scope: cachestore.keys.partition) named by its
tag TAG (`partition_tag`) and a variant's fingerprints (bridge.miss_causes):

    h <first 8 bytes of the cache key>   TAG of the last partition that stored this very key
    k TAG                                TAG stored this kernel with some shape
    s TAG <shapes fingerprint, 8 bytes>  TAG stored it with these shapes and dtypes
    a TAG <attrs fingerprint, 8 bytes>   ... and these attrs (any target or neuroncore count)

Names and values are raw bytes (issue 16: the index was about a tenth of what Redis held per variant as hex
text, `h:<16 hex>` -> 16 hex digits and so on, and a listpack field costs its length): a hex cache key,
toolchain id or fingerprint is held in half as many bytes. A TAG is the length of the toolchain id's bytes,
those bytes (8 for the usual 16 hex digits, the text of any other id), then the scope's name (nothing for
the trusted scope), so a toolchain's part is read back without a separator. An index of the text layout
(before issue 16) is not read: its kernels' misses are `new_variant` until they are stored again.

The index only ever says what was stored once, not what is stored now: that is what tells an evicted key
from a new one. It expires with the entries (each store gives the kernel's hash the entry TTL again), and an
8-byte prefix of a cache key is plenty to tell keys apart for a diagnosis.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from bridge.miss_causes import VariantFacts, variant_fingerprints
from cachestore.keys import split_partition

KEY_PREFIX_BYTES = 8
_STORED = b"1"


def stored_fields(cache_key: str, key_components: Mapping[str, Any], partition: str) -> dict[bytes, bytes]:
    """The fields a store of `cache_key` in `partition` (its toolchain in its scope, as cachestore.keys.partition
    names it) sets in its kernel's hash."""
    prints = variant_fingerprints(key_components)
    tag = partition_tag(partition)
    return {
        b"h" + _key_prefix(cache_key): tag,
        b"k" + tag: _STORED,
        b"s" + tag + _hex_bytes(prints.shapes): _STORED,
        b"a" + tag + _hex_bytes(prints.attrs): _STORED,
    }


def query_fields(cache_key: str, key_components: Mapping[str, Any], partition: str) -> tuple[str, list[bytes]]:
    """(kernel name, the fields to read) for a miss on `cache_key` in `partition`, in the order `facts` takes."""
    prints = variant_fingerprints(key_components)
    tag = partition_tag(partition)
    return prints.kernel_name, [
        b"h" + _key_prefix(cache_key),
        b"a" + tag + _hex_bytes(prints.attrs),
        b"s" + tag + _hex_bytes(prints.shapes),
        b"k" + tag,
    ]


def facts(values: Sequence[str | bytes | None], partition: str) -> VariantFacts:
    """The facts a miss's fields (as `query_fields` listed them for `partition`) hold. A key last stored in
    another scope of this toolchain (cachestore.keys.partition) is neither evicted from here nor another
    toolchain's: for this partition it was never stored. A value of another shape (a hand's, another tool's)
    names no partition of ours: another toolchain's."""
    last_holder, same_attrs, same_shapes, kernel = (_bytes(value) for value in values)
    tag = partition_tag(partition)
    other = last_holder is not None and _toolchain_part(last_holder) != _toolchain_part(tag)
    return VariantFacts(
        stored_here_before=last_holder == tag,
        stored_by_other_toolchain=other,
        same_attrs_stored=same_attrs is not None,
        same_shapes_stored=same_shapes is not None,
        kernel_stored=kernel is not None,
    )


def partition_tag(partition: str) -> bytes:
    """A partition as the index names it: its toolchain id's length and bytes, then its scope's name."""
    toolchain, scope = split_partition(partition)
    raw = _hex_bytes(toolchain) if _is_hex(toolchain) else toolchain.encode()
    if len(raw) > 255:  # no real id is this long: a digest of it still tells it from the others
        raw = hashlib.sha256(raw).digest()
    return bytes((len(raw),)) + raw + scope.encode()


def _toolchain_part(tag: bytes) -> bytes:
    return tag[: 1 + tag[0]] if tag else b""


def _key_prefix(cache_key: str) -> bytes:
    prefix = cache_key[: 2 * KEY_PREFIX_BYTES]
    return _hex_bytes(prefix) if _is_hex(prefix) else prefix.encode()


def _hex_bytes(text: str) -> bytes:
    return bytes.fromhex(text) if _is_hex(text) else text.encode()


def _is_hex(text: str) -> bool:
    return len(text) % 2 == 0 and all(c in "0123456789abcdef" for c in text)


def _bytes(value: str | bytes | None) -> bytes | None:
    return value.encode(errors="surrogateescape") if isinstance(value, str) else value
