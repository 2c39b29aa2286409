"""How the script built its model, so that `gpuprof replay` builds it again from the command line.

Under `gpuprof run` every torch module made while the script runs keeps the arguments its class was called with
(by reference: `torch.nn.Module.__new__` sees them before the class's own `__init__`). When a replay bundle is
written, the model's recipe is made from them: its class by import path ("package.module:Class"), its arguments as
plain values (numbers, strings, None, lists, tuples, dicts, dtypes, dataclass configs, and other modules by their
own recipes). `gpuprof replay` imports those classes, from the folder it runs in and the script's folder, as a
Python started there would, and calls them. A class the script defines itself ("__main__:GPT") comes from the
script's definitions only (`script_definitions`: its imports, classes and functions, never the rest of its top
level, which trains). A bundle carries no code: it names classes, and only torch modules and dataclasses are
called. Where there is no recipe (an argument of another kind; a model built before gpuprof started, as with
`gpuprof.profile()` in the script), `replay_snippet` is the Python that replays the bundle: with the model pickled
beside it (`save_model`), which only the user may choose to unpickle, or, where it cannot be pickled, with the model
the user builds.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import os
import shlex
import sys
import types
import weakref
from typing import Any

import torch

# id(module) -> (a weak reference to it, the args and kwargs its class was called with); by id, not by the module:
# a module's own __hash__ may read attributes its __init__ has yet to set (torchmetrics' Metric)
_made: dict[int, tuple[weakref.ref, tuple, dict]] = {}
_recording = {"on": False, "script": None}
RECIPE, SNIPPET = "recipe", "python"  # the bundle's builder names: rebuilt from the recipe, or replayed from Python


class NoRecipe(Exception):
    """Why the model cannot be rebuilt from its recorded construction."""


def record_constructions(script: str) -> None:
    """From now on, remember each module's constructor arguments (`gpuprof run`, before `script` starts).
    The `__new__` stays once set: a slot removed again leaves torch modules unable to take arguments."""
    if "__new__" not in torch.nn.Module.__dict__:
        torch.nn.Module.__new__ = _remembering_new
    _recording.update(on=True, script=os.path.abspath(script))


def stop_recording() -> None:
    _recording["on"] = False


def _remembering_new(cls, *args, **kwargs):
    module = object.__new__(cls)
    if _recording["on"]:
        key = id(module)
        with contextlib.suppress(TypeError):  # a module class without weak references (__slots__)
            _made[key] = (weakref.ref(module, lambda _, key=key: _made.pop(key, None)), args, kwargs)
    return module


def builder_for(model: torch.nn.Module) -> dict[str, Any]:
    """The bundle's builder: {"name": "recipe", ...} to rebuild `model`, or {"name": "python", ...} with the names
    the snippet needs and why there is no recipe."""
    try:
        return {"name": RECIPE, "config": {"model": recipe(model), "paths": _paths(), "script": _script_path()}}
    except NoRecipe as why:
        return {"name": SNIPPET, "config": {"reason": str(why), "class": class_path(type(model)),
                                             "script": _script_path(), "paths": _paths(), "python": sys.executable}}


def recipe(module: torch.nn.Module) -> dict[str, Any]:
    made = _made.get(id(module))
    if made is None or made[0]() is not module:
        raise NoRecipe(f"{class_path(type(module))} was not built while gpuprof run recorded the script")
    _, args, kwargs = made
    return {"kind": "module", "class": _importable(type(module)), "args": [_plain(value) for value in args],
            "kwargs": {name: _plain(value) for name, value in kwargs.items()}}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.nn.Module):
        return recipe(value)
    if isinstance(value, torch.dtype):
        return {"kind": "dtype", "name": str(value).removeprefix("torch.")}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"kind": "dataclass", "class": _importable(type(value)),
                "fields": {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}}
    if isinstance(value, (list, tuple)):
        return {"kind": "tuple" if isinstance(value, tuple) else "list", "items": [_plain(item) for item in value]}
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {"kind": "dict", "items": {key: _plain(item) for key, item in value.items()}}
    raise NoRecipe(f"an argument of type {type(value).__name__} is not one a bundle can carry")


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _importable(cls: type) -> str:
    if cls.__module__ == "__main__" and _script_path() is None:
        raise NoRecipe(f"{cls.__qualname__} is defined in a __main__ that is no script file")
    if "<locals>" in cls.__qualname__:
        raise NoRecipe(f"{class_path(cls)} is defined inside a function")
    return class_path(cls)


def _paths() -> list[str]:
    """Where the script's own modules are imported from: its folder."""
    script = _script_path()
    return [os.path.dirname(script)] if script else []


def _script_path() -> str | None:
    """The script `gpuprof run` ran (also once it has returned: a bundle may be written at close), else the
    running program's."""
    main = sys.modules.get("__main__")
    return _recording["script"] or (os.path.abspath(main.__file__) if getattr(main, "__file__", None) else None)


# ---------------------------------------------------------------------------------------------- replay's side
def build(value: Any, script: str | None = None) -> Any:
    """What a recipe (or a plain value of one) describes, its classes imported and called (those of "__main__"
    from the definitions of `script`)."""
    if not isinstance(value, dict):
        return value
    kind = value.get("kind")

    def built(item):
        return build(item, script)

    if kind == "module":
        cls = import_class(value["class"], script)
        if not issubclass(cls, torch.nn.Module):
            raise NoRecipe(f"{value['class']} is not a torch module")
        return cls(*map(built, value["args"]), **{name: built(item) for name, item in value["kwargs"].items()})
    if kind == "dataclass":
        cls = import_class(value["class"], script)
        if not dataclasses.is_dataclass(cls):
            raise NoRecipe(f"{value['class']} is not a dataclass")
        return cls(**{name: built(item) for name, item in value["fields"].items()})
    if kind in ("list", "tuple"):
        return (list if kind == "list" else tuple)(map(built, value["items"]))
    if kind == "dict":
        return {name: built(item) for name, item in value["items"].items()}
    if kind == "dtype" and isinstance(getattr(torch, value["name"], None), torch.dtype):
        return getattr(torch, value["name"])
    raise NoRecipe(f"a recipe entry gpuprof cannot build: {value!r:.200}")


def import_class(path: str, script: str | None = None) -> type:
    module_name, _, qualname = path.partition(":")
    try:
        found: Any = script_definitions(script) if module_name == "__main__" else importlib.import_module(module_name)
        for name in qualname.split("."):
            found = getattr(found, name)
    except (ImportError, AttributeError, OSError, SyntaxError) as error:
        raise NoRecipe(f"cannot import {path} here ({type(error).__name__}: {error}); run gpuprof replay in the "
                       "script's folder, with its packages installed") from None
    if not isinstance(found, type):
        raise NoRecipe(f"{path} is not a class")
    return found


DEFINITIONS = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_definitions: dict[str, types.ModuleType] = {}


def script_definitions(script: str | None) -> types.ModuleType:
    """The script's top-level imports, classes and functions, run as a module of their own: what a class the script
    defines needs, without the rest of its top level (which trains). Once a script."""
    if script is None:
        raise ImportError("the bundle names no script for a class of __main__")
    if script not in _definitions:
        with open(script, encoding="utf-8") as file:
            tree = ast.parse(file.read(), script)
        tree.body = [node for node in tree.body if isinstance(node, DEFINITIONS)]
        module = types.ModuleType("__gpuprof_script__")
        module.__file__ = script
        sys.modules[module.__name__] = module  # dataclasses look their class's module up
        exec(compile(tree, script, "exec"), module.__dict__)  # noqa: S102 - the user's own script's definitions
        _definitions[script] = module
    return _definitions[script]


@contextlib.contextmanager
def importable_from(paths: list[str]):
    """The folder replay runs in, then the script's folders, first on sys.path (as `python SCRIPT` puts its own)."""
    saved = list(sys.path)
    sys.path[:0] = [os.getcwd(), *(path for path in paths if os.path.isdir(path))]
    try:
        yield
    finally:
        sys.path[:] = saved


def replay_snippet(bundle: str, config: dict[str, Any]) -> str:
    """The Python that replays `bundle`, the real names filled in: with the model pickled beside it where it could
    be (`save_model`), else with the model the user builds as the script does."""
    module_name, _, qualname = str(config.get("class") or "?:Model").partition(":")
    if config.get("model_file"):
        build_lines = ["import torch", f"model = torch.load({config['model_file']!r}, weights_only=False)  # your "
                       "run's own model, pickled: load only a file you trust"]
    else:
        build_lines = [*([] if module_name == "__main__" else [f"from {module_name} import {qualname.split('.')[0]}"]),
                       f"model = ...  # a {qualname}, built as {config.get('script') or 'the script'} builds it"]
    python = shlex.quote(config.get("python") or "python")  # the one that trained: gpuprof and the model's packages
    return "\n".join([
        f"{python} - <<'EOF'", "import sys", *(f"sys.path.insert(0, {path!r})" for path in config.get("paths") or []),
        "from gpuprof.numerics.blame import format_blame", "from gpuprof.numerics.replay import replay",
        *build_lines, f"blame, recorded = replay({bundle!r}, model=model)", "print(format_blame(blame))", "EOF"])


def save_model(model: torch.nn.Module, path: str) -> str | None:
    """`model` pickled whole at `path` (its classes by import path) for the snippet; None where it cannot be."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(model, path)
        return path
    except Exception:  # noqa: BLE001 - a module holding what pickle refuses: the snippet asks for the model
        with contextlib.suppress(OSError):
            os.remove(path)
        return None
