"""Seeing through the wrappers a training loop puts around its model (a neutral home: capture and numerics both need it)."""

from __future__ import annotations

import torch


def eager_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under torch.compile and DistributedDataParallel wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
