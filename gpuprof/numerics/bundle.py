"""Replay bundles: everything needed to re-run one step, in a file that cannot carry code.

A bundle is a `torch.save`d dict of tensors, numbers, strings, lists and dicts only, and is
read back with `torch.load(weights_only=True)`, which refuses anything else (a pickled
function or class in a bundle from someone else is an error, not code that runs).

Layout (format "gpuprof-numerics-bundle", version 1):
    step, rank, blame (dict), model_state (state_dict), optimizer (class name + state_dict + parameter
    names; a list of them for several optimizers),
    scaler (state_dict or None), rng, hyper, non_tensor, training, autocast,
    micro_batches (list of batches, or of recorded micro-batches, see numerics.tape), loss
    ("default": model(...).loss, "custom": the caller's loss_fn, "program": the recorded loss
    calls, or "unavailable: why"), builder (how to rebuild the model from the command line,
    e.g. {"name": "gpt2", "config": {...}} or {"name": "transformers", "class": ...}, or None).
"""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from gpuprof.errors import GpuprofError
from gpuprof.numerics.blame import Blame
from gpuprof.validation import misfit

FORMAT = "gpuprof-numerics-bundle"
FORMAT_VERSION = 1
# torch.save writes a zip archive of one folder holding the pickle (and its tensors): every bundle is one.
TORCH_SAVE_PICKLE = "/data.pkl"
SNIFFED_BYTES = 1 << 20  # enough to tell a JSON document or text from a binary file


class BundleError(GpuprofError):
    """A file that is not a readable, safe gpuprof replay bundle."""


def bundle_path(run_dir: str | os.PathLike, step: int, rank: int) -> Path:
    from gpuprof.run.schema import NUMERICS_DIR

    return Path(run_dir) / NUMERICS_DIR / f"step-{step}-rank-{rank}.pt"


def builder_for(model) -> dict[str, Any] | None:
    """How `gpuprof replay` rebuilds a Hugging Face model: its class name in `transformers` and its config."""
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict") or not type(model).__module__.startswith("transformers."):
        return None
    return {"name": "transformers", "config": {
        "class": type(model).__name__, "model_config": to_plain(config.to_dict()),
        "attn_implementation": getattr(config, "_attn_implementation", None)}}


def to_plain(value: Any) -> Any:
    """Config values a weights-only load accepts: numbers, strings, lists and dicts (dtypes become names)."""
    if isinstance(value, Mapping):
        return {str(key): to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def to_host(value: Any) -> Any:
    """`value` with tensors copied to the CPU and containers made plain (dict, list, tuple)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, Mapping):
        return {key: to_host(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(to_host(item) for item in value)
    if isinstance(value, list):
        return [to_host(item) for item in value]
    return value


def save(path: Path, contents: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, **contents}, tmp)
    os.replace(tmp, path)
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    """The bundle's contents; BundleError (one line) for anything else."""
    path = Path(path)
    problem = not_a_bundle(path)
    if problem is not None:
        raise BundleError(problem)
    try:
        contents = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "unsafe content"
        raise BundleError(f"{path} is not a safe replay bundle (refused to load: {reason})") from None
    except Exception as error:  # noqa: BLE001 - any other failure means the same to the user
        raise BundleError(f"{path} is not a replay bundle ({type(error).__name__}: {error})") from None
    _check(path, contents)
    return _with_defaults(_with_defaults(contents, Bundle), Inputs, "inputs")


def not_a_bundle(path: Path) -> str | None:
    """Why `path` cannot be a replay bundle, in one line, seen before torch reads it (torch's own errors speak of
    its internals: "pop from empty list"); None where it may be one."""
    if path.is_dir():
        bundles = sorted(path.glob("numerics/*.pt")) or sorted(path.glob("*.pt"))
        return f"{path} is a folder, not a replay bundle" + (f"; the bundles in it: {', '.join(map(str, bundles[:3]))}"
                                                              + (" ..." if len(bundles) > 3 else "") if bundles else "")
    if not path.is_file():
        return f"{path} does not exist"
    if path.stat().st_size == 0:
        return f"{path} is empty, not a replay bundle"
    if _torch_saved(path):
        return None
    return (f"{path} is not a replay bundle but {_what_it_holds(path)}: a bundle is the file gpuprof saved with "
            "torch.save when a step went non-finite (RUN/numerics/step-N-rank-R.pt)")


def _torch_saved(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith(TORCH_SAVE_PICKLE) for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _what_it_holds(path: Path) -> str:
    if zipfile.is_zipfile(path):
        return "a zip archive of other files"
    with open(path, "rb") as handle:
        head = handle.read(SNIFFED_BYTES)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return "a binary file of another kind"
    try:
        json.loads(text)
        return "a JSON document"
    except ValueError:
        return "a text file"


def _check(path: Path, contents: Any) -> None:
    if not isinstance(contents, dict) or contents.get("format") != FORMAT:
        raise BundleError(f"{path} is not a gpuprof replay bundle")
    version = contents.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise BundleError(f"{path} is not a replay bundle (format_version is {version!r})")
    if version > FORMAT_VERSION:
        raise BundleError(f"{path} was written by a newer gpuprof (bundle version {version})")
    problem = misfit(contents, RecordedLossBundle if contents.get("loss") == "program" else Bundle)
    if problem is not None:
        raise BundleError(f"{path} is not a replay bundle gpuprof can run ({problem})")


def _with_defaults(contents: dict[str, Any], shape: type, at: str | None = None) -> dict[str, Any]:
    """The fields `shape` lets a bundle leave out, at their defaults (in `contents[at]` when given)."""
    target = contents[at] if at is not None else contents
    for field in msgspec.structs.fields(shape):
        if field.default is not msgspec.NODEFAULT:
            target.setdefault(field.encode_name, field.default)
    return contents


class _Shape(msgspec.Struct, forbid_unknown_fields=False):
    pass


class ParamGroup(_Shape):
    params: list[int]
    lr: Any  # a number, or a one-element tensor (a compiled optimizer's): msgspec unions take no tensor


class OptimizerState(_Shape):
    state: dict[int, dict[str, Any]]
    param_groups: list[ParamGroup]


class OptimizerEntry(_Shape, rename={"class_name": "class"}):
    class_name: str
    state_dict: OptimizerState
    params: list[str]


class Inputs(_Shape):
    training: bool
    autocast: dict[str, str] | None = None


class Builder(_Shape):
    name: str | None = None
    config: dict[str, Any] | None = None


class Bundle(_Shape):
    """What `gpuprof replay` reads from a bundle (the layout above), checked once at load."""

    step: int
    rank: int
    model_state: dict[str, torch.Tensor]
    optimizer: OptimizerEntry | list[OptimizerEntry] | None
    rng: dict[str, Any]
    micro_batches: list[Any]
    inputs: Inputs
    blame: Blame
    scaler: dict[str, Any] | None = None
    loss: str = "default"
    builder: Builder | None = None
    device_type: str | None = None


class RecordedMicroBatch(_Shape):
    """A micro-batch of a recorded loss (gpuprof.numerics.tape's encode_micro_batch): the model's calls and
    the loss's, the constants they read, and what backward() ran on."""

    items: list[dict[str, Any]]
    consts: list[Any]
    target: Any


class RecordedLossBundle(Bundle):
    """A bundle whose loss is the recorded program ("program"): its micro-batches are recorded ones."""

    micro_batches: list[RecordedMicroBatch]
