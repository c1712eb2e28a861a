"""The key rule, written once: a cache key is the SHA-256 of its components' canonical text, `str()` of their
sorted (name, value) items, so the order the components were gathered in never changes the key. The loop's
cache keys (`BirCodeGenLoop._compute_cache_key_from_components`) and the miss causes' variant fingerprints
(bridge.miss_causes) both hash through here: a second copy of the rule could drift from the first."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any


def canonical_text(components: Mapping[str, Any]) -> bytes:
    """The bytes the key rule hashes."""
    return str(sorted(components.items())).encode()


def key_digest(components: Mapping[str, Any]) -> str:
    """The SHA-256 (hex) of the components' canonical text."""
    return hashlib.sha256(canonical_text(components)).hexdigest()
