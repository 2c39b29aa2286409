"""Forensic mode: check every aten op's outputs and say who ran the first non-finite one.

Three pieces, active only during a forensic re-run:
- `ModuleTracker`: forward pre/post hooks on every submodule keep the stack of running modules.
- `NodeOwners` (a TorchFunctionMode, above autograd): after each torch call in the forward
  pass, the autograd nodes it created are tagged with the running module and source line.
  In the backward pass the engine tells which node is executing, so a backward op is
  attributed to the module whose forward created that node. (Module backward hooks would
  say the same for well-behaved modules, but break on modules with in-place inputs or
  non-tensor outputs; the node map does not.)
- `OpWatch` (a TorchDispatchMode, below autograd): sees every aten op, forward, backward and
  optimizer, checks its outputs (and the tensors it mutated) and records the first one with
  an Inf or NaN. Values made non-finite on purpose (a `-inf` attention mask passed as a
  scalar) and ops that only carry such values along are not blamed.
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gpuprof import module_hooks
from gpuprof.run.schema import INSTALLED_PACKAGES
from gpuprof.torch_compat import missing_base, private, tree_flatten

GPUPROF_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_LIBRARY_DIRS = (TORCH_DIR, *(os.path.join(GPUPROF_DIR, part) + os.sep for part in ("numerics", "capture")))


def user_frame() -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost calling frame outside torch and gpuprof's capture and numerics;
    cheap enough for the training loop (no source read)."""
    frame = outside(_LIBRARY_DIRS)
    return (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name) if frame is not None else None


def outside(library_dirs: tuple[str, ...]):
    """The innermost calling frame whose code is in none of `library_dirs` (nor `<frozen ...>`)."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(library_dirs) and not filename.startswith("<"):
            return frame
        frame = frame.f_back
    return None


def op_sources() -> tuple[str | None, str | None]:
    """Where the op being watched ran, as `format_frame` writes lines: the user's innermost line on its stack, and an
    installed library's line that ran it before that. The user's is None where gpuprof's own frame comes first (a
    re-run calling the model, all of it torch's or a library's)."""
    library = None
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_LIBRARY_DIRS):
            if not filename.startswith(TORCH_DIR) and filename != __file__:
                return None, library
        elif INSTALLED_PACKAGES.match(filename):
            library = library or _frame_line(frame)
        elif not filename.startswith("<"):
            return _frame_line(frame), library
        frame = frame.f_back
    return None, library


def _frame_line(frame) -> str | None:
    return format_frame((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))


def format_frame(where: tuple[str, int, str] | None) -> str | None:
    if where is None:
        return None
    filename, line, function = where
    return f"{filename}:{line} in {function}: {linecache.getline(filename, line).strip()}"


class ModuleTracker:
    """The stack of running (non-root) modules, by fully qualified name."""

    def __init__(self, model: torch.nn.Module):
        self.stack: list[str] = []
        self.source_hint: str | None = None  # the user's line of a recorded loss call being replayed
        self.model_call: str | None = None  # the user's line of a recorded model call being replayed
        self.entries = 0
        self.in_model = False  # inside the model's own call (the root's), where `stack` may still be empty
        self.model_entries = 0  # `entries` when the model's current call began
        self._handles = [module_hooks.register(model, "forward_pre", self._enter_model),
                         module_hooks.register(model, "forward", self._exit_model, always_call=True)]
        for name, module in model.named_modules():
            if name:
                self._handles.append(module_hooks.register(module, "forward_pre", functools.partial(self._enter, name)))
                self._handles.append(
                    module_hooks.register(module, "forward", functools.partial(self._exit, name), always_call=True))

    @property
    def in_model_before_any_module(self) -> bool:
        """Inside the model's own forward, none of its modules called yet in this call (a model that is one
        nn.Linear has none to call)."""
        return self.in_model and self.entries == self.model_entries

    def _enter_model(self, _module, _args) -> None:
        self.in_model, self.model_entries = True, self.entries

    def _exit_model(self, _module, _args, _output) -> None:
        self.in_model = False

    @property
    def current(self) -> str | None:
        return self.stack[-1] if self.stack else None

    def owner(self) -> tuple[str | None, str | None, str | None]:
        """The op running now: its module, the user's line to start at, and an installed library's line that ran
        it behind that. A re-run loss call's line is the user's; else the user's innermost line on the op's stack,
        and where there is none (a re-run model call), the line that called the model in training."""
        if self.source_hint is not None:
            return self.current, self.source_hint, None
        user, library = op_sources()
        source = user or self.model_call or library
        return self.current, source, library if library != source else None

    def _enter(self, name: str, _module, _args) -> None:
        self.stack.append(name)
        self.entries += 1

    def _exit(self, name: str, _module, _args, _output) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


class NodeOwners(TorchFunctionMode):
    """Maps every autograd node created in the forward pass to (module, source line)."""

    def __init__(self, tracker: ModuleTracker):
        super().__init__()
        self.tracker = tracker
        self.owner: dict[Any, tuple[str | None, str | None, str | None]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            owner = None
            for value in tree_flatten(out)[0]:
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    owner = owner or self.tracker.owner()
                    self._claim(value.grad_fn, owner)
        return out

    def _claim(self, node, owner) -> None:
        pending = [node]
        while pending:
            node = pending.pop()
            if node is None or node in self.owner:
                continue
            self.owner[node] = owner
            pending.extend(parent for parent, _ in node.next_functions)


UNINITIALIZED = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                 "aten::new_empty_strided", "aten::empty_permuted"}


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _nonfinite_scalar(values: list) -> bool:
    return any(isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))) for v in values)


_DISPATCH_MODE = "torch.utils._python_dispatch.TorchDispatchMode"


class OpWatch(private(_DISPATCH_MODE, missing_base(_DISPATCH_MODE))):
    """Records the first aten op whose output (or mutated input) holds an Inf or NaN."""

    def __init__(self, tracker: ModuleTracker, owners: NodeOwners, name_of=lambda tensor: None):
        super().__init__()
        self.tracker, self.owners = tracker, owners
        self.name_of = name_of  # tensor -> its state name (`w::exp_avg`), for optimizer-phase blame
        self.phase = "forward"
        self.micro_batch = 0
        self.found: dict[str, Any] | None = None
        self.entries_at_found = 0
        self.found_before_any_module = False  # in the model's own forward, before any of its modules
        self._intentional: dict[int, torch.Tensor] = {}

    def note_call(self, source: str | None, model_call: bool) -> None:
        """A recorded call is about to run again: the user's line that made it, where it was recorded."""
        self.tracker.source_hint, self.tracker.model_call = (None, source) if model_call else (source, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.found is None:
            self._check(func, args, kwargs, out)
        return out

    def _check(self, func, args, kwargs, out) -> None:
        if func._schema.name in UNINITIALIZED:
            return  # fresh memory holds whatever was there, NaN bit patterns included, until written
        inputs = tree_flatten((args, kwargs))[0]
        written = _mutated(func, args, kwargs)
        candidates = [t for t in [*tree_flatten(out)[0], *written] if _floating(t) and t.numel()]
        bad = [t for t in candidates if not bool(torch.isfinite(t).all())]
        if not bad:
            return
        if self._on_purpose(inputs, bad):
            self._intentional.update({id(t): t for t in bad})
            return
        self._record(func, inputs, bad[0])

    def _on_purpose(self, inputs: list, bad: list[torch.Tensor]) -> bool:
        """A -inf mask made from a scalar, or an op passing such values along without new NaNs."""
        if _nonfinite_scalar(inputs):
            return True
        carried = [t for t in inputs if isinstance(t, torch.Tensor) and self._intentional.get(id(t)) is t]
        if not carried:
            return False
        carried_nan = any(bool(torch.isnan(t).any()) for t in carried if _floating(t))
        return carried_nan or not any(bool(torch.isnan(t).any()) for t in bad)

    def _record(self, func, inputs: list, tensor: torch.Tensor) -> None:
        module, source, library_source = self._attribution()
        float_inputs = [t for t in inputs if _floating(t) and t.numel()]
        name = self.name_of(tensor)
        self.found = {
            "phase": self.phase, "module": module, "op": func._schema.name,
            "first": "inf" if bool(torch.isinf(tensor).any()) else "nan",
            "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "nonfinite_count": int((~torch.isfinite(tensor)).sum()),
            "input_absmax": max((float(t.detach().abs().max()) for t in float_inputs), default=None),
            "source": source, "library_source": library_source, "micro_batch": self.micro_batch, "tensor": name,
        }
        if self.phase == "optimizer" and name is not None:
            from gpuprof.numerics.state import owning_module

            self.found["module"] = owning_module(name)
        self.entries_at_found = self.tracker.entries
        self.found_before_any_module = self.tracker.in_model_before_any_module

    def _attribution(self) -> tuple[str | None, str | None, str | None]:
        if self.phase == "backward":
            node = private("torch._C._current_autograd_node", lambda: None)()
            return self.owners.owner.get(node, (None, None, None))
        return self.tracker.owner()

    def end_forward(self) -> None:
        """Ops outside every module after the model's last module ran are the loss computation; not those of a
        model whose own forward had called none of its modules (an nn.Linear alone)."""
        found = self.found
        if found and found["phase"] == "forward" and found["module"] is None \
                and self.tracker.entries == self.entries_at_found and not self.found_before_any_module:
            found["phase"] = "loss"


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """Tensors an in-place or out= op wrote (for foreach ops, every tensor of the list)."""
    written = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or index >= len(args) else args[index]
        written.extend(v for v in tree_flatten(value)[0] if isinstance(v, torch.Tensor))
    return written
