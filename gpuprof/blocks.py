"""A model's numbered blocks (transformer.h.3, ...) from its parameter names, and their norms.

Free of torch: the diagnoses read per-block gradient norms from run files with it, and capture
and numerics compute them with it.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

_BLOCK = re.compile(r"^(.*?\.\d+)\.")  # "transformer.h.3.attn.c_attn.weight" -> "transformer.h.3"


def block_groups(names: list[str]) -> dict[str, list[int]]:
    """Parameter indices per numbered block (e.g. transformer.h.3); parameters outside blocks are left out."""
    groups: dict[str, list[int]] = defaultdict(list)
    for index, name in enumerate(names):
        match = _BLOCK.match(name)
        if match:
            groups[match.group(1)].append(index)
    return dict(groups)


def combined_norm(norms: list[float], indices: list[int]) -> float:
    """The 2-norm of the tensors at `indices`, from their own 2-norms."""
    return math.sqrt(sum(norms[i] ** 2 for i in indices))
