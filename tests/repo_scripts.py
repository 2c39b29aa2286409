"""The repository's own scripts (benchmarks/, scripts/) loaded as modules, so that tests call their functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def load_script(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
