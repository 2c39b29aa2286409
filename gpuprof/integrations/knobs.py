"""The knobs `gpuprof run --knob NAME` applies to a script nobody changed (gpuprof.diagnoses.knob).

Each knob changes the script's run through one of four doors, all undone when the script ends:
keyword defaults of a constructor the script calls (DataLoader, torch.optim), a global setting made
before the script runs, an environment variable, or the model once `gpuprof run` has found it (at the
script's first optimizer step, before recording starts). Every change is recorded as the edit a
user would make to their own script instead: keywords added to the call at its file and line, lines
after the imports or at the top, or lines before the script's statement that built the optimizer
(the model exists by then). The edits go to the run's meta.json (config.knobs), where
`gpuprof tune` reads them to write its diff; a knob that found nothing to change records none.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import sysconfig
from typing import Any, Callable

from gpuprof.diagnoses.knob import all_knobs
from gpuprof.errors import GpuprofError
from gpuprof.modules import eager_model
from gpuprof.numerics.watch import GPUPROF_DIR, TORCH_DIR

# Code outside the user's own files: a constructor called from there has no line of theirs to edit.
LIBRARY_DIRS = tuple(dict.fromkeys(
    [GPUPROF_DIR, TORCH_DIR, *(os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "purelib", "platlib"))]
))


def check_knobs(names) -> list[str]:
    known = all_knobs()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise GpuprofError(f"unknown knob {', '.join(unknown)}; choose from {', '.join(known)}")
    return list(dict.fromkeys(names))


class KnobPatches:
    """The knobs of one `gpuprof run`: installed before the script runs, shown the model once found, removed at the end.

    `applied` (knob name -> its edits, in order) is the dict meta.json's config.knobs holds."""

    def __init__(self, names, script: str):
        self.script = os.path.abspath(script)
        self.applied: dict[str, list[dict]] = {name: [] for name in check_knobs(names)}
        self._undo: list[Callable[[], None]] = []
        self.model_changes: list[tuple[str, Callable]] = []
        self._optimizer_site: tuple[str, int] | None = None

    def install(self) -> None:
        knobs = all_knobs()
        for name in self.applied:
            knobs[name].apply(KnobPatch(name, self))
        if self.model_changes:
            self._watch_optimizer_construction()

    def model_found(self, model) -> None:
        """Applies the knobs that change the model (the script's first optimizer step is under way)."""
        name = _variable_name(model) or "model"
        for knob_name, change in self.model_changes:
            code = change(model)
            if code is not None and self._optimizer_site is not None:
                file, line = self._optimizer_site
                lines = [part.format(model=name) for part in code.splitlines()]
                self.record(knob_name, {"kind": "before", "file": file, "line": line, "code": lines})
            elif code is not None:
                self.record(knob_name, {"kind": "note", "text": code.format(model=name)})

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()

    def undo_later(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def record(self, knob_name: str, edit: dict) -> None:
        if edit not in self.applied[knob_name]:
            self.applied[knob_name].append(edit)

    def replace(self, owner, attribute: str, value) -> None:
        original = owner.__dict__[attribute]
        setattr(owner, attribute, value)
        self.undo_later(lambda: setattr(owner, attribute, original))

    def _watch_optimizer_construction(self) -> None:
        """Where the script builds its first optimizer: model changes go on the lines before it."""
        import torch

        original = torch.optim.Optimizer.__init__

        @functools.wraps(original)
        def __init__(optimizer, *args, **kwargs):
            if self._optimizer_site is None:
                self._optimizer_site = _frame_in(self.script)
            original(optimizer, *args, **kwargs)

        self.replace(torch.optim.Optimizer, "__init__", __init__)


class KnobPatch:
    """What one knob may do to the run (see the module's docstring); every change is recorded as an edit."""

    def __init__(self, name: str, patches: KnobPatches):
        self.name = name
        self._patches = patches

    def keywords(self, cls: type, choose: Callable[[inspect.BoundArguments], dict[str, Any]]) -> None:
        """`cls(...)` calls get the keywords `choose(bound_arguments)` returns (none: the call is left as it is)."""
        original = cls.__dict__["__init__"]
        signature = inspect.signature(original)

        @functools.wraps(original)
        def __init__(instance, *args, **kwargs):
            try:
                chosen = choose(signature.bind(instance, *args, **kwargs))
            except TypeError:  # a call the constructor itself will reject, as without the knob
                chosen = {}
            if chosen:
                kwargs.update(chosen)
                self._patches.record(self.name, _keywords_edit(cls.__name__, chosen))
            original(instance, *args, **kwargs)

        self._patches.replace(cls, "__init__", __init__)

    def setting(self, apply: Callable[[], Callable[[], None]], code: str) -> None:
        """Makes a global setting now (`apply` returns its undo); the edit puts `code` after the script's imports."""
        self._patches.undo_later(apply())
        self._patches.record(self.name, {"kind": "after_imports", "file": self._patches.script, "code": code.splitlines()})

    def environment(self, name: str, value: str, code: str) -> None:
        """Sets an environment variable (torch reads those it knows when it first needs them); the edit puts
        `code` at the top of the script, before its imports."""
        before = os.environ.get(name)
        os.environ[name] = value
        self._patches.undo_later(lambda: os.environ.pop(name, None) if before is None else os.environ.update({name: before}))
        self._patches.record(self.name, {"kind": "top", "file": self._patches.script, "code": code.splitlines()})

    def model(self, change: Callable[[Any], str | None]) -> None:
        """`change(model)` runs on the model once found, before recording starts; it returns the code that
        makes the same change (`{model}` for the script's name of the model), or None when there was nothing to do."""
        self._patches.model_changes.append((self.name, change))


def _keywords_edit(call: str, chosen: dict) -> dict:
    file, line = _site()
    edit = {"kind": "keywords", "call": call, "file": file, "line": line,
            "keywords": {key: repr(value) for key, value in chosen.items()}}
    if file.startswith(LIBRARY_DIRS):
        edit["library"] = True  # built inside a library: its own arguments pass the setting through
    return edit


def _site() -> tuple[str, int]:
    """The innermost calling frame outside gpuprof and torch: where the script (or a library it uses) made the call."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith((GPUPROF_DIR, TORCH_DIR, "<")):
        frame = frame.f_back
    return (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("<unknown>", 0)


def _frame_in(path: str) -> tuple[str, int] | None:
    """The innermost calling frame in the file `path`, as (path, line)."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) != path:
        frame = frame.f_back
    return (path, frame.f_lineno) if frame is not None else None


def _variable_name(model) -> str | None:
    """The name the script's frames give the model (or a wrapper of it: DDP, torch.compile)."""
    frame = sys._getframe(1)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(LIBRARY_DIRS + ("<",)):
            for scope in (frame.f_locals, frame.f_globals):
                for name, value in list(scope.items()):
                    if value is model or (_is_module(value) and eager_model(value) is eager_model(model)):
                        return name
        frame = frame.f_back
    return None


def _is_module(value) -> bool:
    import torch

    return isinstance(value, torch.nn.Module)
