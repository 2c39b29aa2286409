"""The user's own code in Python stacks: which frames are the loop's, how a place in it is named, and
every thread's stack read from another thread.

User code is every Python file outside the standard library, installed packages (site-packages),
torch and gpuprof itself (gpuprof's reference workload excepted: under `gpuprof train` that loop is
the user's). The stack sampler (gpuprof.capture.stack_sampler), the search for the calls that feed the
model (gpuprof.capture.producers) and the hang watchdog (gpuprof.capture.watchdog) read stacks through here.

A thread's stack as the watchdog keeps it is a list of frames, outermost first, each {"file", "line",
"function", "code"}; `where` sums one up as a person would: the innermost frame of the user's own code,
and what it calls ("read_next_shard (train.py:31): time.sleep(3600)").
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
import traceback
import threading
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
FRAMES_KEPT = 40  # innermost frames of each thread's stack: a deep recursion must not make an event huge
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):  # <frozen ...>, <string>, <stdin>
        return False
    path = os.path.abspath(filename)
    if path.startswith(_WORKLOADS_DIR):
        return True
    return not path.startswith(_LIBRARY_DIRS) and not any(marker in path for marker in _PACKAGE_MARKERS)


def raised_at(error: BaseException) -> str | None:
    """The user's own line an exception was raised from, "function (file:line)": the innermost frame of user
    code in its traceback (a library's frames below it are how, not where); None without one."""
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if is_user_file(frame.filename)]
    if not frames:
        return None
    return f"{frames[-1].name} ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"


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


def frame_list(frame) -> list[dict]:
    frames = []
    while frame is not None and len(frames) < FRAMES_KEPT:
        code, line = frame.f_code, frame.f_lineno  # None while a frame runs an instruction of no line
        frames.append({"file": code.co_filename, "line": line, "function": code.co_name,
                       "code": linecache.getline(code.co_filename, line).strip() if line is not None else ""})
        frame = frame.f_back
    return frames[::-1]


def thread_stacks() -> list[dict]:
    """Every thread's stack, the main thread first: [{"thread", "main", "daemon", "frames"}]."""
    threads = {thread.ident: thread for thread in threading.enumerate()}
    main_ident = threading.main_thread().ident
    stacks = []
    for ident, frame in sys._current_frames().items():
        thread = threads.get(ident)
        stacks.append({"thread": thread.name if thread else str(ident), "main": ident == main_ident,
                       "daemon": bool(thread and thread.daemon), "frames": frame_list(frame)})
    return sorted(stacks, key=lambda stack: not stack["main"])


def main_thread_frames() -> list[dict]:
    frame = sys._current_frames().get(threading.main_thread().ident)
    return frame_list(frame) if frame is not None else []


def where(frames: list[dict]) -> str | None:
    """The innermost user frame and the line it runs ("read_next_shard (train.py:31): time.sleep(3600)");
    the innermost frame when the stack holds no user code; None for an empty stack."""
    if not frames:
        return None
    frame = next((f for f in reversed(frames) if is_user_file(f["file"])), frames[-1])
    text = f"{frame['function']} ({os.path.basename(frame['file'])}:{frame['line']})"
    return f"{text}: {frame['code']}" if frame["code"] else text


def collective_call(frames: list[dict]) -> str | None:
    """The torch.distributed function (all_reduce, barrier, ...) the stack is in, if any."""
    return next((f["function"] for f in reversed(frames) if f["file"].endswith(_C10D_FILE)), None)
