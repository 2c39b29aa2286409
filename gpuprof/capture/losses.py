"""The loss is what backward() is called on.

Whatever the model returns (a tuple, a dict, a dataclass, a tensor) and wherever the loop computes
its loss, it calls backward() on it, and every way in ends in `torch.autograd.backward`:
`loss.backward()`, `scaler.scale(loss).backward()`, `accelerator.backward(loss)`, Lightning's
automatic optimization and its `manual_backward(loss)`. While a BackwardLosses listens, that
function is wrapped (one Python call per backward pass) and the tensor it is given is taken:
- a one-element tensor only (backward(gradient=...) on a larger one has no loss to record);
- under a GradScaler the tensor is `loss * scale`: the loss taken is the one `scaler.scale()` was
  given (GradScaler.scale is wrapped likewise), never the scaled one, which can overflow alone;
- under gradient accumulation the step's loss is the sum of its micro-batches' tensors, which
  is what the optimizer step's gradient is the gradient of: a loop dividing each micro-batch's
  loss by the number of micro-batches (nanoGPT, Accelerate, Lightning) records their mean.
The sum stays on the device (one add per micro-batch, no host-device sync). A backward pass of
no loss the loop runs (none at all, or only `torch.autograd.grad`) records no loss, which the
report shows as n/a. gpuprof's own backward passes (the forensic re-run of a bad step) run while
the listener is `paused()`: they are not the loop's, and would add the bad step's loss to the next.
The same wrapper tells `watch_starts` callbacks that a backward() call begins (the automatic phases'
backward start, gpuprof.capture.phases). A loss the loop passes itself (`prof.step(loss=...)`), in whatever
form, becomes the one value the steps file takes in `one_loss`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import weakref
from typing import Any, Callable, Mapping

import torch

from gpuprof.capture.pending import read_if_host
from gpuprof.torch_compat import private, run_eagerly

logger = logging.getLogger("gpuprof")

_listeners: list["BackwardLosses"] = []
_starts: list[Callable[[], None]] = []  # told at every backward() call, before its pass (see watch_starts)
_originals: dict[str, object] = {}


class BackwardLosses:
    """The sum of the one-element tensors backward() was called on since the last take()."""

    def __init__(self):
        self._sum: torch.Tensor | None = None
        self.count = 0  # backward passes taken since the last take()
        self._paused = False

    def listen(self) -> None:
        if not _in_use():
            _install()
        if self not in _listeners:
            _listeners.append(self)

    def stop(self) -> None:
        if self in _listeners:
            _listeners.remove(self)
        if not _in_use():
            _uninstall()

    def take(self, given: object = None) -> torch.Tensor | None:
        """The step's loss (None when no backward pass took one, or when it is the very tensor `given`:
        the loop's own `prof.step(loss=loss)` after one `loss.backward()`, whose value is then watched
        once); the next step starts from zero."""
        loss, self._sum, passes, self.count = self._sum, None, self.count, 0
        return None if passes == 1 and _same_element(loss, given) else loss

    @contextlib.contextmanager
    def paused(self):
        """The backward passes run inside are gpuprof's own: none is taken."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def seen(self, loss: torch.Tensor) -> None:
        if self._paused:
            return
        self._sum = loss if self._sum is None else self._sum + loss
        self.count += 1


def one_loss(loss: Any) -> torch.Tensor | float | None:
    """The step's loss as the one value the steps file and the non-finite flags take: a tensor of several
    elements (a loss per term, or per sample) and a dict, list or tuple of losses count as their float32
    sum, non-finite when any term is; a one-element tensor as a 0-d one; a model output by its `.loss`.
    None for what holds no number. A device tensor stays on the device (no sync)."""
    if loss is None:
        return None  # no loss besides the given one, most steps: before the Mapping and Real checks (ABCs')
    if isinstance(loss, torch.Tensor):
        return _one_tensor_loss(loss)
    if hasattr(loss, "loss"):
        loss = loss.loss  # a Hugging Face ModelOutput is a Mapping of logits too: its loss is the loss
    if isinstance(loss, Mapping):
        loss = list(loss.values())
    if isinstance(loss, (list, tuple)):
        terms = [term.float() if isinstance(term, torch.Tensor) else term
                 for term in map(one_loss, loss) if term is not None]
        return read_if_host(sum(terms[1:], terms[0])) if terms else None
    if isinstance(loss, torch.Tensor):
        return _one_tensor_loss(loss)
    if isinstance(loss, numbers.Real):
        return float(loss)
    return None


def _one_tensor_loss(loss: torch.Tensor) -> torch.Tensor | float:
    if loss.numel() != 1:
        return read_if_host(loss.detach().float().sum())
    if loss.is_cpu:
        return loss.item()  # the loss a loop passes, every step: one op, not three
    return loss.detach() if loss.dim() == 0 else loss.detach().reshape(())


class _Scaled:
    """The last `scaler.scale(loss)`: its output, weakly, and the loss it was given."""

    output: "weakref.ref[torch.Tensor] | None" = None
    loss: torch.Tensor | None = None


def _same_element(loss: torch.Tensor | None, given: object) -> bool:
    """Whether `given` is a one-element tensor holding the very element `loss` views (the same memory, so the
    same value at every moment)."""
    return (isinstance(given, torch.Tensor) and loss is not None and given.numel() == 1
            and given.dtype == loss.dtype and given.data_ptr() == loss.data_ptr() and given.device == loss.device)


def _loss_of(tensors) -> torch.Tensor | None:
    tensor = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else tensors
    in_backward = private("torch._C._current_autograd_node", lambda: None)() is not None
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != 1 or in_backward:
        return None  # not a loss, or a backward inside a backward pass (reentrant checkpointing)
    if _Scaled.output is not None and _Scaled.output() is tensor:
        tensor = _Scaled.loss
    _Scaled.output = _Scaled.loss = None
    loss = tensor.detach()  # a float32 0-d loss, the usual one, as a view of itself: one op per backward pass
    if loss.dtype != torch.float32:
        loss = loss.float()
    return loss if loss.dim() == 0 else loss.reshape(())


def watch_starts(callback: Callable[[], None]) -> Callable[[], None]:
    """`callback()` at every backward() call, before its pass runs (where the automatic phases' backward
    begins: one Python call, no hook to register per step); it must not raise. Returns what stops it."""
    if not _in_use():
        _install()
    _starts.append(callback)
    return lambda: _unwatch_start(callback)


def _unwatch_start(callback: Callable[[], None]) -> None:
    if callback in _starts:
        _starts.remove(callback)
        if not _in_use():
            _uninstall()


def _in_use() -> bool:
    """Whether anyone listens, loss or start: the wrappers are installed exactly then."""
    return bool(_listeners or _starts)


def _take(tensors) -> None:
    try:
        loss = _loss_of(tensors)
        if loss is not None:
            for listener in list(_listeners):
                listener.seen(loss)
    except Exception as error:  # noqa: BLE001 - never fail the user's backward pass
        logger.warning("gpuprof: cannot read the loss at backward(): %r; no loss is recorded", error)
        _uninstall()
        _listeners.clear()
        _starts.clear()
    for start in tuple(_starts):
        start()


def _install() -> None:
    backward = _originals["backward"] = torch.autograd.backward
    scale = _originals["scale"] = torch.amp.GradScaler.scale

    @functools.wraps(backward)
    def backward_taking_the_loss(tensors, *args, **kwargs):
        _take(tensors)
        return backward(tensors, *args, **kwargs)

    @functools.wraps(scale)
    def scale_noting_the_loss(scaler, outputs):
        scaled = scale(scaler, outputs)
        if isinstance(outputs, torch.Tensor) and scaled is not outputs:
            _Scaled.output, _Scaled.loss = weakref.ref(scaled), outputs.detach()
        return scaled

    torch.autograd.backward = run_eagerly(backward_taking_the_loss)
    torch.amp.GradScaler.scale = scale_noting_the_loss


def _uninstall() -> None:
    if "backward" in _originals:
        torch.autograd.backward = _originals.pop("backward")
    if "scale" in _originals:
        torch.amp.GradScaler.scale = _originals.pop("scale")
    _Scaled.output = _Scaled.loss = None
