"""Numbers and labels for people, shared by the dashboard pages and `gpuprof report` (no Streamlit here)."""

from __future__ import annotations

import math

from gpuprof.dashboard.charts import GIB


def known(value) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def fmt(value, pattern: str = "{:,.3g}", missing: str = "—") -> str:
    return pattern.format(value) if known(value) else missing


def fmt_gib(value_bytes) -> str:
    return fmt(value_bytes / GIB if known(value_bytes) else None, "{:.2f} GiB")


def fmt_pct(fraction) -> str:
    return fmt(fraction * 100 if known(fraction) else None, "{:.1f} %")


def fmt_ms(value_s) -> str:
    return fmt(value_s * 1e3 if known(value_s) else None, "{:,.1f} ms")


def device_label(meta: dict) -> str:
    """E.g. "cpu", "cuda: NVIDIA H100 80GB HBM3", "2 × cuda: ..."."""
    devices = meta.get("devices") or []
    if not devices:
        return "unknown"
    first = devices[0]
    label = first.get("kind") or "unknown"
    if first.get("kind") == "cuda" and first.get("name"):
        label = f"cuda: {first['name']}"
    count = max(len(devices), int(meta.get("world_size") or 1))
    return f"{count} × {label}" if count > 1 else label
