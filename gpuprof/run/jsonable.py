"""Plain JSON: the one conversion of numpy, torch and pandas values to JSON types.

Run files keep every value as it was (`encodable`, the writer's `json.dumps` default: NaN and
inf stay, docs/run-format.md); every `to_dict` and `--json` document (analyze, compare, trace,
tune) and every aggregate row handed to the rules is `json_safe`: None for what is unknown.
"""

from __future__ import annotations

import math

import pandas as pd


def plain(value):
    """numpy / torch scalars as Python numbers, arrays, tuples and sets as lists; anything else as it is."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, tuple)):
        return list(value)
    return value


def encodable(value):
    """`json.dumps`'s default: a value JSON has no type for, as plain types, or else as its text."""
    converted = plain(value)
    return str(value) if converted is value else converted


def json_safe(value, digits: int | None = 6):
    """Plain JSON types, recursively: NaN, inf and pandas' missing values as None, floats rounded to `digits` decimals (None: kept whole)."""
    value = plain(value)
    if isinstance(value, float):
        return None if not math.isfinite(value) else value if digits is None else round(value, digits)
    if isinstance(value, dict):
        return {str(key): json_safe(item, digits) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item, digits) for item in value]
    return None if pd.api.types.is_scalar(value) and pd.isna(value) else value
