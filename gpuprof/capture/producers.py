"""What the step does besides the model: the calls that fetch its batches, and the evaluations in the loop.

Data time is defined by what the program does, wherever in the step it happens:
- every `next()` of a torch DataLoader's iterator (`DataLoaderWatch`, one class-level wrapper);
- every call of the user's own functions whose results become the model's inputs. At the first
  training call of the model, the user frames on the stack are read: the variables holding the
  model's input tensors (themselves, or a dict, tuple or list of them), and in the frame's source
  (`ast`) the statements that assign those variables. A call there of a Python function of the
  user's code (`X, Y = get_batch('train')`, `batch = loader.next_batch()`, `for X, Y in
  batches():`) is wrapped where the loop looks it up (the module's global, the module attribute,
  the method on its class): each call is then timed, a generator's per item;
- every item drawn from an iterator the loop holds by name (`next(train_loader)` of a generator
  object, an itertools chain, an iterator object, an IterableDataset's `iter()`), wherever the item
  is made. At the first training call, each iterator held by the loop's frames (their locals, their
  module's globals, the attributes of `self`) is rebound there to a thin iterator that delegates
  (`Drawn`: same items, same exceptions, `send`/`throw`/`close` and attributes forwarded); what it
  produces is noted, and at a later training call the one whose item the model was given is timed
  from then on (one perf_counter pair an item), the others put back.
The wrappers are removed, the names rebound to what they held, when the run closes.

An evaluation is a call made from the loop, of a user function or any other callable (a method of
the model: `model.generate(...)`, Hugging Face's or minGPT's), under which the model runs in
evaluation (nanoGPT's `estimate_loss()`): found at the first such call of each kind, from the stack
below the loop's frame, and wrapped the same way. Generation is evaluation.

Everything here runs at most once per model call before it is found, then never again.
"""

from __future__ import annotations

import ast
import ctypes
import functools
import inspect
import io
import itertools
import linecache
import sys
import threading
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import dataloader as _dataloader

from gpuprof.capture.usercode import is_user_code, user_frames
from gpuprof.torch_compat import private

MAX_ITEMS = 64  # the most items of one dict, tuple or list looked through for the model's inputs
ITERATION_WRAPPERS = ("enumerate", "iter", "zip", "tqdm", "islice")  # `for b in enumerate(f())` iterates f()


@dataclass(frozen=True)
class Found:
    """A user function gpuprof times: what it is called in the user's code, and where it was defined."""

    role: str  # "data" or "eval"
    function: str
    file: str
    line: int

    def to_dict(self) -> dict:
        return {"role": self.role, "function": self.function, "file": self.file, "line": self.line}


class Span:
    """Begin/end callbacks of one kind of span, counting nesting so only the outermost call is timed,
    and only on the training thread."""

    def __init__(self, begin: Callable[[], None], end: Callable[[], None],
                 produced: Callable[[Any], None] | None = None):
        self._begin, self._end, self._produced = begin, end, produced
        self._depth = 0
        self.thread = threading.get_ident()
        self.code: types.CodeType | None = None  # the user function the outermost call runs, where one is timed

    def calling(self, code: types.CodeType) -> "Span":
        """The span, entered as a call of the user function of `code` (named when it is the outermost)."""
        if self._depth == 0 and threading.get_ident() == self.thread:
            self.code = code
        return self

    def produced(self, value: Any) -> None:
        """What the outermost call returned (a batch), for the model call it may feed."""
        if self._produced is not None and self._depth == 1 and threading.get_ident() == self.thread:
            self._produced(value)

    def __enter__(self):
        if threading.get_ident() == self.thread:
            self._depth += 1
            if self._depth == 1:
                self._begin()
        return self

    def __exit__(self, *exc) -> None:
        if threading.get_ident() == self.thread:
            self._depth -= 1
            if self._depth == 0:
                self.code = None
                self._end()

    @property
    def open(self) -> bool:
        return self._depth > 0


# ---------------------------------------------------------------------------------------- DataLoader
_listeners: list[Span] = []
_original_next = None


def watch_dataloaders(span: Span) -> None:
    """Times every `next()` of any torch DataLoader iterator as `span` while it is watched."""
    global _original_next
    if _original_next is None:
        original = _original_next = _dataloader._BaseDataLoaderIter.__next__

        @functools.wraps(original)
        def __next__(iterator):
            spans = list(_listeners)
            for span in spans:
                span.__enter__()
            try:
                batch = original(iterator)
                for span in spans:
                    span.produced(batch)
                return batch
            finally:
                for span in reversed(spans):
                    span.__exit__()

        _dataloader._BaseDataLoaderIter.__next__ = __next__
    _listeners.append(span)


def unwatch_dataloaders(span: Span) -> None:
    global _original_next
    if span in _listeners:
        _listeners.remove(span)
    if not _listeners and _original_next is not None:
        _dataloader._BaseDataLoaderIter.__next__ = _original_next
        _original_next = None


# ---------------------------------------------------------------------------------------- wrapping
class Wrapped:
    """A user function replaced by a timing wrapper where the loop looks it up; `restore` puts it back."""

    def __init__(self, owner: Any, name: str, span: Span):
        self.owner, self.name = owner, name
        self.original = _lookup(owner, name)
        self.wrapper = _timing_wrapper(self.original, span)
        _store(owner, name, self.wrapper)

    def restore(self) -> None:
        if _lookup(self.owner, self.name) is self.wrapper:
            _store(self.owner, self.name, self.original)


def _lookup(owner: Any, name: str) -> Any:
    return owner[name] if isinstance(owner, dict) else inspect.getattr_static(owner, name)


def _store(owner: Any, name: str, value: Any) -> None:
    if isinstance(owner, dict):
        owner[name] = value
    else:
        setattr(owner, name, value)


def _timing_wrapper(function: Callable, span: Span) -> Callable:
    code = getattr(_innermost(function), "__code__", None)
    if inspect.isgeneratorfunction(_innermost(function)):
        @functools.wraps(function)
        def generator_wrapper(*args, **kwargs):
            items = function(*args, **kwargs)
            while True:
                with span.calling(code):
                    try:
                        item = next(items)
                    except StopIteration as stop:
                        return stop.value
                    span.produced(item)
                yield item

        return generator_wrapper

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with span.calling(code):
            result = function(*args, **kwargs)
            span.produced(result)
            return result

    return wrapper


def _innermost(function: Any) -> Any:
    """Through decorators (functools.wraps' __wrapped__, torch.no_grad's included) to the function defined."""
    for _ in range(8):
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            break
        function = inner
    return function


def user_function(value: Any) -> types.FunctionType | None:
    """The user's function behind `value` (a function, possibly decorated), else None."""
    inner = _innermost(value)
    if isinstance(inner, types.FunctionType) and is_user_code(inner.__code__):
        return inner
    return None


def found(role: str, value: Any, owner: Any = None, name: str | None = None) -> Found:
    """`value` named as the loop calls it (`get_batch`, `AutoregressiveWrapper.generate`), where it is defined: a
    decorator's inner function defined elsewhere stands for the function it holds of that name."""
    function = _innermost(value)
    if name is not None and function.__name__ != name:
        held = [cell.cell_contents for cell in function.__closure__ or () if _filled(cell)]
        function = next((item for item in held if isinstance(item, types.FunctionType) and item.__name__ == name),
                        function)
    code = function.__code__
    qualname = code.co_qualname if name is None or code.co_name == name else (
        f"{owner.__qualname__}.{name}" if isinstance(owner, type) else name)
    return Found(role, qualname, code.co_filename, code.co_firstlineno)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------- discovery
def model_inputs(args: tuple, kwargs: dict) -> set[int]:
    """The ids of the tensors a model call was given (at the top level of its arguments)."""
    values = [*args, *kwargs.values()]
    values += [item for value in values if isinstance(value, (tuple, list)) for item in value]
    values += [item for value in values if isinstance(value, Mapping) for item in value.values()]
    return {id(value) for value in values if isinstance(value, torch.Tensor)}


def _holds(value: Any, inputs: set[int]) -> bool:
    if isinstance(value, torch.Tensor):
        return id(value) in inputs
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    try:
        return any(isinstance(item, torch.Tensor) and id(item) in inputs for item in itertools.islice(items, MAX_ITEMS))
    except Exception:  # noqa: BLE001 - a Mapping of the user's whose iteration fails
        return False


def find_producers(frame: types.FrameType, inputs: set[int]) -> list[tuple[Any, str, Any]]:
    """(owner, name, value) of each user function whose results the model was just given, over the user frames
    of the stack from `frame` outward."""
    bindings = []
    for depth, user_frame in enumerate(user_frames(frame)):
        scope = user_frame.f_locals
        names = {name for name, value in scope.items() if _holds(value, inputs)}
        sources = _assigned_from(user_frame.f_code, names) if names else []
        if depth == 0:  # the frame calling the model: `model(get_batch())` too
            sources += _called_in_arguments(user_frame.f_code, user_frame.f_lineno)
        for expression in sources:
            bindings += _bindings(expression, user_frame)
    unique = {(id(owner), name): (owner, name, value) for owner, name, value in bindings}
    return list(unique.values())


def _called_in_arguments(code: types.CodeType, line: int | None) -> list[ast.expr]:
    """The calls the statement running at `line` makes inside another call's arguments (`get_batch()` in
    `model(get_batch())`, `next_inputs()` in `model(**next_inputs())`)."""
    node = _code_node(code)
    if node is None or line is None:
        return []
    running = [statement for statement in _own_nodes(node) if isinstance(statement, ast.stmt)
               and statement.lineno <= line <= (statement.end_lineno or statement.lineno)]
    if not running:
        return []
    statement = min(running, key=lambda found: (found.end_lineno or found.lineno) - found.lineno)
    calls = [call for call in ast.walk(statement) if isinstance(call, ast.Call)]
    arguments = [argument for call in calls for argument in (*call.args, *(keyword.value for keyword in call.keywords))]
    return [argument.value if isinstance(argument, ast.Starred) else argument for argument in arguments]


def _assigned_from(code: types.CodeType, names: set[str]) -> list[ast.expr]:
    """The expressions the statements of `code` assign to any of `names` (a for loop: what it iterates)."""
    node = _code_node(code)
    if node is None:
        return []
    sources = []
    for statement in _own_nodes(node):
        if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and statement.value is not None:
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if names & {name for target in targets for name in _target_names(target)}:
                sources.append(statement.value)
        elif isinstance(statement, (ast.For, ast.AsyncFor)) and names & set(_target_names(statement.target)):
            sources.append(_iterated(statement.iter))
    return sources


def _target_names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [name for element in target.elts for name in _target_names(element)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return []


def _iterated(expression: ast.expr) -> ast.expr:
    """`enumerate(batches())` iterates `batches()`."""
    while (isinstance(expression, ast.Call) and expression.args and isinstance(expression.func, ast.Name)
           and expression.func.id in ITERATION_WRAPPERS):
        expression = expression.args[0]
    return expression


@functools.lru_cache(maxsize=64)
def _parsed(filename: str) -> ast.Module | None:
    try:
        return ast.parse("".join(linecache.getlines(filename)), filename)
    except (SyntaxError, ValueError):
        return None


def _code_node(code: types.CodeType) -> ast.AST | None:
    """The syntax tree of `code`: its file's module, or the function defined at its first line."""
    module = _parsed(code.co_filename)
    if module is None or code.co_name == "<module>":
        return module
    for node in ast.walk(module):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == code.co_name:
            first_lines = {node.lineno, *(decorator.lineno for decorator in node.decorator_list)}
            if code.co_firstlineno in first_lines:
                return node
    return None


def _own_nodes(node: ast.AST):
    """The nodes of a function or module body, not those of the functions and classes it defines."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield child
        yield from _own_nodes(child)


def _bindings(expression: ast.expr, frame: types.FrameType) -> list[tuple[Any, str, Any]]:
    """Where the user function called by `expression` is looked up: (owner, name, value), owner being the
    frame's globals, a module, or the class defining the method."""
    if not isinstance(expression, ast.Call):
        return []
    func = expression.func
    if isinstance(func, ast.Name):
        if func.id in frame.f_globals and (frame.f_code.co_name == "<module>" or func.id not in frame.f_locals):
            value = frame.f_globals[func.id]
            return [(frame.f_globals, func.id, value)] if user_function(value) else []
        return []
    if isinstance(func, ast.Attribute):
        owner = _value_of(func.value, frame)
        return _attribute_binding(owner, func.attr)
    return []


_MISSING = object()


def _value_of(expression: ast.expr, frame: types.FrameType) -> Any:
    """The object a Name or attribute chain names in `frame`, read without running user code (no properties)."""
    if isinstance(expression, ast.Name):
        for scope in (frame.f_locals, frame.f_globals):
            if expression.id in scope:
                return scope[expression.id]
        return _MISSING
    if isinstance(expression, ast.Attribute):
        owner = _value_of(expression.value, frame)
        if owner is _MISSING:
            return _MISSING
        try:
            value = inspect.getattr_static(owner, expression.attr)
        except AttributeError:
            return _MISSING
        return value if not isinstance(value, (property, types.GetSetDescriptorType)) else _MISSING
    return _MISSING


def _attribute_binding(owner: Any, name: str) -> list[tuple[Any, str, Any]]:
    if owner is _MISSING:
        return []
    if isinstance(owner, types.ModuleType):
        value = getattr(owner, name, None)
        return [(owner, name, value)] if user_function(value) else []
    instance_value = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
    if instance_value is not _MISSING:
        return [(owner, name, instance_value)] if user_function(instance_value) and not isinstance(owner, type) else []
    for cls in type(owner).__mro__:
        value = vars(cls).get(name, _MISSING)
        if value is not _MISSING:
            return [(cls, name, value)] if user_function(value) else []
    return []


MODULE_CALLS = {getattr(private(name), "__code__", None)
                for name in ("torch.nn.Module._wrapped_call_impl", "torch.nn.Module._call_impl")}


def call_stack(frame: types.FrameType | None) -> tuple[types.CodeType, ...]:
    """The codes of the stack ending at `frame`, outermost first, down to the outermost module call (a model's
    `__call__`): what runs the model, not what runs inside it."""
    codes = []
    while frame is not None:
        codes.append(frame.f_code)
        frame = frame.f_back
    codes.reverse()
    end = next((index for index, code in enumerate(codes) if code in MODULE_CALLS), len(codes))
    return tuple(codes[:end])


def find_evaluator(eval_stack: tuple[types.CodeType, ...], loop_codes: set[types.CodeType],
                   training_stack: set[types.CodeType], frames: list[types.FrameType]) -> tuple[Any, str, Any] | None:
    """The callable the loop called to evaluate: in an evaluation call's stack (`eval_stack`, outermost first), the
    outermost code below the loop's innermost frame on it that the training call's stack does not run and that the
    loop, one of whose `frames` runs now, looks up (a user function, or any method: `model.generate`); with where it
    looks it up. None when the loop calls the model in evaluation itself."""
    at = max((index for index, code in enumerate(eval_stack) if code in loop_codes), default=None)
    caller = next((frame for frame in frames if frame.f_code is eval_stack[at]), None) if at is not None else None
    if caller is None:
        return None
    for code in eval_stack[at + 1:]:
        if code not in training_stack:
            binding = _binding_of_code(code, caller)
            if binding is not None:
                return binding
    return None


def _binding_of_code(code: types.CodeType, caller: types.FrameType) -> tuple[Any, str, Any] | None:
    """Where `caller` finds the function running `code`: a global of its module, or a method of the class of
    one of its local objects."""
    for name, value in caller.f_globals.items():
        if _runs(value, code):
            return caller.f_globals, name, value
    for value in list(caller.f_locals.values()):
        for cls in type(value).__mro__[:-1]:
            for name, member in vars(cls).items():
                if _runs(member, code):
                    return cls, name, member
    return None


def _runs(value: Any, code: types.CodeType) -> bool:
    """`value` is a function (possibly decorated) whose own code is `code`."""
    inner = _innermost(value)
    return isinstance(inner, types.FunctionType) and inner.__code__ is code


# ---------------------------------------------------------------------------------------- iterators drawn by name
class Place:
    """Where the loop looks a name up: a dict (a module's globals), an object's attribute, or a function frame's local
    (written back to the frame: `f_locals` is a snapshot before Python 3.13)."""

    def __init__(self, owner: Any, name: str, frame: types.FrameType):
        self.owner, self.name = owner, name
        self.code, self.line = frame.f_code, frame.f_lineno or 0  # the loop's code reading the name

    @property
    def site(self) -> tuple[str, int]:
        """The first line of the loop's code reading the name (`next(stream)`), else the line it ran."""
        node = _code_node(self.code)
        lines = [child.lineno for child in (_own_nodes(node) if node is not None else ())
                 if isinstance(child, ast.Name) and child.id == self.name and isinstance(child.ctx, ast.Load)]
        return self.code.co_filename, min(lines, default=self.line)

    def get(self) -> Any:
        if isinstance(self.owner, types.FrameType):
            return self.owner.f_locals.get(self.name, _MISSING)
        return self.owner.get(self.name, _MISSING) if isinstance(self.owner, dict) else vars(self.owner).get(
            self.name, _MISSING)

    def set(self, value: Any) -> None:
        if isinstance(self.owner, types.FrameType):
            self.owner.f_locals[self.name] = value
            if sys.version_info < (3, 13):
                ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(self.owner), ctypes.c_int(0))
        else:
            _store(self.owner, self.name, value)


class DrawnIterator:
    """What the loop's name holds while gpuprof watches: the original iterator's items, exceptions and methods."""

    __slots__ = ("_gpuprof_drawn",)

    def __init__(self, drawn: "Drawn"):
        self._gpuprof_drawn = drawn

    def __iter__(self):
        return self

    def __next__(self):
        drawn = self._gpuprof_drawn
        return drawn.draw(next, drawn.original)

    def send(self, value):
        drawn = self._gpuprof_drawn
        return drawn.draw(drawn.original.send, value)

    def throw(self, *args):
        return self._gpuprof_drawn.original.throw(*args)

    def close(self):
        return self._gpuprof_drawn.original.close()

    def __getattr__(self, name: str):
        return getattr(self._gpuprof_drawn.original, name)

    def __repr__(self) -> str:
        return repr(self._gpuprof_drawn.original)


class Drawn:
    """An iterator of the loop's rebound to a DrawnIterator: `probing`, it notes the tensors of the item it last
    produced; `timed`, each item is timed as `span`; `off` (put back, or the run closed), it only delegates."""

    def __init__(self, place: Place, span: Span):
        self.place, self.span = place, span
        self.original = place.get()
        self.state = "probing"
        self.last: set[int] = set()
        self.proxy = DrawnIterator(self)
        place.set(self.proxy)

    def draw(self, produce: Callable, argument: Any) -> Any:
        if self.state == "timed":
            with self.span.calling(self.code):
                item = produce(argument)
                self.span.produced(item)
            return item
        item = produce(argument)
        if self.state == "probing":
            self.last = model_inputs((item,), {})
        return item

    def restore(self) -> None:
        self.state = "off"
        try:
            if self.place.get() is self.proxy:
                self.place.set(self.original)
        except Exception:  # noqa: BLE001 - a frame gone, an object that refuses: the proxy only delegates now
            pass

    @functools.cached_property
    def code(self) -> types.CodeType | None:
        """The user code an item is drawn from: the generator's function, or the iterator's own `__next__`."""
        return getattr(self.original, "gi_code", None) or getattr(_user_next(self.original), "__code__", None)

    def found(self) -> Found:
        """The generator's function (`cycle (train.py:27)`), else the name the loop draws from, where it uses it."""
        code = self.code
        if code is not None:
            return Found("data", code.co_qualname, code.co_filename, code.co_firstlineno)
        return Found("data", f"{self.place.name} ({type(self.original).__qualname__})", *self.place.site)



def _user_next(iterator: Any) -> Any:
    function = vars(type(iterator)).get("__next__")
    return function if isinstance(function, types.FunctionType) and is_user_code(function.__code__) else None


def drawable(value: Any) -> bool:
    """An iterator the loop may draw its batches from by name: not a DataLoader's (timed as such), a file, or one
    gpuprof put there."""
    return (isinstance(value, Iterator) and not isinstance(value, (_dataloader._BaseDataLoaderIter, DrawnIterator,
                                                                   io.IOBase)))


def draw_places(frames: list[types.FrameType]) -> list[Place]:
    """Each place a loop frame (innermost first) can look up an iterator by name: its locals, its module's globals,
    the attributes of its `self`."""
    places, seen = [], set()
    for frame in frames:
        scopes = [(frame.f_globals, frame.f_globals)]
        if frame.f_code.co_name != "<module>":
            scopes.append((frame, frame.f_locals))
            owner = frame.f_locals.get("self")
            if owner is not None and hasattr(owner, "__dict__") and not isinstance(owner, type):
                scopes.append((owner, vars(owner)))
        for owner, scope in scopes:
            for name, value in list(scope.items()):
                key = (id(owner), name)
                if key not in seen and drawable(value):
                    seen.add(key)
                    places.append(Place(owner, name, frame))
    return places
