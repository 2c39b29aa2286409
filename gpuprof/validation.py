"""What a file read back must hold, checked once where it is read: a typed shape (msgspec) and one line for
people saying which field does not fit. The run reader (meta files) and the replay bundle loader use it."""

from __future__ import annotations

from typing import Any

import msgspec


def misfit(value: Any, shape: Any) -> str | None:
    """What in `value` does not fit `shape` (a msgspec type, checked strictly: "2" is no number), as
    "world_size: expected int, got str"; None when everything fits."""
    try:
        msgspec.convert(value, shape, strict=True)
    except msgspec.ValidationError as error:
        return _readable(str(error))
    return None


def _readable(text: str) -> str:
    what, _, where = text.partition(" - at ")
    where = where.strip("`").removeprefix("$").lstrip(".")
    if what.startswith("Object missing required field"):
        field = what.removeprefix("Object missing required field").strip(" `")
        return f"missing {where + '.' if where else ''}{field}"
    what = f"{what[0].lower()}{what[1:]}".replace("`", "").replace(" | null", "")
    return f"{where}: {what}" if where else what
