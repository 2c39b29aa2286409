"""Checkpoints that let a run continue exactly where it stopped.

One file per save, `CHECKPOINT_DIR/step-000100.pt`, holding the model, optimizer and
GradScaler states, the next step, the data position, and every rank's RNG states
(torch, CUDA, numpy, Python). Only tensors and plain containers go in, so the file
loads with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from gpuprof.errors import GpuprofError


def rng_state() -> dict:
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached],
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def save(directory: str | Path, *, step: int, model, optimizer, scaler, data_position: dict,
         rng_states: list[dict], config: dict) -> Path:
    """Write the state before `step` (the next step to run); returns the file written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step-{step:06d}.pt"
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "data": data_position,
        "rng": rng_states,
        "config": config,
    }
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def resolve(path: str | Path) -> Path:
    """A checkpoint file, or the latest one in a checkpoint folder."""
    path = Path(path)
    if path.is_dir():
        saved = sorted(path.glob("step-*.pt"))
        if not saved:
            raise GpuprofError(f"no checkpoint (step-*.pt) in {path}")
        return saved[-1]
    if not path.is_file():
        raise GpuprofError(f"checkpoint {path} does not exist")
    return path


def load(path: str | Path, device: torch.device) -> dict:
    path = resolve(path)
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # any unreadable file is the user's input, not our bug
        raise GpuprofError(f"cannot read checkpoint {path}: {error}".splitlines()[0]) from error


def restore(state: dict, *, model, optimizer, scaler) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise GpuprofError(
            f"checkpoint does not fit this model (was it saved with another --model or --vocab-size?)"
        ) from error
    optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
