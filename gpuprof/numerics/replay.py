"""Re-run the step in a replay bundle on this machine: `replay(path)` -> the same Blame.

The model is rebuilt either by a builder (the name in the bundle selects one of `BUILDERS`, or of the
`builders` the caller adds, as `gpuprof replay` adds the reference workload's; nothing in a bundle is
imported or called) or from the `model` and `loss_fn` the caller passes, for models gpuprof cannot build.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from gpuprof.numerics import bundle, construction
from gpuprof.numerics.blame import EVALUATION_TRIGGER, Blame, at_the_update
from gpuprof.numerics.bundle import BundleError
from gpuprof.numerics.evaluation import evaluation_loss
from gpuprof.numerics.forensics import LossFn, default_loss, reenact
from gpuprof.numerics.state import StepInputs
from gpuprof.numerics.tape import TapeError, decode_micro_batch
from gpuprof.optimizers import one_optimizer

SAME_BLAME_FIELDS = ("step", "phase", "module", "op", "first")


# builder(config) -> (the model, its loss function or None)
Builder = Callable[[dict[str, Any]], tuple[torch.nn.Module, LossFn | None]]


def replay(path: str | os.PathLike, *, model: torch.nn.Module | None = None, loss_fn: LossFn | None = None,
           device: str | None = None, builders: dict[str, Builder] | None = None) -> tuple[Blame, Blame]:
    """(the blame of this re-run, the blame recorded when the bundle was written)."""
    contents = bundle.load(path)
    device = torch.device(device or ("cuda" if contents.get("device_type") == "cuda"
                                     and torch.cuda.is_available() else "cpu"))
    model, loss_fn = _model_and_loss(path, contents, model, loss_fn, {**BUILDERS, **(builders or {})})
    try:
        model.load_state_dict(contents["model_state"])
    except RuntimeError as error:
        raise BundleError(f"the bundle's weights do not fit the model: {str(error).splitlines()[0]}") from None
    model.to(device)
    optimizer = _optimizer(contents["optimizer"], model)
    scaler = _scaler(contents["scaler"], device)
    inputs = StepInputs(step=contents["step"], rng=contents["rng"], hyper=[], other_device={}, non_tensor={},
                        training=contents["inputs"]["training"], autocast=contents["inputs"]["autocast"])
    micro_batches = _micro_batches(contents, device)
    try:
        blame = reenact(model, optimizer, scaler, loss_fn, micro_batches, inputs, rank=contents["rank"])
    except Exception as error:  # noqa: BLE001 - a bundle this model or loss cannot run is bad input
        raise BundleError(f"re-running the bundle's step failed: {error!r}") from None
    recorded = Blame.from_details(contents["blame"])
    blame.trigger, blame.cause, blame.bundle = recorded.trigger, recorded.cause, os.fspath(path)
    return at_the_update(blame), recorded


def recipe_model(config: dict[str, Any]) -> tuple[torch.nn.Module, None]:
    """The model its recorded construction describes (numerics.construction), its classes imported from the
    folder replay runs in and the script's."""
    with construction.importable_from(list(config.get("paths") or [])):
        try:
            return construction.build(config.get("model"), config.get("script")), None
        except construction.NoRecipe as why:
            raise BundleError(f"this bundle's model cannot be rebuilt here: {why}") from None


def transformers_model(config: dict[str, Any]) -> tuple[torch.nn.Module, None]:
    """A Hugging Face model from its class name (looked up in `transformers` only) and config."""
    import transformers

    cls = getattr(transformers, str(config.get("class")), None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise BundleError(f"the bundle's model class {config.get('class')!r} is not a transformers model")
    model_config = cls.config_class.from_dict(dict(config.get("model_config") or {}))
    return cls._from_config(model_config, attn_implementation=config.get("attn_implementation")), None


def _micro_batches(contents: dict[str, Any], device: torch.device) -> list:
    loss = str(contents["loss"])
    if loss.startswith("unavailable"):
        raise BundleError(f"this bundle cannot replay its loss ({loss})")
    micro_batches = _to_device(contents["micro_batches"], device)
    if loss != "program":
        return micro_batches
    try:
        return [decode_micro_batch(micro, device) for micro in micro_batches]
    except TapeError as error:
        raise BundleError(f"this bundle's recorded loss cannot be replayed: {error}") from None
    except (LookupError, TypeError, ValueError, AttributeError) as error:  # a recorded call of another shape
        raise BundleError(f"this bundle's recorded loss cannot be replayed: {type(error).__name__}: {error}") from None


BUILDERS: dict[str, Builder] = {"transformers": transformers_model, construction.RECIPE: recipe_model}


def same_blame(a: Blame, b: Blame) -> bool:
    return all(getattr(a, name) == getattr(b, name) for name in SAME_BLAME_FIELDS)


def _model_and_loss(path, contents: dict[str, Any], model, loss_fn, builders: dict[str, Builder]):
    if model is not None:
        return model, loss_fn or _recorded_loss(contents)
    builder = contents.get("builder") or {}
    if builder.get("name") not in builders:
        raise BundleError("this bundle's model cannot be rebuilt from the command line"
                          + (f" ({builder['config']['reason']})" if (builder.get("config") or {}).get("reason") else "")
                          + "; replay it from Python:\n"
                          + construction.replay_snippet(os.fspath(path), builder.get("config") or {}))
    try:
        model, built_loss = builders[builder["name"]](builder.get("config") or {})
    except BundleError:
        raise
    except Exception as error:  # noqa: BLE001 - a config that builds no model is bad input
        raise BundleError(f"this bundle's {builder['name']} model config builds no model: {error!r}") from None
    if contents["loss"] == "custom" and loss_fn is None:
        if built_loss is None:
            raise BundleError("this bundle's step used a custom loss_fn, which a bundle cannot carry; replay it "
                              "from Python with gpuprof.numerics.replay.replay(path, loss_fn=...)")
        loss_fn = built_loss
    return model, loss_fn or _recorded_loss(contents)


def _recorded_loss(contents: dict[str, Any]) -> LossFn:
    """The loss a bundle replays when the caller gives none: an evaluation's output, or model(...).loss."""
    return evaluation_loss if contents["loss"] == EVALUATION_TRIGGER else default_loss


def _optimizer(saved: dict[str, Any] | list[dict[str, Any]] | None, model: torch.nn.Module):
    if saved is None:
        return None
    if isinstance(saved, list):  # several optimizers, stepped in this order
        return one_optimizer([_optimizer(entry, model) for entry in saved])
    cls = getattr(torch.optim, str(saved["class"]), None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise BundleError(f"the bundle's optimizer {saved['class']!r} is not a torch.optim optimizer")
    by_name = dict(model.named_parameters())
    names, state_dict = saved["params"], saved["state_dict"]
    try:
        groups = [{"params": [by_name[names[i]] for i in group["params"]], "lr": group["lr"]}
                  for group in state_dict["param_groups"]]
        optimizer = cls(groups)
        optimizer.load_state_dict(state_dict)
    except (IndexError, KeyError, ValueError, TypeError) as error:
        raise BundleError(f"the bundle's {saved['class']} state does not fit the model: {error!r}") from None
    return optimizer


def _scaler(saved: dict[str, Any] | None, device: torch.device):
    if not saved:
        return None
    scaler = torch.amp.GradScaler(device.type)
    try:
        scaler.load_state_dict(saved)
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise BundleError(f"the bundle's GradScaler state is not one: {error!r}") from None
    return scaler


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(item, device) for item in value)
    return value
