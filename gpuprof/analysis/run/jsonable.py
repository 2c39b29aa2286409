"""Plain-JSON conversion: the one used by every `to_dict` and every `--json` document (analyze, compare, trace)."""

from __future__ import annotations

import math


def json_safe(value):
    """Plain JSON types: numpy scalars become Python numbers, NaN/inf become None."""
    if hasattr(value, "item") and not isinstance(value, (list, dict, str)):
        value = value.item()
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value
