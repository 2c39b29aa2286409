"""The user's own code: which frames of a stack are the loop's, and how a place in it is named.

User code is every Python file outside the standard library, installed packages (site-packages),
torch and gpuprof itself (gpuprof's reference workload excepted: under `gpuprof train` that loop is
the user's). The stack sampler (gpuprof.capture.stack_sampler) and the search for the calls that feed the
model (gpuprof.capture.producers) both read stacks through here.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from types import CodeType, FrameType

import torch

_GPUPROF_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_WORKLOADS_DIR = os.path.join(_GPUPROF_DIR, "workloads") + os.sep
_LIBRARY_DIRS = tuple(sorted({
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, _GPUPROF_DIR,
    *(os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib", "purelib", "platlib")),
}))
# Where a package lives wherever it was installed (another environment's site-packages on sys.path)
_PACKAGE_MARKERS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
MAX_USER_FRAMES = 8  # the most user frames read from one stack, innermost first


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):  # <frozen ...>, <string>, <stdin>
        return False
    path = os.path.abspath(filename)
    if path.startswith(_WORKLOADS_DIR):
        return True
    return not path.startswith(_LIBRARY_DIRS) and not any(marker in path for marker in _PACKAGE_MARKERS)


def is_user_code(code: CodeType) -> bool:
    return is_user_file(code.co_filename)


def user_frames(frame: FrameType | None, limit: int = MAX_USER_FRAMES) -> list[FrameType]:
    """The user frames of the stack ending at `frame`, innermost first, at most `limit`."""
    found = []
    while frame is not None and len(found) < limit:
        if is_user_code(frame.f_code):
            found.append(frame)
        frame = frame.f_back
    return found


def function_site(frame: FrameType, by_line: bool = False) -> tuple[str, str, int]:
    """(function, file, line) naming a frame: a function by its definition line; code at a module's top level
    (a script's loop), or any frame `by_line`, by the line it runs."""
    code = frame.f_code
    name = code.co_qualname if sys.version_info >= (3, 11) else code.co_name
    if by_line or code.co_name == "<module>":
        return name, code.co_filename, int(frame.f_lineno or 0)
    return name, code.co_filename, code.co_firstlineno
