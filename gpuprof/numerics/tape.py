"""The step's tape: what a training step computed, so that NaN forensics can compute it again.

Most loops compute the loss outside the model (`F.cross_entropy(model(x).logits, y)`), so the
model's forward calls alone do not say what the backward pass started from. The tape keeps:
- every training forward call of the root module (its arguments, by reference), and
- the loss program: the torch calls between the end of a forward call and `backward()` on the
  path from the model's outputs (and its parameters) to the tensor backward() is called on.
  A TorchFunctionMode is on the mode stack only around that window (pushed by the root module's
  forward hook, popped as backward() returns: see _LeaveWhenDropped). It sees every call there,
  above autograd and autocast, and keeps a call only when one of its tensors is a model output, a
  parameter or the result of a call it kept: the loop's other work in the window (nanoGPT fetches
  the next batch between forward and backward, about 8 calls a sample) is not kept, and the
  tensors it made enter the program by reference (the targets), like batches. When backward()
  runs, the calls its tensor does not depend on (a metric on the logits) are dropped too, so the
  program is what the loss depends on, whatever the batch size. Kept calls store their tensors as
  references: an output of a forward call, a result of an earlier call, a parameter by name, or
  any other tensor by reference. Past MAX_LOSS_CALLS kept calls in one window the step's tape
  stops, and its event says so.
When backward() ran straight from a model output (the model computed its loss: Hugging Face
`labels=`) in DIRECT_AFTER micro-batches in a row, the window stays shut: calls passing through a
mode cost about 1.3 us each, and a CPU `clip_grad_norm_` makes one per parameter. The end of the
backward pass then closes the micro-batch at the same output, and every VERIFY_EVERY steps the
window opens again to check that the loop still does so (StepTape.assumed_from says when).
Each micro-batch is one list of items (forward calls and loss calls) ending at the tensor
`backward()` was called on. `replay_loss` runs such a micro-batch on another model (the
forensic copy, or the model `gpuprof replay` rebuilt) and returns that tensor.

Nothing here may raise into the training loop: an internal error stops the tape for the rest
of that step and is kept as the step's `error`, which its non-finite event then reports.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from gpuprof import module_hooks
from gpuprof.modules import eager_model
from gpuprof.torch_compat import private, run_eagerly
from gpuprof.numerics.watch import format_frame, user_frame

DIRECT_AFTER = 3  # micro-batches in a row whose backward() ran on a model output
VERIFY_EVERY = 50  # steps between two recorded windows once the loss is known to be the output
MAX_LOSS_CALLS = 4096  # calls on the path from the model's outputs: far more than any loss takes
_BACKWARDS = (torch.Tensor.backward, torch.autograd.backward)
_SCALE_MULTIPLIES = {"mul", "__mul__", "__rmul__"}
FORWARD_ARGS, FORWARD_KWARGS = "gpuprof_forward_args", "gpuprof_forward_kwargs"


def forward_call(args: tuple, kwargs: dict) -> dict[str, Any]:
    """A model call recorded during training, as a plain dict (bundles hold plain values only), with the user's
    frame that made it: the re-run calls the model from inside prof.step(), where no line of the user's is on the
    stack."""
    return {FORWARD_ARGS: list(args), FORWARD_KWARGS: dict(kwargs), "autocast": autocast_now(), "where": user_frame()}


class Output(NamedTuple):
    item: int  # the forward call, by its index among the micro-batch's items
    leaf: int  # the tensor's index among the flattened outputs


class Result(NamedTuple):
    item: int  # the loss call, by its index among the micro-batch's items
    leaf: int


class Param(NamedTuple):
    name: str


class Const(NamedTuple):
    index: int  # into MicroBatch.consts: a tensor made outside the window (targets, masks), by reference


REFERENCES = (Output, Result, Param, Const)


@dataclass
class LossCall:
    func: Callable
    args: tuple
    kwargs: dict
    autocast: dict[str, str] | None
    where: tuple[str, int, str] | str | None  # the user's frame (file, line, function), or its source line

    @property
    def source(self) -> str | None:
        return self.where if isinstance(self.where, str) or self.where is None else format_frame(self.where)


@dataclass
class MicroBatch:
    """Forward calls (forward_call dicts) and loss calls, in the order they ran."""

    items: list[dict[str, Any] | LossCall] = field(default_factory=list)
    consts: list[torch.Tensor] = field(default_factory=list)
    target: Any = None  # the reference of the loss backward() ran from (unscaled)


@dataclass
class StepTape:
    calls: list[dict[str, Any]] = field(default_factory=list)  # every training forward call of the step
    micro_batches: list[MicroBatch] = field(default_factory=list)
    error: str | None = None  # why the loss program is missing or incomplete
    assumed_from: int | None = None  # backward() from the model's output was assumed, last seen at this step

    @property
    def replayable(self) -> bool:
        return self.error is None and bool(self.micro_batches) and all(m.target is not None for m in self.micro_batches)


# one C call where autocast is off (the usual case); torch builds without it check each device
_ANY_AUTOCAST = private("torch._C._is_any_autocast_enabled", lambda: True)


def autocast_now() -> dict[str, str] | None:
    if not _ANY_AUTOCAST():
        return None
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            return {"device_type": device_type, "dtype": str(dtype).removeprefix("torch.")}
    return None


def autocast_as(settings: dict[str, str] | None):
    """Exactly the recorded autocast state: on with its dtype, or off (also inside an outer autocast)."""
    if settings:
        device_type = settings["device_type"]
        if device_type == "cuda" and not torch.cuda.is_available():
            device_type = "cpu"  # a bundle from a GPU machine replayed on a CPU-only one
        return torch.autocast(device_type=device_type, dtype=getattr(torch, settings["dtype"]))
    stack = contextlib.ExitStack()
    for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
    return stack


class _LossWindow(TorchFunctionMode):
    """Records torch calls while `recording`; passes everything through otherwise."""

    def __init__(self, tape: "Tape"):
        super().__init__()
        self.tape = tape
        self.recording = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        given, kwargs = kwargs, kwargs or {}
        if not self.recording or torch.compiler.is_compiling():  # the usual case first: passing through
            return func(*args, **kwargs)
        if func in _BACKWARDS:
            self.recording = False
            self.tape.safely(self.tape.close_micro_batch, args[0] if args else kwargs.get("tensors"))
            result = func(*args, **kwargs)
            if isinstance(given, dict):
                given[_LEAVE_KEY] = _LeaveWhenDropped(self.tape)
            return result
        out = func(*args, **kwargs)
        self.tape.record_call(func, args, kwargs, out)
        return out


# Called by torch inside a function torch.compile runs, the handler's own frame is not compiled (each call's
# arguments would recompile it, up to dynamo's limit); traced as part of such a function, it still inlines.
private("torch._dynamo.eval_frame.skip_code", lambda code: None)(_LossWindow.__torch_function__.__code__)

_LEAVE_KEY = "_gpuprof_leave_window"


class _LeaveWhenDropped:
    """Takes the window off the mode stack as soon as backward() has returned.

    torch pushes a mode back onto the stack after its handler returns, so the handler of
    backward() cannot pop it; left there, every call until the next optimizer step passes through
    it (about 1.3 us each; a CPU `clip_grad_norm_` makes several per parameter). This object rides
    in the keyword arguments torch's `handle_torch_function` handed to the handler and is dropped
    with them when that function returns, after the push. Should torch keep them longer, the window
    leaves at the next forward, optimizer step or `prof.step()` as before.
    """

    __slots__ = ("tape",)

    def __init__(self, tape: "Tape"):
        self.tape = tape

    def __del__(self):
        try:
            self.tape._leave_window()
        except Exception:  # noqa: BLE001 - runs inside the user's backward() call site
            pass


class Tape:
    """Collector: records each step's forward calls and loss program (see the module docstring)."""

    name = "numerics_tape"

    def __init__(self, model: torch.nn.Module, scaler=None):
        self.model = model
        self.scaler = scaler
        self._window = _LossWindow(self)
        self._pushed = False
        self._step = StepTape()
        self._micro: MicroBatch | None = None
        self._known: dict[int, tuple[Any, torch.Tensor]] = {}  # id(tensor) -> (reference, tensor kept alive)
        self._scaled_items: set[int] = set()  # the loss calls computed from the GradScaler's scale
        self._reads: dict[int, set[int]] = {}  # loss call -> the items (forward and loss calls) it reads
        self._param_names: dict[int, str] | None = None
        self._handles: list = []
        self._step_index = 0
        self._direct_streak = 0  # micro-batches in a row whose backward() ran on this output
        self._direct_target: Output | None = None
        self._direct_seen_at: int | None = None  # the step whose window last saw it
        self._awaiting_backward = False  # a forward whose window stayed shut
        self._kept_calls = 0  # loss calls kept in the open window

    # ------------------------------------------------------------------ collector hooks
    def on_start(self, prof) -> None:
        eager = run_eagerly  # hooks run eagerly around a compiled model
        self._handles = [prof.collectors.hook(self, self.model, "forward_pre", self._on_forward),
                         module_hooks.register(self.model, "forward", eager(self._on_forward_end))]
        if hasattr(prof.optimizer, "register_step_pre_hook"):
            self._handles.append(prof.collectors.hook(self, prof.optimizer, "step_pre", self._leave_window))

    def on_close(self, prof) -> None:
        self._leave_window()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def on_step_start(self, prof, step: int) -> None:
        self._step_index = step

    def on_join_at_backward(self, prof, step: int) -> None:
        self._step.error = ("the step began before gpuprof started recording (gpuprof run starts at the "
                            "script's first backward()): its forward calls were not recorded")

    def on_after_backward(self, prof, step: int) -> None:
        if self._awaiting_backward:
            self._awaiting_backward = False
            self.safely(self._close_at_output)

    def take(self) -> StepTape:
        """The step's tape (called once per step, at its end); the next step starts a new one."""
        if self._pushed:
            self._leave_window()
        if self._micro is not None:
            self.safely(self._drop_open_micro_batch)
        self._awaiting_backward = False
        self._forget()
        step, self._step = self._step, StepTape()
        self._micro = None
        return step

    # ------------------------------------------------------------------ recording
    def safely(self, function, *args) -> None:
        if self._step.error is not None:
            return
        try:
            function(*args)
        except Exception as error:  # noqa: BLE001 - never raise into the training loop
            self._stop(error)

    def _stop(self, error: Exception) -> None:
        self._step.error = f"recording stopped: {error!r}"
        self._window.recording = False

    def _on_forward(self, module, args, kwargs) -> None:
        if self._pushed:
            self._leave_window()  # model code is not part of the loss program
        self.safely(self._before_forward, args, kwargs)

    def _on_forward_end(self, module, args, output) -> None:
        self.safely(self._after_forward, output)

    def _before_forward(self, args, kwargs) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation inside the loop is not part of the step
        call = forward_call(args, kwargs)
        self._step.calls.append(call)
        if self._micro is None:
            self._micro = MicroBatch()
            self._step.micro_batches.append(self._micro)
        self._micro.items.append(call)

    def _after_forward(self, output) -> None:
        if not torch.is_grad_enabled() or self._micro is None:
            return
        if self._skips_window:
            self._awaiting_backward = True
            return
        item = len(self._micro.items) - 1
        for leaf, tensor in enumerate(leaves(output)):
            self._known[id(tensor)] = (Output(item, leaf), tensor)
        self._enter_window()

    @property
    def _skips_window(self) -> bool:
        due = self._direct_seen_at is None or self._step_index - self._direct_seen_at >= VERIFY_EVERY
        return self._direct_streak >= DIRECT_AFTER and not due

    def _close_at_output(self) -> None:
        """The micro-batch's backward ran, unseen, from the output the window saw it run from."""
        micro, self._micro = self._micro, None
        if micro is not None:
            micro.target = self._direct_target
            self._step.assumed_from = self._direct_seen_at

    def _learn_target(self, micro: MicroBatch) -> None:
        direct = isinstance(micro.target, Output) and not any(isinstance(item, LossCall) for item in micro.items)
        same = direct and micro.target == self._direct_target
        self._direct_streak = self._direct_streak + 1 if same else int(direct)
        self._direct_target = micro.target if direct else None
        self._direct_seen_at = self._step_index if direct else None

    def record_call(self, func, args, kwargs, out) -> None:
        """Keeps a call of the window that takes the model's values; never raises (like `safely`,
        written out: this runs for every call in the window)."""
        if self._step.error is not None:
            return
        try:
            results = (out,) if isinstance(out, torch.Tensor) else leaves(out)
            if not results and not _mutates(func):
                return  # .size(), .item(), .shape: nothing the loss can depend on
            micro, refs, outside = self._micro, [], []
            args = self._encoded(args, micro, refs, outside)
            kwargs = self._encoded(kwargs, micro, refs, outside) if kwargs else {}
            if refs:  # else the loop's other work (its next batch): what it made enters by reference
                self._keep_call(LossCall(func, args, kwargs, autocast_now() if _ANY_AUTOCAST() else None,
                                         user_frame()), results, refs, outside)
        except Exception as error:  # noqa: BLE001 - never raise into the training loop
            self._stop(error)

    def _keep_call(self, call: LossCall, results, refs: list, outside: list[torch.Tensor]) -> None:
        micro = self._micro
        self._kept_calls += 1
        if self._kept_calls > MAX_LOSS_CALLS:
            raise RuntimeError(f"more than {MAX_LOSS_CALLS} torch calls on the path from the model's outputs "
                               "before backward(): not a loss computation gpuprof keeps")
        if outside:
            refs += self._keep_consts(micro, outside)
        index = len(micro.items)
        micro.items.append(call)
        reads = self._reads[index] = set()
        for ref in refs:
            if type(ref) is Output or type(ref) is Result:
                reads.add(ref.item)
        if self.scaler is not None and self._takes_scale(micro, refs):
            self._scaled_items.add(index)
        known = self._known
        for leaf, tensor in enumerate(results):
            known[id(tensor)] = (Result(index, leaf), tensor)

    def _encoded(self, value, micro: MicroBatch, refs: list, outside: list):
        """`value` (a call's arguments or keywords: a tuple, list or dict) with each tensor in it, at any
        depth, replaced by its reference. References to the model's values (its outputs, parameters,
        kept results and constants) go to `refs`; any other tensor becomes the next Const, kept in
        `outside` (micro.consts takes it only if the call is kept: see _keep_consts)."""
        is_dict = isinstance(value, dict)
        items = value.values() if is_dict else value
        if _PLAIN.issuperset(map(type, items)):  # no tensor in it (most keywords, index tuples): a walk in C
            return dict(value) if is_dict else type(value)(value)
        known, encoded = self._known, []
        for item in items:
            if type(item) in _PLAIN:
                encoded.append(item)
            elif isinstance(item, torch.Tensor):
                found = known.get(id(item))
                if found is None or found[1] is not item:
                    found = self._parameter_or_const(item, micro, outside)
                if found[1] is not None:
                    refs.append(found[0])
                encoded.append(found[0])
            elif isinstance(item, (list, tuple, dict)):
                encoded.append(self._encoded(item, micro, refs, outside))
            else:
                encoded.append(item)
        return dict(zip(value, encoded)) if is_dict else type(value)(encoded)

    def _parameter_or_const(self, tensor: torch.Tensor, micro: MicroBatch, outside: list) -> tuple[Any, Any]:
        """(the reference, the parameter) of a tensor not seen before; (a new Const, None) for one from
        outside the model."""
        name = self._names().get(id(tensor))  # before the Parameter check, a Python-level metaclass one
        if name is not None and isinstance(tensor, torch.nn.Parameter):
            return Param(name), tensor
        outside.append(tensor)
        return Const(len(micro.consts) + len(outside) - 1), None

    def _keep_consts(self, micro: MicroBatch, outside: list[torch.Tensor]) -> list[Const]:
        """The kept call's tensors from outside the model enter micro.consts; their references."""
        refs = []
        for tensor in outside:
            if tensor.grad_fn is not None:  # computed from the model by a call gpuprof did not see
                raise RuntimeError(f"the loss uses a {tuple(tensor.shape)} tensor computed by a call gpuprof "
                                   "cannot record (e.g. an autograd.Function)")
            micro.consts.append(tensor)
            refs.append(Const(len(micro.consts) - 1))
            self._known[id(tensor)] = (refs[-1], tensor)
        return refs

    def _takes_scale(self, micro: MicroBatch, refs: list) -> bool:
        """Whether a loss call takes the GradScaler's scale (made inside the window at the first
        scaler.scale()) or a result computed from it."""
        return any(self._scale_derived(micro, ref) for ref in refs)

    def close_micro_batch(self, tensor) -> None:
        micro, self._micro = self._micro, None
        self._kept_calls = 0
        known = self._known.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if micro is not None and known is not None:
            scaled = self.scaler is not None and self._scale_derived(micro, known[0])
            micro.target = self._unscaled(micro, known[0]) if scaled else known[0]
            _keep_what_the_target_needs(micro, self._reads)
        elif micro is not None:
            self._step.error = "backward() was called on a tensor computed where gpuprof could not see it"
        if micro is not None:
            self._learn_target(micro)
        self._forget()

    def _unscaled(self, micro: MicroBatch, target: Result):
        """`scaler.scale(loss)` is `loss * scale`: the loss is the multiply's other operand."""
        call = micro.items[target.item]
        if not isinstance(call, LossCall) or call.func.__name__ not in _SCALE_MULTIPLIES:
            raise RuntimeError("the tensor backward() ran on was scaled in a way gpuprof does not know")
        kept = [value for value in call.args if isinstance(value, REFERENCES)]
        unscaled = [ref for ref in kept if not self._scale_derived(micro, ref)]
        if len(unscaled) != 1:
            raise RuntimeError("cannot tell the loss from the GradScaler's scale")
        del micro.items[target.item:]  # the scaling itself is redone by the forensic re-run
        return unscaled[0]

    def _scale_derived(self, micro: MicroBatch, ref) -> bool:
        if isinstance(ref, Const):
            return micro.consts[ref.index] is getattr(self.scaler, "_scale", None)
        return isinstance(ref, Result) and ref.item in self._scaled_items

    def _names(self) -> dict[int, str]:
        if self._param_names is None:
            self._param_names = {id(p): n for n, p in eager_model(self.model).named_parameters()}
        return self._param_names

    def _forget(self) -> None:
        self._known.clear()
        self._scaled_items.clear()
        self._reads.clear()

    def _drop_open_micro_batch(self) -> None:
        """A forward whose output never reached backward() (e.g. a metric pass with grad on)."""
        if self._micro.target is None:
            self._step.micro_batches.remove(self._micro)

    # ------------------------------------------------------------------ the mode stack
    def _enter_window(self) -> None:
        push = private("torch._C._push_on_torch_function_stack")  # without it no loss call is recorded
        if not self._pushed and push is not None:
            push(self._window)
            self._pushed = True
        self._window.recording = True

    def _leave_window(self, *_hook_args) -> None:
        """Off the mode stack, unless another mode was pushed above it (then it passes calls through)."""
        self._window.recording = False
        if self._pushed and _top_mode() is self._window:
            private("torch._C._pop_torch_function_stack")()
            self._pushed = False


def _keep_what_the_target_needs(micro: MicroBatch, reads: dict[int, set[int]]) -> None:
    """Drops the loss calls the target does not depend on; forward calls stay (they are the step's).
    A call mutating a tensor that a needed call reads is needed too (it ran before that read).
    `reads`: each loss call's index -> the items it reads."""
    needed = {micro.target.item} if isinstance(micro.target, (Output, Result)) else set()
    for index in range(len(micro.items) - 1, -1, -1):
        read = reads.get(index)  # None for a forward call
        if read is not None and (index in needed or _mutates(micro.items[index].func) and read & needed):
            needed |= read
            needed.add(index)
    if needed.issuperset(reads):
        return  # every loss call is needed (the usual case)
    kept = [index for index, item in enumerate(micro.items) if not isinstance(item, LossCall) or index in needed]
    new_index = {old: new for new, old in enumerate(kept)}

    def renumber(ref):
        return type(ref)(new_index[ref.item], ref.leaf) if isinstance(ref, (Output, Result)) else ref

    items = [micro.items[index] for index in kept]
    for item in items:
        if isinstance(item, LossCall):
            item.args, item.kwargs = _map(item.args, REFERENCES, renumber), _map(item.kwargs, REFERENCES, renumber)
    micro.items, micro.target = items, _map(micro.target, REFERENCES, renumber)


def _top_mode():
    depth = private("torch._C._len_torch_function_stack", lambda: 0)()
    return private("torch._C._get_function_stack_at")(depth - 1) if depth else None


def _mutates(func) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.endswith("__") or name in ("__setitem__",) or name.startswith("__i")


# the values torch calls mostly take besides tensors, and the types `leaves` found to hold no tensor
# (Hugging Face's cache, in every model output): passed over without isinstance checks
_PLAIN = {int, float, bool, str, slice, type(None), type(Ellipsis), torch.dtype, torch.device, torch.Size}


def _map(value: Any, kind, function: Callable) -> Any:
    """`value` with every leaf of type `kind` (inside lists, tuples and dicts) replaced by function(leaf)."""
    # a call's arguments (an exact tuple) and keywords (a dict) first, with no call per flat item; safe
    # before the `kind` check, as no tensor or reference is either (references are tuple subclasses)
    if type(value) is tuple:
        return tuple([item if type(item) in _PLAIN else function(item) if isinstance(item, kind)
                      else _map(item, kind, function) for item in value])
    if isinstance(value, dict):
        return {key: item if type(item) in _PLAIN else _map(item, kind, function)
                for key, item in value.items()} if value else {}
    if isinstance(value, kind):
        return function(value)
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(_map(tuple(value), kind, function))
    return value


def leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in an output, in order, through lists, tuples and mappings (Hugging Face ModelOutput)."""
    if isinstance(value, torch.Tensor):
        return [value]
    kind = type(value)
    if kind in _PLAIN:
        return []
    # exact types, then a dict's check, before the Mapping check: an ABC's, slow on caches a step has flushed
    if kind is tuple or kind is list or (kind is not dict and isinstance(value, (list, tuple))):
        return _leaves_of(value)
    if isinstance(value, dict) or isinstance(value, Mapping):
        return _leaves_of(value.values())
    _PLAIN.add(kind)
    return []


def _leaves_of(items) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif type(item) not in _PLAIN:
            found += leaves(item)
    return found


# ---------------------------------------------------------------------- replay
def replay_loss(model: torch.nn.Module, micro: MicroBatch,
                on_call: Callable[[str | None, bool], None] = lambda source, model_call: None) -> torch.Tensor:
    """Runs one recorded micro-batch on `model`; returns the tensor backward() was called on (unscaled).

    `on_call` is told the user's source line of each call before it runs again (None where none was recorded) and
    whether it calls the model, so that forensics can name it rather than this function's or a library's.
    """
    params = dict(model.named_parameters())
    results: dict[int, list] = {}  # item index -> its flattened outputs

    def resolve(value):
        if isinstance(value, (Output, Result)):
            return results[value.item][value.leaf]
        if isinstance(value, Param):
            return params[value.name]
        if isinstance(value, Const):
            return micro.consts[value.index]
        return value

    for index, item in enumerate(micro.items):
        if isinstance(item, LossCall):
            on_call(item.source, False)
            with autocast_as(item.autocast):
                out = item.func(*_map(item.args, REFERENCES, resolve), **_map(item.kwargs, REFERENCES, resolve))
        else:
            on_call(format_frame(item.get("where")), True)
            with autocast_as(item.get("autocast")):
                out = model(*item[FORWARD_ARGS], **item[FORWARD_KWARGS])
        results[index] = leaves(out)
    return resolve(micro.target)


# ---------------------------------------------------------------------- bundles
# A bundle may not carry code (gpuprof.numerics.bundle): a loss call is stored as the name of a
# torch function, and only native torch ops, Tensor methods and torch.nn.functional are resolved.
_TAG = "gpuprof"
_NAMESPACES = {"Tensor": torch.Tensor, "torch": torch, "torch.nn.functional": torch.nn.functional,
               "torch.special": torch.special, "torch.linalg": torch.linalg, "torch.fft": torch.fft}
_REFERENCE_KINDS = {cls.__name__.lower(): cls for cls in REFERENCES}


class TapeError(ValueError):
    """A recorded loss call that cannot be stored in, or read from, a bundle."""


def encode_micro_batch(micro: MicroBatch) -> dict[str, Any]:
    """`micro` as plain values (tensors, numbers, strings, lists, dicts) for a replay bundle."""
    items = [item if isinstance(item, dict) else {
        "function": _function_name(item.func), "args": _encode(item.args), "kwargs": _encode(item.kwargs),
        "autocast": item.autocast, "where": item.source} for item in micro.items]
    return {"items": items, "consts": list(micro.consts), "target": _encode(micro.target)}


def decode_micro_batch(plain: dict[str, Any], device: torch.device) -> MicroBatch:
    items = [item if FORWARD_ARGS in item else LossCall(
        _function(item["function"]), _decode(item["args"], device), _decode(item["kwargs"], device),
        item["autocast"], item["where"]) for item in plain["items"]]
    return MicroBatch(items, list(plain["consts"]), _decode(plain["target"], device))


def _function_name(func) -> dict[str, str]:
    name = getattr(func, "__name__", None)
    tensor_base = private("torch._C.TensorBase")
    if name == "__get__" and getattr(getattr(func, "__self__", None), "__objclass__", None) is tensor_base:
        return {"namespace": "Tensor.attribute", "name": func.__self__.__name__}  # e.g. logits.mT
    for namespace, owner in _NAMESPACES.items():
        if name and getattr(owner, name, None) is func and _resolvable(namespace, name):
            return {"namespace": namespace, "name": name}
    raise TapeError(f"the loss calls {getattr(func, '__qualname__', func)!r}, which a bundle cannot name")


def _resolvable(namespace: str, name: str) -> bool:
    if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
        return False
    found = getattr(_NAMESPACES.get(namespace), name, None)
    if namespace == "Tensor":
        return callable(found)
    if namespace == "torch.nn.functional":
        return callable(found) and getattr(found, "__module__", None) in ("torch.nn.functional", "torch._C._nn", None)
    return type(found).__name__ == "builtin_function_or_method"  # a native op, not torch.save or torch.load


def _function(stored: dict[str, str]):
    namespace, name = stored.get("namespace"), stored.get("name")
    if namespace == "Tensor.attribute" and isinstance(getattr(torch.Tensor, str(name), None), type(torch.Tensor.mT)):
        return lambda tensor: getattr(tensor, name)
    if namespace not in _NAMESPACES or not isinstance(name, str) or not _resolvable(namespace, name):
        raise TapeError(f"the bundle names a function gpuprof does not replay: {namespace}.{name}")
    return getattr(_NAMESPACES[namespace], name)


def _encode(value: Any) -> Any:
    if isinstance(value, REFERENCES):
        return {_TAG: type(value).__name__.lower(), "fields": list(value)}
    if isinstance(value, slice):
        return {_TAG: "slice", "fields": [_encode(value.start), _encode(value.stop), _encode(value.step)]}
    if value is Ellipsis:
        return {_TAG: "ellipsis"}
    if isinstance(value, torch.dtype):
        return {_TAG: "dtype", "name": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {_TAG: "device", "name": str(value)}
    if isinstance(value, (torch.memory_format, torch.layout)):
        return {_TAG: "torch", "name": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Size):
        return {_TAG: "size", "fields": list(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(item) for item in value)
    if isinstance(value, dict):
        return {key: _encode(item) for key, item in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TapeError(f"the loss passes a {type(value).__name__} to a torch call, which a bundle cannot hold")


def _decode(value: Any, device: torch.device) -> Any:
    if isinstance(value, dict) and _TAG in value:
        return _decode_tagged(value, device)
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(item, device) for item in value)
    if isinstance(value, dict):
        return {key: _decode(item, device) for key, item in value.items()}
    return value


def _decode_tagged(value: dict, device: torch.device) -> Any:
    kind = value[_TAG]
    if kind in _REFERENCE_KINDS:
        return _REFERENCE_KINDS[kind](*value["fields"])
    if kind == "slice":
        return slice(*(_decode(field, device) for field in value["fields"]))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "size":
        return torch.Size(value["fields"])
    if kind == "device":
        return device  # the recorded device is the training one; the replay runs where it runs
    found = getattr(torch, str(value.get("name")), None)
    if kind in ("dtype", "torch") and isinstance(found, (torch.dtype, torch.memory_format, torch.layout)):
        return found
    raise TapeError(f"the bundle holds an unknown value {value!r}")
