"""Byte counts as people read them, for every layer: the report's figures, the rules' titles and
fixes, the demo's summary line (gpuprof.report.format builds on it; nothing here imports gpuprof)."""

from __future__ import annotations

BINARY_PREFIXES = ("B", "KiB", "MiB", "GiB", "TiB")


def bytes_text(n_bytes: float) -> str:
    """3 significant digits with a binary prefix: "512 B", "1.5 KiB", "3.2 GiB"."""
    index = 0
    while abs(n_bytes) >= 1024 and index < len(BINARY_PREFIXES) - 1:
        n_bytes /= 1024
        index += 1
    return f"{n_bytes:.3g} {BINARY_PREFIXES[index]}"
