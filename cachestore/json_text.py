"""JSON text for every --json output and the JSON report: valid JSON or a clear error, never NaN or Infinity.

A module of its own so that a command printing JSON does not load the report's renderers."""

from __future__ import annotations

import json
import math
from typing import Any

from bridge.errors import NkiCacheError


def json_text(value: Any, *, indent: int | None = None) -> str:
    """`value` as JSON text: every --json output of nkicache goes through here. JSON has no NaN or infinity
    (json.dumps writes them all the same, and strict parsers refuse the document), so numbers are made
    finite where they are produced, and one that still is not is an error naming where it is."""
    try:
        return json.dumps(value, indent=indent, allow_nan=False)
    except ValueError:
        where = non_finite_path(value)
        if where is None:
            raise  # not a number's fault (a circular reference): a bug, not bad data
        raise NkiCacheError(f"cannot print JSON: {where} is not a finite number") from None


def non_finite_path(value: Any, path: str = "$") -> str | None:
    """Where in `value` the first NaN or infinity is (like $.graphs[0].tier_saved_seconds), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for key, item in items:
        found = non_finite_path(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}")
        if found is not None:
            return found
    return None
