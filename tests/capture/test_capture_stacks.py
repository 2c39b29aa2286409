"""Stacks: the training thread's own, read inside it at another thread's request; every thread's, read by the
watchdog from outside."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import gpuprof
from gpuprof.capture.main_thread import call_on_main_thread
from gpuprof.capture.usercode import main_thread_frames, thread_stacks


class Reader:
    def wait_inside(self, ready: threading.Event, release: threading.Event) -> None:
        def nested():
            ready.set()
            release.wait(30)

        nested()


def _waiting_thread():
    ready, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=Reader().wait_inside, args=(ready, release), name="reader", daemon=True)
    thread.start()
    assert ready.wait(30)
    return thread, release


def _stack_here() -> list[tuple[str, int]]:
    """The stack of the thread it runs on, innermost first: (function, line)."""
    frame, stack = sys._getframe(), []
    while frame is not None:
        stack.append((frame.f_code.co_name, frame.f_lineno))
        frame = frame.f_back
    return stack


def _ask_later(delay_s: float, taken: list) -> threading.Thread:
    def ask():
        time.sleep(delay_s)
        assert call_on_main_thread(lambda: taken.append((time.monotonic(), _stack_here())))

    thread = threading.Thread(target=ask)
    thread.start()
    return thread


def test_a_call_asked_from_another_thread_runs_on_the_main_thread_at_the_line_it_runs():
    taken: list = []
    asker = _ask_later(0.05, taken)
    deadline = time.monotonic() + 30
    while not taken and time.monotonic() < deadline:
        spin_line = sys._getframe().f_lineno
    asker.join()
    (_, stack), = taken
    here = sys._getframe().f_code.co_name
    line = next(line for function, line in stack if function == here)
    assert line in (spin_line - 1, spin_line), stack


def test_a_call_asked_during_a_c_call_runs_when_it_returns_at_the_line_that_made_it():
    taken: list = []
    started = time.monotonic()
    asker = _ask_later(0.05, taken)
    time.sleep(0.4); sleep_line = sys._getframe().f_lineno  # noqa: E702 - the line the call is answered at
    asker.join()
    (answered, stack), = taken
    here = sys._getframe().f_code.co_name
    line = next(line for function, line in stack if function == here)
    assert answered - started >= 0.4 and line == sleep_line, stack


def test_every_threads_stack_is_listed_main_first_with_its_code():
    thread, release = _waiting_thread()
    try:
        stacks = thread_stacks()
        main = main_thread_frames()
    finally:
        release.set()
        thread.join()
    here = "test_every_threads_stack_is_listed_main_first_with_its_code"
    assert stacks[0]["main"] and here in [frame["function"] for frame in stacks[0]["frames"]]
    assert next(frame for frame in main if frame["function"] == here)["code"] == "main = main_thread_frames()"
    reader = next(stack for stack in stacks if stack["thread"] == "reader")
    functions = [frame["function"] for frame in reader["frames"]]
    at = functions.index("wait_inside")
    assert reader["daemon"] and functions[at + 1:] == ["nested", "wait", "wait"]  # Event.wait, then Condition.wait
    assert reader["frames"][at + 1]["code"] == "release.wait(30)"


# C threads entering Python make and free their thread states (as gloo's do, dropping the last reference to a
# tensor); faulthandler's dump of every thread, sampling as often, crashed CPython 3.11 in one run of three.
CHURNING_LOOP = textwrap.dedent("""
    import ctypes, sys, threading, time
    import torch
    import gpuprof

    START = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    enter_python = START(lambda argument: None)
    libc = ctypes.CDLL(None)
    libc.pthread_create.argtypes = [ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, START, ctypes.c_void_p]
    libc.pthread_join.argtypes = [ctypes.c_ulong, ctypes.c_void_p]
    done = threading.Event()

    def churn():
        while not done.is_set():
            threads = [ctypes.c_ulong() for _ in range(8)]
            for thread in threads:
                libc.pthread_create(ctypes.byref(thread), None, enter_python, None)
            for thread in threads:
                libc.pthread_join(thread.value, None)

    def get_batch():
        time.sleep(0.02)
        return torch.randn(8, 16)

    threading.Thread(target=churn, daemon=True).start()
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with gpuprof.profile(sys.argv[1], model=model, optimizer=optimizer, stack_interval_s=0.002) as prof:
        for step in range(120):
            batch = get_batch()
            loss = model(batch).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    done.set()
""")


def test_the_stack_sampler_survives_c_threads_making_thread_states_and_weighs_a_wait_by_its_length(tmp_path):
    script = tmp_path / "churning_loop.py"
    script.write_text(CHURNING_LOOP)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stacks = gpuprof.load_run(tmp_path / "run").stacks
    in_sleep = stacks[stacks["inner_function"] == "get_batch"]
    # each 20 ms sleep is answered once, after it, with one row per interval it took: 2 ms, or up to 4 times that
    # where a sample costs more than its budget
    assert in_sleep.groupby("step").size().median() >= 20 / (4 * 2), stacks.groupby(["step", "inner_function"]).size()
    assert in_sleep.groupby("step")["time_unix_s"].nunique().median() >= 20 / (4 * 2)  # each at its own interval
    assert set(in_sleep[in_sleep["step"] > in_sleep["step"].min()]["phase"]) == {"data"}  # the first: before the
    # first model call shows what feeds the model
