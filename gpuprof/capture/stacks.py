"""The Python stack of every thread of this process, read from another thread (sys._current_frames).

A stack is a list of frames, outermost first, each {"file", "line", "function", "code"}. `where`
sums up one stack as a person would: the innermost frame of the user's own code, and what it calls
("read_next_shard (train.py:31): time.sleep(3600)").
"""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import threading

import torch

import gpuprof

FRAMES_KEPT = 40  # innermost frames of each stack: a deep recursion must not make an event huge
# Code that is not the user's: the standard library, installed packages, torch and gpuprof itself.
_LIBRARY_DIRS = tuple(os.path.dirname(path) + os.sep for path in (torch.__file__, gpuprof.__file__)) + tuple(
    {os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "platstdlib", "purelib", "platlib")})


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


def is_user_code(frame: dict) -> bool:
    file = frame["file"]
    return not file.startswith("<") and not file.startswith(_LIBRARY_DIRS)


def where(frames: list[dict]) -> str | None:
    """The innermost user frame and the line it runs ("read_next_shard (train.py:31): time.sleep(3600)");
    the innermost frame when the stack holds no user code; None for an empty stack."""
    if not frames:
        return None
    frame = next((f for f in reversed(frames) if is_user_code(f)), frames[-1])
    text = f"{frame['function']} ({os.path.basename(frame['file'])}:{frame['line']})"
    return f"{text}: {frame['code']}" if frame["code"] else text


_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


def collective_call(frames: list[dict]) -> str | None:
    """The torch.distributed function (all_reduce, barrier, ...) the stack is in, if any."""
    return next((f["function"] for f in reversed(frames) if f["file"].endswith(_C10D_FILE)), None)
