"""Records a training script nobody changed: what `gpuprof run SCRIPT [ARGS...]` runs.

The script runs as `python SCRIPT ARGS...` would run it (`__main__`, `sys.argv`, `sys.path[0]`),
with gpuprof watching through torch's global hooks:

- recording starts at the script's first backward(): the optimizer is the one optimizer (an
  Accelerate wrapper's torch optimizer) holding parameters of a module called with grad enabled
  that the script's frames making that call hold (the innermost frames outside torch and gpuprof,
  their locals then their module's globals); the model is the module called so far that holds the
  most of its parameters (the outermost one on a tie: DDP and compile wrappers). That first
  iteration is step 0: timed from its first forward (its data time is not seen), its loss, tokens,
  gradient norm, optimizer step and learning rate recorded; its forward calls are not on the
  tape, so a NaN in step 0 itself says it cannot be re-run (one caused by its update is blamed at
  step 1 as any other);
- else (no such optimizer in reach, or several: Muon beside AdamW, whose order only their steps
  tell; or `gpuprof tune` knobs that change the model) the optimizer is the first one whose `step()` runs, with any other optimizer of that
  model the script's frame holds (directly or in a list, tuple or dict) that steps before the
  first one steps again, and recording starts when that first iteration ends (meta.json's
  config says so in "first_iteration"); each step of the one stepping last ends one recorded step;
- else, at a second backward() with no optimizer step since the first and the first's gradients
  gone (`model.zero_grad()`), a loop updating its weights itself (pytorch/examples'
  word_language_model: `p.data.add_(p.grad, alpha=-lr)`): the model is the outermost module of
  the iteration's first training call, recording starts there (its second iteration is step 0)
  and each step ends at the model's next training call after a backward();
- the DataLoader is the last one iterated before that first step (its settings go to meta.json);
- a GradScaler and an LR scheduler of that optimizer are found among the variables of the script's
  frame that made that first step (its locals, then its module's globals): torch keeps no registry
  of either. With a GradScaler a step ends at `scaler.update()`, which runs every iteration, where
  `optimizer.step()` does not run on the steps the scaler skips.

The Profiler then times the phases (gpuprof.capture.phases), gradient norms and the rest as for
`gpuprof.profile`; tokens come from the model's calls (gpuprof.integrations.batches), the loss
from what backward() is called on (gpuprof.capture.losses), whatever the model returns.
A Hugging Face `Trainer` or a Lightning `Trainer` the script builds gets gpuprof's callback
instead (its `__init__` is wrapped once the module defining it is imported), and the global
hooks stand down. Whatever the script does, it ends the same way it would without gpuprof: its
exit code is returned, and a run it leaves half-done is closed as failed.

`gpuprof tune` runs scripts this way with two more options: `knobs`, fixes applied from outside
(gpuprof.integrations.knobs; found at the first step, the model gets those that change it before
recording starts), and `max_steps`, after which the script is stopped as finished.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import os
import runpy
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gpuprof import module_hooks
from gpuprof.torch_compat import foreach_norm, run_eagerly
from gpuprof.capture.environment import resolve_device
from gpuprof.capture.losses import BackwardLosses, watch_starts
from gpuprof.capture.phases import is_training_call
from gpuprof.capture.profiler import Profiler
from gpuprof.capture.timing import clock_for
from gpuprof.errors import GpuprofError
from gpuprof.integrations.batches import ForwardInputs, call_tokens
from gpuprof.integrations.knobs import KnobPatches
from gpuprof.numerics import construction
from gpuprof.numerics.watch import GPUPROF_DIR, TORCH_DIR, outside
from gpuprof.optimizers import params_of

logger = logging.getLogger("gpuprof")

MAX_CONTAINER_ITEMS = 64  # the largest list, tuple or dict searched for optimizers
MAX_FRAMES = 8  # the script's frames searched for its optimizer at its first backward()

TRAINER_MODULES = {  # module defining the class -> (class name, gpuprof callback module)
    "transformers.trainer": ("Trainer", "gpuprof.integrations.transformers"),
    "lightning.pytorch.trainer.trainer": ("Trainer", "gpuprof.integrations.lightning"),
}


def run_script(script: str, args: list[str], run_dir: str, *, knobs=(), max_steps: int | None = None,
               **options: Any) -> int:
    """Runs `script` with `args` recorded into `run_dir`; returns the exit code the script would have had.
    `knobs` (names) are applied from outside; after `max_steps` recorded steps the script is stopped."""
    path = os.path.abspath(script)
    if not os.path.isfile(path):
        raise GpuprofError(f"no such script: {script}")
    if max_steps is not None and max_steps < 1:
        raise GpuprofError(f"--max-steps must be at least 1, got {max_steps}")
    patches = KnobPatches(knobs, path)
    config = {"script": path, "args": list(args), **({"knobs": patches.applied} if knobs else {})}
    if max_steps is not None:
        options["collectors"] = [*options.get("collectors", ()), StepLimit(max_steps)]
    recorder = ScriptRecorder(run_dir, config=config, patches=patches, **options)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[0] = [path, *args], os.path.dirname(path)  # as `python SCRIPT` sets them
    recorder.install()
    construction.record_constructions(path)  # how the script builds its model, for `gpuprof replay`
    try:
        runpy.run_path(path, run_name="__main__")
    except StepLimitReached:
        recorder.finish("finished")
        return 0
    except SystemExit as exit_:
        code = _exit_code(exit_)
        recorder.finish("finished" if code == 0 else "failed")
        return code
    except BaseException as error:  # noqa: BLE001 - the script's failure is reported as Python would
        recorder.finish("failed", error)
        _print_traceback(error, path)
        return 130 if isinstance(error, KeyboardInterrupt) else 1
    else:
        recorder.finish("finished")
        return 0
    finally:
        construction.stop_recording()
        sys.argv, sys.path[:] = saved_argv, saved_path


class StepLimitReached(BaseException):
    """Raised out of the script's step once `max_steps` are recorded (past its `except Exception`)."""


class StepLimit:
    """A collector that stops the script after `steps` recorded steps (prof.step() raises stop_training)."""

    name = "step_limit"

    def __init__(self, steps: int):
        self.steps = steps
        self.stop_training: BaseException | None = None
        self._recorded = 0

    def on_step_end(self, prof, state) -> None:
        self._recorded += 1
        if self._recorded >= self.steps:
            self.stop_training = StepLimitReached(f"{self.steps} steps recorded")


class ScriptRecorder:
    """Finds the model and optimizer of a loop it did not write, or hooks the Trainer the loop builds."""

    def __init__(self, run_dir: str, patches: KnobPatches | None = None, **options: Any):
        self.run_dir = run_dir
        self.patches = patches
        self.options = options
        self.prof: Profiler | None = None
        self.callbacks: list[Any] = []  # the Trainer callbacks attached, in order
        self._called: dict[int, torch.nn.Module] = {}
        self._optimizer = self._model = self._loader = self._scaler = self._scheduler = None
        self._candidates: list = []  # the model's optimizers the script's frame holds, the first to step first
        self._members: list = []  # those seen stepping in the first iteration, in order
        self._loader_iter = None
        self._inputs: ForwardInputs | None = None
        self._forward: _TrainingForward | None = None  # the latest iteration's first training call
        self._first_losses = _EarlyBackwards(self._guarded(self._start_at_backward),
                                             self._guarded(self._start_without_optimizer))
        self._step0_began_early = False
        self._iterations: _IterationStarts | None = None
        self._forward_hooks: list = []
        self._optimizer_hooks: list = []
        self._finder = _PatchOnImport({name: functools.partial(self._patch_trainer, name) for name in TRAINER_MODULES})

    def install(self) -> None:
        self._forward_hooks = [register_module_forward_pre_hook(self._seen),
                               register_module_forward_hook(self._seen_returning, with_kwargs=True)]
        self._optimizer_hooks = [
            register_optimizer_step_pre_hook(self._guarded(self._before_step)),
            register_optimizer_step_post_hook(self._guarded(self._after_step)),
        ]
        self._finder.install()
        self._watch_loaders()
        if self.patches is not None:
            self.patches.install()
        self._first_losses.listen()

    def finish(self, status: str, error: BaseException | None = None) -> None:
        """Removes every hook and closes every recording still open (a run the script left mid-way)."""
        if self.prof is None and not self.callbacks:
            print("gpuprof run: nothing recorded: the script ran no optimizer step (or only one), no second backward() "
                  "on its model after releasing its gradients, and built no Trainer", file=sys.stderr)
        self._finder.remove()
        self._stop_discovery()
        if self.patches is not None:
            self.patches.remove()
        self._first_losses.stop()
        if self._iterations is not None:
            self._iterations.remove()
        if self._loader_iter is not None:
            torch.utils.data.DataLoader.__iter__ = self._loader_iter
        for handle in self._optimizer_hooks:
            handle.remove()
        for prof in [self.prof, *(callback.prof for callback in self.callbacks)]:
            if prof is not None and error is not None:
                prof.handle_exception(error)
        if self.prof is not None:
            self.prof.close(status=status)
        for callback in self.callbacks:
            callback.close(status)
        if self._scaler is not None:  # after the Profiler's own wrapper is gone
            self._scaler.__dict__.pop("update", None)

    # ------------------------------------------------------------------ discovery
    def _watch_loaders(self) -> None:
        original = self._loader_iter = torch.utils.data.DataLoader.__iter__
        seen = self._guarded(self._loader_seen)

        @functools.wraps(original)
        def __iter__(loader):
            seen(loader)
            return original(loader)

        torch.utils.data.DataLoader.__iter__ = __iter__

    def _loader_seen(self, loader) -> None:
        if self._optimizer is None:
            self._loader = loader

    def _seen(self, module: torch.nn.Module, args) -> None:
        """Runs on every module call until recording starts; torch.compile traces skip it."""
        if not torch.compiler.is_compiling() and torch.is_grad_enabled():
            self._called.setdefault(id(module), module)
            latest, passes = self._forward, self._first_losses.passes
            # the outermost module's hook runs first; that module called after a backward() begins an iteration
            if latest is None or (module is latest.module and passes > latest.passes):
                self._forward = _TrainingForward(clock_for(resolve_device(module)).stamp(), module, passes)

    def _seen_returning(self, module: torch.nn.Module, args, kwargs, output) -> None:
        """The iteration's first training forward's tokens, from its keyword arguments too (`model(**batch)`),
        which the global pre-hook is not given."""
        latest = self._forward
        if (not torch.compiler.is_compiling() and latest is not None and latest.module is module
                and latest.tokens is None):
            latest.tokens = call_tokens(args, kwargs)

    def _start_at_backward(self) -> None:
        """At the script's first backward(): starts recording there when its one optimizer is in reach."""
        if self.prof is not None or self.callbacks or self._optimizer is not None or self._forward is None:
            return
        if self.patches is not None and self.patches.model_changes:
            return  # knobs change the model at its first optimizer step, not in the middle of a backward pass
        found = _optimizers_in_reach(self._called.values())
        if found is None:
            return
        optimizer, values = found
        self._optimizer, self._model = optimizer, _holder_of(optimizer, self._called.values())
        self._scaler, self._scheduler = _loop_objects(optimizer, values)
        self._candidates, self._members = [optimizer], [optimizer]
        if self._scaler is not None:
            self._end_steps_at_scaler_updates()
        self._record_from_this_iteration()

    def _start_without_optimizer(self) -> None:
        """At a second backward() with no optimizer step since the first and the gradients of the first
        released (`model.zero_grad()`): a loop updating its weights itself (`p.data.add_(p.grad, alpha=-lr)`).
        Each of its steps is one iteration, from its first training call of the model to the next one's."""
        if self.prof is not None or self.callbacks or self._forward is None or self._optimizer is not None:
            return
        if self.patches is not None and self.patches.model_changes:
            return  # knobs change the model before its first step, never in the middle of a backward pass
        model = self._forward.module
        if not _gradients_released(model):
            return  # gradient accumulation, the optimizer out of reach: recording starts at its first step
        self._model = model
        self._first_losses.take()  # the first iteration's, before recording
        self.options["config"]["first_iteration"] = ("not recorded: recording starts at the second iteration's "
                                                     "backward(), where a loop stepping no optimizer is told apart")
        self._record_from_this_iteration()
        self._iterations = _IterationStarts(model, self._guarded(self._end_step))

    def _record_from_this_iteration(self) -> None:
        """Recording starts inside this iteration's backward(); step 0 began at the iteration's first training call."""
        self._stop_discovery()
        self._start_recording()
        self.prof.join_at_backward(self._forward.stamp)
        self._step0_began_early = True

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._first_losses.stop()  # recording starts at the end of this iteration, if at all
        if self._optimizer is None and not self.callbacks:
            self._optimizer = optimizer
            self._model = _holder_of(optimizer, self._called.values())
            values = _frame_values()
            self._scaler, self._scheduler = _loop_objects(optimizer, values)
            self._candidates = [optimizer, *_other_optimizers(optimizer, self._model, values)]
            if self._scaler is not None:
                self._end_steps_at_scaler_updates()
            self._stop_discovery()
            if self.patches is not None and self._model is not None:
                self.patches.model_found(self._model)
        elif self.prof is None and optimizer is self._optimizer and optimizer in self._members:
            self._candidates = list(self._members)  # a new iteration: those that have not stepped are not the loop's

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.prof is None and optimizer in self._candidates and optimizer not in self._members:
            self._members.append(optimizer)
        if (self._scaler is None and self._members and optimizer is self._members[-1]
                and len(self._members) == len(self._candidates)):
            self._end_step()

    def _end_step(self) -> None:
        if self.prof is None:
            self.options["config"]["first_iteration"] = ("not recorded: recording starts when it ends, as no one "
                                                         "optimizer was in reach at its first backward()")
            self._start_recording()
            return
        tokens = self._inputs.tokens if self._inputs else 0
        loss = None
        if self._step0_began_early:  # its losses and first forward came before the Profiler
            loss, self._step0_began_early = self._first_losses.take(), False
            self._first_losses.stop()
            tokens += self._forward.tokens or 0
        self.prof.step(loss=loss, tokens=tokens or None)

    def _end_steps_at_scaler_updates(self) -> None:
        """`scaler.update()` wrapped on this instance (the Profiler's own wrapper goes around it)."""
        original, end_step = self._scaler.update, self._guarded(self._end_step)

        def update(new_scale=None):
            result = original(new_scale)
            end_step()
            return result

        self._scaler.update = update

    def _start_recording(self) -> None:
        # under a GradScaler an optimizer may have been skipped in the first iteration: it comes last
        optimizers = self._members + [found for found in self._candidates if found not in self._members]
        self.prof = Profiler(self.run_dir, model=self._model, optimizer=optimizers, scaler=self._scaler,
                             lr_scheduler=self._scheduler, loader=self._loader, **self.options)
        if self._model is not None:
            self._inputs = ForwardInputs(self._model)
            self.prof.add_collector(self._inputs)
        self.prof.start()

    def _stop_discovery(self) -> None:
        for handle in self._forward_hooks:
            handle.remove()
        self._forward_hooks = []
        self._called.clear()

    # ------------------------------------------------------------------ Trainers
    def _patch_trainer(self, module_name: str, module) -> None:
        class_name, callback_module = TRAINER_MODULES[module_name]
        trainer_class = getattr(module, class_name)
        original = trainer_class.__init__
        attach = self._guarded(functools.partial(self._attach_callback, callback_module))

        @functools.wraps(original)
        def __init__(trainer, *args, **kwargs):
            original(trainer, *args, **kwargs)
            if not getattr(trainer, "_gpuprof_attached", False):
                trainer._gpuprof_attached = True
                attach(trainer)

        trainer_class.__init__ = __init__

    def _attach_callback(self, callback_module: str, trainer) -> None:
        """The Trainer's callback records from now on; the global hooks stand down."""
        self._stop_discovery()
        suffix = f"-{len(self.callbacks) + 1}" if self.callbacks else ""
        callback = importlib.import_module(callback_module).GpuprofCallback(self.run_dir + suffix, **self.options)
        if hasattr(trainer, "add_callback"):  # transformers
            trainer.add_callback(callback)
        else:  # lightning
            trainer.callbacks.append(callback)
        self.callbacks.append(callback)

    @staticmethod
    def _guarded(function: Callable) -> Callable:
        """gpuprof's hooks run inside the script's calls: a failure is logged once and the hook goes quiet;
        under torch.compile they run eagerly."""
        failed = False

        def guarded(*args, **kwargs):
            nonlocal failed
            if failed:
                return None
            try:
                return function(*args, **kwargs)
            except Exception as error:  # noqa: BLE001 - never raise into the user's script
                failed = True
                logger.warning("gpuprof run: %s failed and is switched off: %r", function.__name__, error,
                               exc_info=True)
                return None

        return run_eagerly(guarded)  # never traced into a compiled model or optimizer step


@dataclass
class _TrainingForward:
    """An iteration's first training forward: when it started, its outermost module, how many backward()
    calls came before it, and its tokens once it returned."""

    stamp: Any
    module: torch.nn.Module
    passes: int
    tokens: int | None = None


class _EarlyBackwards(BackwardLosses):
    """The losses of the iterations before recording starts; the script's first backward() calls `first()`,
    its second `second()`, each before its loss is taken."""

    def __init__(self, first: Callable[[], None], second: Callable[[], None]):
        super().__init__()
        self._calls = {1: first, 2: second}
        self.passes = 0  # backward() calls seen, whatever was taken

    def seen(self, loss: torch.Tensor) -> None:
        self.passes += 1
        if self.passes in self._calls:
            self._calls[self.passes]()
        super().seen(loss)


class _IterationStarts:
    """Calls `begins()` at the model's first training call after a backward(): where an iteration of a loop
    stepping no optimizer ends. Its forward pre-hook comes before the Profiler's, which then sees the new step."""

    def __init__(self, model: torch.nn.Module, begins: Callable[[], None]):
        self._backward_seen = True  # made inside the step's backward()
        self._begins = begins
        self._handle = module_hooks.register(model, "forward_pre", self._called, prepend=True)
        self._stop_watching = watch_starts(self._backward_called)

    def _backward_called(self) -> None:
        self._backward_seen = True

    def _called(self, module: torch.nn.Module, args) -> None:
        if self._backward_seen and is_training_call(module):
            self._backward_seen = False
            self._begins()

    def remove(self) -> None:
        self._handle.remove()
        self._stop_watching()


def _optimizers_in_reach(modules) -> tuple[torch.optim.Optimizer, list[Any]] | None:
    """(the one optimizer of the called `modules`, the values of the frame holding it), searching the
    script's frames outward from the innermost outside torch and gpuprof (accelerator.backward's
    own frame holds none); None when the first frame holding any holds several."""
    held = {id(param) for module in modules for param in module.parameters()}
    frame = outside((TORCH_DIR, GPUPROF_DIR))
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        values = [*frame.f_locals.values(), *frame.f_globals.values()]
        found = []
        for optimizer in map(_torch_optimizer, _optimizers_among(values)):
            if optimizer not in found and any(id(p) in held for p in params_of(optimizer)):
                found.append(optimizer)
        if found:
            return (found[0], values) if len(found) == 1 else None
        frame = frame.f_back
    return None


def _torch_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside a wrapper (Accelerate's AcceleratedOptimizer holds it as .optimizer)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _optimizers_among(values: list[Any]) -> list[torch.optim.Optimizer]:
    """The optimizers among `values` or in a list, tuple or dict among them, in order, once each."""
    found = []
    for value in values:
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        if len(inner) > MAX_CONTAINER_ITEMS:  # a dataset held in a list, not a list of optimizers
            continue
        found += [item for item in inner if isinstance(item, torch.optim.Optimizer) and item not in found]
    return found


def _gradients_released(model: torch.nn.Module) -> bool:
    """Whether no gradient of `model` is left from the backward() before (None, or all zero: the one host-device
    sync of a discovery, not of a step)."""
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    return not grads or not bool(torch.stack(foreach_norm(grads)).any())


def _holder_of(optimizer, modules) -> torch.nn.Module | None:
    """The module holding the most of the optimizer's parameters; the first called wins a tie."""
    params = {id(param) for param in params_of(optimizer)}
    best, best_count = None, 0
    for module in modules:
        count = sum(1 for param in module.parameters() if id(param) in params)
        if count > best_count:
            best, best_count = module, count
    return best


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Calls patches[name](module) right after module `name` is first imported (or now, if it already is)."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]):
        self._patches = patches
        self._busy: set[str] = set()

    def install(self) -> None:
        for name, patch in self._patches.items():
            if name in sys.modules:
                patch(sys.modules[name])
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)

    def find_spec(self, name, path, target=None):
        if name not in self._patches or name in self._busy:
            return None
        self._busy.add(name)
        try:
            spec = importlib.util.find_spec(name)  # the finders after this one
        finally:
            self._busy.discard(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, patch = spec.loader.exec_module, self._patches[name]

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def _exit_code(exit_: SystemExit) -> int:
    """What Python's exit status would be for this SystemExit."""
    if exit_.code is None or isinstance(exit_.code, int):
        return exit_.code or 0
    print(exit_.code, file=sys.stderr)
    return 1


def _print_traceback(error: BaseException, script: str) -> None:
    """The traceback Python would print: from the script's own frame on, without gpuprof's."""
    tb = error.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) != script:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb or error.__traceback__)


def _frame_values() -> list[Any]:
    """The locals, then the module's globals, of the script's frame making this optimizer step."""
    frame = outside((TORCH_DIR, GPUPROF_DIR))  # gpuprof's own hooks run inside the script's calls
    return [] if frame is None else [*frame.f_locals.values(), *frame.f_globals.values()]


def _loop_objects(optimizer, values: list[Any]) -> tuple[Any, Any]:
    """(the enabled GradScaler, the LR scheduler of `optimizer`) among the script frame's `values`;
    None for either not found: torch keeps no registry of either."""
    scaler = next((v for v in values if isinstance(v, torch.amp.GradScaler) and v.is_enabled()), None)
    scheduler = next((v for v in values if isinstance(v, torch.optim.lr_scheduler.LRScheduler)
                      and getattr(v, "optimizer", None) is optimizer), None)
    return scaler, scheduler


def _other_optimizers(first, model: torch.nn.Module | None, values: list[Any]) -> list:
    """The other optimizers among `values` (or in a list, tuple or dict among them) that update only
    parameters of `model` that `first` does not."""
    if model is None:
        return []
    found = [optimizer for optimizer in _optimizers_among(values) if optimizer is not first]
    model_params = {id(param) for param in model.parameters()}
    taken = {id(param) for param in params_of(first)}
    return [optimizer for optimizer in found
            if (ids := {id(param) for param in params_of(optimizer)}) and ids <= model_params and not ids & taken]
