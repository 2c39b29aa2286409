"""Stacks read from another thread: every thread's frames, each user frame named by its function's own code."""

from __future__ import annotations

import threading

from gpuprof.capture.usercode import function_site, main_thread_frames, thread_stacks, thread_user_frames


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


def test_another_threads_user_frames_are_named_by_their_own_code():
    thread, release = _waiting_thread()
    try:
        frames = thread_user_frames(thread.ident)
    finally:
        release.set()
        thread.join()
    assert [function_site(frame)[0] for frame in frames] == ["Reader.wait_inside.<locals>.nested", "Reader.wait_inside"]
    nested, caller = frames
    assert function_site(nested) == ("Reader.wait_inside.<locals>.nested", __file__, Reader.wait_inside.__code__.co_firstlineno + 1)
    assert function_site(caller, by_line=True)[2] == Reader.wait_inside.__code__.co_firstlineno + 5  # nested()


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


def test_a_thread_running_no_python_has_no_user_frames():
    assert thread_user_frames(-1) is None
