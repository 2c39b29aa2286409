"""Checkpoints that let a run continue exactly where it stopped.

Replicated models (one process, DDP): one file per save, `CHECKPOINT_DIR/step-000100.pt`,
holding the model and optimizer states plus the trainer state: the next step, the GradScaler,
the data position, and every rank's RNG states (torch, CUDA, numpy, Python). Only tensors and
plain containers go in, so the file loads with `torch.load(weights_only=True)`.

Sharded models (FSDP2): one folder per save, `CHECKPOINT_DIR/step-000100/`, written by
torch.distributed.checkpoint (each rank its own shards of the model and optimizer, so no rank
ever holds the whole state) plus `trainer.pt`, the same trainer state, written by rank 0.
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


TRAINER_FILE = "trainer.pt"


def trainer_state(*, step: int, scaler, data_position: dict, rng_states: list[dict], config: dict) -> dict:
    """Everything but the model and optimizer: `step` is the next step to run."""
    return {"step": step, "scaler": scaler.state_dict(), "data": data_position, "rng": rng_states, "config": config}


def save(directory: str | Path, trainer: dict, *, model, optimizer) -> Path:
    """Write one file holding the whole state; returns it."""
    path = _step_path(directory, trainer["step"]).with_suffix(".pt")
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save({**trainer, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, path)
    return path


def save_sharded(directory: str | Path, trainer: dict, *, model, optimizer, is_main: bool) -> Path:
    """Every rank calls this (it is collective): each writes its shards; rank 0 the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = _step_path(directory, trainer["step"])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    if is_main:
        torch.save(trainer, path / TRAINER_FILE)
    return path


def load_sharded(path: str | Path, *, model, optimizer) -> dict:
    """Loads this rank's shards into `model` and `optimizer` in place; returns the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = resolve(path, sharded=True)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except Exception as error:  # a checkpoint of another model or size is the user's input
        raise GpuprofError(f"cannot load sharded checkpoint {path} into this model: {error}".splitlines()[0]) from error
    return torch.load(path / TRAINER_FILE, weights_only=True)


def _step_path(directory: str | Path, step: int) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"step-{step:06d}"


def resolve(path: str | Path, sharded: bool = False) -> Path:
    """A checkpoint (a file, or for `sharded` a step folder), or the latest one in a checkpoint folder."""
    path = Path(path)
    if sharded and (path / TRAINER_FILE).is_file():
        return path
    if path.is_dir():
        pattern = "step-*/" + TRAINER_FILE if sharded else "step-*.pt"
        saved = sorted(path.glob(pattern))
        if not saved:
            raise GpuprofError(f"no {'sharded ' if sharded else ''}checkpoint ({pattern}) in {path}")
        return saved[-1].parent if sharded else saved[-1]
    if not path.is_file():
        raise GpuprofError(f"checkpoint {path} does not exist")
    if sharded:
        raise GpuprofError(f"{path} is a single-file checkpoint; --parallel fsdp resumes from a step-* folder")
    return path


def load(path: str | Path, device: torch.device) -> dict:
    path = resolve(path)
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # any unreadable file is the user's input, not our bug
        raise GpuprofError(f"cannot read checkpoint {path}: {error}".splitlines()[0]) from error


def restore(state: dict, *, model, optimizer) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        raise GpuprofError(
            "checkpoint does not fit this model (was it saved with another --model or --vocab-size?)"
        ) from error
    optimizer.load_state_dict(state["optimizer"])
