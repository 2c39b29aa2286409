"""The optimizer gpuprof watches: the one the loop steps, or several stepping one model as one.

Loops now often step two optimizers each iteration, e.g. `torch.optim.Muon` for the weight
matrices and AdamW for the embeddings, biases and norms. Given `optimizer=[muon, adamw]`, the
Profiler sees them as one `OptimizerChain`: every part of gpuprof that reads an optimizer (phases,
gradient norms, the learning rate, NaN forensics and its bundle) then covers every parameter and
every state tensor. The chain presents only what gpuprof reads of a torch optimizer, each member
keeping its own hooks, state and settings:
- `param_groups`: the members' groups, in order (the same dicts);
- `state`: one mapping over the members' states;
- step hooks, registered on every member: a hook runs at each member's step, with that member.
The forensic re-run and the bundle's replay step the members in order (`members()`).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch

from gpuprof.modules import named_parameters


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a wrapper such as Accelerate's, whose own step() runs no hooks."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def one_optimizer(optimizer: Any) -> Any:
    """What gpuprof watches for `optimizer=`: one optimizer, a chain of several, or None."""
    if not isinstance(optimizer, Sequence) or isinstance(optimizer, str):
        return inner_optimizer(optimizer)
    members = [inner_optimizer(member) for member in optimizer if member is not None]
    if len(members) > 1:
        return OptimizerChain(members)
    return members[0] if members else None


def members(optimizer: Any) -> tuple:
    """The torch optimizers behind what gpuprof watches."""
    if optimizer is None:
        return ()
    return optimizer.members if isinstance(optimizer, OptimizerChain) else (optimizer,)


def params_of(optimizer: Any) -> list[torch.Tensor]:
    """The parameters every optimizer behind `optimizer` updates, in order."""
    return [param for member in members(optimizer) for group in member.param_groups for param in group["params"]]


def params_without_optimizer(model: torch.nn.Module, optimizer: Any) -> list[str]:
    """The names of the model's trainable parameters that none of the optimizers given updates."""
    held = {id(param) for param in params_of(optimizer)}
    return [name for name, param in named_parameters(model) if param.requires_grad and id(param) not in held]


def has_step_hooks(optimizer: Any) -> bool:
    return all(callable(getattr(member, name, None)) for member in members(optimizer)
               for name in ("register_step_pre_hook", "register_step_post_hook"))


class OptimizerChain:
    """Several optimizers over disjoint parameters of one model, stepped once each per iteration."""

    def __init__(self, optimizers: Sequence[Any]):
        self.members = tuple(optimizers)
        self.state = _ChainState(self.members)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for member in self.members for group in member.param_groups]

    @property
    def name(self) -> str:
        return "+".join(type(member).__name__ for member in self.members)

    def register_step_pre_hook(self, hook) -> "_Handles":
        return _Handles([member.register_step_pre_hook(hook) for member in self.members])

    def register_step_post_hook(self, hook) -> "_Handles":
        return _Handles([member.register_step_post_hook(hook) for member in self.members])


class _Handles:
    def __init__(self, handles: list):
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _ChainState(MutableMapping):
    """parameter -> its state, in the state of the member whose groups hold the parameter."""

    def __init__(self, optimizers: tuple):
        self._optimizers = optimizers

    def _owner(self, param: torch.Tensor) -> MutableMapping:
        for optimizer in self._optimizers:
            if param in optimizer.state:
                return optimizer.state
        for optimizer in self._optimizers:
            if any(param is held for held in params_of(optimizer)):
                return optimizer.state
        raise KeyError(param)

    def __getitem__(self, param: torch.Tensor) -> Any:
        return self._owner(param)[param]  # a member's defaultdict makes an entry as torch's would

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        self._owner(param)[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._owner(param)[param]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for optimizer in self._optimizers:
            yield from optimizer.state

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self._optimizers)

    def items(self):  # read every step by NaN forensics: the members' own items, no lookup per key
        return [item for optimizer in self._optimizers for item in optimizer.state.items()]

    def values(self):
        return [value for optimizer in self._optimizers for value in optimizer.state.values()]
