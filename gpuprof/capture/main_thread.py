"""A function run on the main thread, between two of its bytecodes, at another thread's request.

CPython runs its "pending calls" (`Py_AddPendingCall`, where Python's signal handlers are run too) on the main
thread at its next check of the eval breaker: between two bytecodes, holding the GIL, never inside a C call (a
request made while the thread is in one waits until the call returns). No signal is sent, so no system call of
the thread is interrupted. The stack sampler reads the training thread's stack this way, from inside the thread:
on CPython 3.11 reading another thread's frames from outside can crash the process, by walking `f_back` of
frames that thread frees meanwhile, or by faulthandler's dump of every thread meeting a thread state that a C
thread is half way through making (both seen here: SIGSEGV in `f_back`, and in a dump during FSDP2's gloo
collectives).
"""

from __future__ import annotations

import collections
import ctypes
import logging
from typing import Callable

from gpuprof.torch_compat import run_eagerly

logger = logging.getLogger("gpuprof")

_PENDING_CALL = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_queued: collections.deque[Callable[[], None]] = collections.deque()


def _run_one(_argument) -> int:
    """One queued function, on the main thread. Never raises: an error here would be raised in the user's code."""
    try:
        function = _queued.popleft()
        function()
    except Exception as error:  # noqa: BLE001 - nothing may reach the thread it interrupted
        logger.debug("gpuprof: a call on the main thread failed: %r", error)
    return 0


# kept out of torch.compile's tracing: it may interrupt compiled code, whose frame evaluation dynamo watches
_run_queued = _PENDING_CALL(run_eagerly(_run_one))


def _add_pending_call():
    """CPython's Py_AddPendingCall, called holding the GIL; None where this interpreter has none (not CPython)."""
    try:
        return ctypes.PYFUNCTYPE(ctypes.c_int, _PENDING_CALL, ctypes.c_void_p)(("Py_AddPendingCall", ctypes.pythonapi))
    except (AttributeError, OSError):
        return None


_ADD_PENDING_CALL = _add_pending_call()


def available() -> bool:
    return _ADD_PENDING_CALL is not None


def call_on_main_thread(function: Callable[[], None]) -> bool:
    """Queues `function` to run once on the main thread at its next bytecode; False where it could not be (CPython's
    queue of pending calls full, or no such queue)."""
    if _ADD_PENDING_CALL is None:
        return False
    _queued.append(function)
    if _ADD_PENDING_CALL(_run_queued, None) == 0:
        return True
    try:
        _queued.remove(function)
    except ValueError:  # already run: another thread's pending call took it
        pass
    return False
