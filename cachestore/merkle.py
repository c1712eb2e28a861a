"""Merkle tree hashing as RFC 9162 (Certificate Transparency 2.0, section 2.1) defines it, for batch signatures.

A writer signs one Ed25519 signature over the root of the tree of a group of entries it stores together, and
each entry carries its audit path, so a reader that reads many entries of one group verifies one signature
(cachestore.signatures, cachestore.entry). Leaves and interior nodes are hashed with different one-byte prefixes
(0x00, 0x01): no interior node can be passed off as a leaf, or a leaf as an interior node (the second-preimage
attack on plain Merkle trees). The tree over n leaves splits at the largest power of two below n, so every
(leaf index, tree size) pair has exactly one path, of at most ceil(log2 n) hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

HASH_BYTES = 32
_LEAF, _NODE = b"\x00", b"\x01"


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(_LEAF + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_NODE + left + right).digest()


def _split(size: int) -> int:
    """The largest power of two below `size` (size >= 2): where RFC 9162 splits a tree."""
    return 1 << ((size - 1).bit_length() - 1)


def tree_root(leaves: Sequence[bytes]) -> bytes:
    """MTH of the leaf hashes `leaves` (at least one)."""
    if len(leaves) == 1:
        return leaves[0]
    k = _split(len(leaves))
    return node_hash(tree_root(leaves[:k]), tree_root(leaves[k:]))


def inclusion_paths(leaves: Sequence[bytes]) -> list[list[bytes]]:
    """The audit path (RFC 9162 2.1.3.1, nearest sibling first) of every leaf of the tree over `leaves`."""
    if len(leaves) == 1:
        return [[]]
    k = _split(len(leaves))
    left, right = leaves[:k], leaves[k:]
    left_root, right_root = tree_root(left), tree_root(right)
    return [[*path, right_root] for path in inclusion_paths(left)] + [
        [*path, left_root] for path in inclusion_paths(right)
    ]


def path_length(index: int, size: int) -> int:
    """How many hashes the audit path of leaf `index` (< size) in a tree of `size` leaves holds."""
    length = 0
    while size > 1:
        k = _split(size)
        index, size = (index, k) if index < k else (index - k, size - k)
        length += 1
    return length


def climb(leaf: bytes, index: int, size: int, path: Sequence[bytes]) -> Iterator[bytes]:
    """The nodes from `leaf` (a leaf hash) at `index` of a tree of `size` leaves up to the root, by RFC 9162
    2.1.3.2: the leaf first, then each parent `path` gives, the root last. Raises PathMismatch, once the nodes
    are given, when `path` cannot be one of that tree (an index out of range, too many or too few hashes). A
    caller may stop early, at a node it already knows to be under a signed root."""
    if not 0 <= index < size:
        raise PathMismatch(f"leaf {index} of a tree of {size}")
    fn, sn, node = index, size - 1, leaf
    yield node
    for sibling in path:
        if sn == 0:
            raise PathMismatch("more hashes than the tree is high")
        if fn & 1 or fn == sn:
            node = node_hash(sibling, node)
            if not fn & 1:
                while not (fn & 1 or fn == 0):
                    fn, sn = fn >> 1, sn >> 1
        else:
            node = node_hash(node, sibling)
        fn, sn = fn >> 1, sn >> 1
        yield node
    if sn != 0:
        raise PathMismatch("fewer hashes than the tree is high")


class PathMismatch(ValueError):
    """An audit path that cannot belong to the tree its index and size describe."""


def root_from_path(leaf: bytes, index: int, size: int, path: Sequence[bytes]) -> bytes | None:
    """The root that `path` proves `leaf` at `index` of a tree of `size` leaves under; None when the path cannot
    be one of that tree. The caller compares the root with a signed one: a path from another tree gives
    another root."""
    try:
        return list(climb(leaf, index, size, path))[-1]
    except PathMismatch:
        return None
