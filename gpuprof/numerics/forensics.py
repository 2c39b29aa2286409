"""Re-run one training step in forensic mode and blame the first non-finite value.

`reenact` works on a model/optimizer/scaler it may change (a private copy made by
`private_copy` during training, or the objects `gpuprof replay` built from a bundle), so the
user's own objects, hooks and RNG streams are never touched.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Callable

import torch

from gpuprof.modules import eager_model
from gpuprof.numerics.blame import Blame
from gpuprof.torch_compat import tree_flatten
from gpuprof.numerics.state import (
    OPTIMIZER_KEY_SEPARATOR, StepInputs, live_tensors, owning_module, set_rng_states,
)
from gpuprof.numerics.tape import FORWARD_ARGS, FORWARD_KWARGS, MicroBatch, autocast_as, replay_loss
from gpuprof.numerics.watch import ModuleTracker, NodeOwners, OpWatch
from gpuprof.optimizers import members

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The Hugging Face convention: `model(**batch).loss` (or the output itself if it is the loss)."""
    if isinstance(batch, Mapping) and FORWARD_ARGS in batch:
        output = model(*batch[FORWARD_ARGS], **batch[FORWARD_KWARGS])
    elif isinstance(batch, Mapping):
        output = model(**batch)
    else:
        output = model(batch)
    loss = output.loss if hasattr(output, "loss") else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError("the model's output holds no loss to re-run (pass loss_fn= to profile())")
    return loss


def private_copy(model, optimizer, scaler):
    """Deep copies sharing nothing with the user's objects, without their hooks or gradients."""
    model, optimizer, scaler = copy.deepcopy((eager_model(model), optimizer, scaler))
    for module in model.modules():
        module._compiled_call_impl = None  # module.compile() in place: the copy runs eager
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            getattr(module, hooks).clear()
    for param in model.parameters():
        param.grad = None
        for hooks in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            if getattr(param, hooks, None):
                setattr(param, hooks, None)
    for member in members(optimizer):
        member._optimizer_step_pre_hooks.clear()
        member._optimizer_step_post_hooks.clear()
    return model, optimizer, scaler


def load_state(model, optimizer, scaler, state: Mapping[str, torch.Tensor], inputs: StepInputs) -> None:
    """Puts the kept pre-step state into (copies of) the training objects."""
    saved = {**state, **inputs.other_device}
    live = live_tensors(model, optimizer, scaler)
    with torch.no_grad():
        for name, tensor in live.items():
            if name in saved:
                tensor.copy_(saved[name])
            elif OPTIMIZER_KEY_SEPARATOR in name and optimizer is not None:
                _drop_optimizer_entry(model, optimizer, name)  # created after the kept step began
    if optimizer is not None:
        by_name = {name: p for name, p in model.named_parameters()}
        for name, value in inputs.non_tensor.items():
            param_name, key = name.split(OPTIMIZER_KEY_SEPARATOR)
            optimizer.state[by_name[param_name]][key] = copy.deepcopy(value)
        for group, hyper in zip(optimizer.param_groups, inputs.hyper):
            group.update(copy.deepcopy(hyper))


def _drop_optimizer_entry(model, optimizer, name: str) -> None:
    param_name, key = name.split(OPTIMIZER_KEY_SEPARATOR)
    param = dict(model.named_parameters())[param_name]
    optimizer.state[param].pop(key, None)
    if not optimizer.state[param]:
        del optimizer.state[param]


def reenact(model, optimizer, scaler, loss_fn: LossFn, micro_batches: list, inputs: StepInputs,
            *, rank: int = 0) -> Blame:
    """Runs the step again under forensic instrumentation; the objects given are changed."""
    blame = Blame(step=inputs.step, rank=rank)
    found = _nonfinite_state(model, optimizer, scaler) or _nonfinite_batch(micro_batches)
    if found:
        _fill(blame, found)
        return blame
    tracker = ModuleTracker(model)
    owners = NodeOwners(tracker)
    watch = OpWatch(tracker, owners, _namer(model, optimizer, scaler))
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            set_rng_states(inputs.rng)
            model.train(inputs.training)
            _run(model, optimizer, scaler, loss_fn, micro_batches, inputs, watch, owners)
    finally:
        tracker.close()
    if watch.found:
        _fill(blame, watch.found)
    return blame


def _run(model, optimizer, scaler, loss_fn, micro_batches, inputs, watch: OpWatch, owners: NodeOwners) -> None:
    for index, batch in enumerate(micro_batches):
        watch.micro_batch, watch.phase = index, "forward"
        with watch, owners, autocast_as(inputs.autocast):
            loss = replay_loss(model, batch, watch.note_call) if isinstance(batch, MicroBatch) \
                else loss_fn(model, batch)
        watch.end_forward()
        watch.phase = "backward"
        with watch:
            (scaler.scale(loss) if scaler is not None else loss).backward()
    if watch.found is None and optimizer is not None:
        watch.phase = "optimizer"
        with watch:
            for member in members(optimizer):
                if scaler is not None:
                    scaler.step(member)
                else:
                    member.step()


def _namer(model, optimizer, scaler) -> Callable[[torch.Tensor], str | None]:
    """tensor -> state name, by memory (the dispatcher may hand an op another wrapper of a parameter)."""
    names: dict[tuple, str] = {}

    def key(tensor: torch.Tensor) -> tuple:
        return tensor.data_ptr(), tuple(tensor.shape), tensor.dtype

    def name_of(tensor: torch.Tensor) -> str | None:
        if key(tensor) not in names:  # optimizer state may have been created since the last look
            names.update({key(t): n for n, t in live_tensors(model, optimizer, scaler).items()})
        return names.get(key(tensor))

    return name_of


def _nonfinite_state(model, optimizer, scaler) -> dict[str, Any] | None:
    for name, tensor in live_tensors(model, optimizer, scaler).items():
        found = _describe(tensor)
        if found:
            return {**found, "phase": "state", "tensor": name, "module": owning_module(name)}
    return None


def _nonfinite_batch(micro_batches: list) -> dict[str, Any] | None:
    for index, batch in enumerate(micro_batches):
        for tensor in tree_flatten(batch)[0]:
            found = _describe(tensor) if isinstance(tensor, torch.Tensor) else None
            if found:
                return {**found, "phase": "state", "tensor": "batch", "module": None, "micro_batch": index}
    return None


def _describe(tensor: torch.Tensor) -> dict[str, Any] | None:
    if not tensor.is_floating_point() or not tensor.numel():
        return None
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return None
    return {"first": "inf" if bool(torch.isinf(tensor).any()) else "nan",
            "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "nonfinite_count": int((~finite).sum())}


def _fill(blame: Blame, found: dict[str, Any]) -> None:
    for key, value in found.items():
        setattr(blame, key, value)
