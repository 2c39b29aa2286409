"""Real `gpuprof dashboard` servers for the tests, which always stop: each runs in a process group of its own
(a Ctrl-C at the terminal, meant for pytest, does not reach it), the test stops it with its own Ctrl-C, and
teardown, or at the latest the interpreter's exit, kills the whole group whatever happened; a pytest killed
outright (SIGKILL: no teardown, no exit handlers) takes its servers with it through the kernel's
parent-death signal. A pytest plugin too (`-p dashboard_servers`): the fixture `start_dashboard`."""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

START_TIMEOUT_S = 180.0  # generous: the suite runs beside other work on a loaded 2-core machine
STOP_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h
URL_LINE = re.compile(r"^gpuprof dashboard on (.*): (http://\S+)")
_SERVERS: list[subprocess.Popen] = []  # every server a test started, until it is reaped


def kill_group(server: subprocess.Popen) -> None:
    """SIGKILL to the server's whole process group (gpuprof dashboard and its Streamlit child), then reap it."""
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.wait()


@atexit.register
def _kill_servers_left() -> None:
    """The last resort, when pytest itself is interrupted (a Ctrl-C meant for it, a timeout) before teardown."""
    for server in _SERVERS:
        kill_group(server)


def ctrl_c_as_at_a_terminal() -> None:
    """In a child before it starts: SIGINT's default action, which Python turns into KeyboardInterrupt, as at
    a terminal. A suite started as a background job (`bash scripts/test.sh &`, nohup) passes SIGINT on
    ignored, and a child would then never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _as_at_a_terminal_until_pytest_dies() -> None:
    """In the server's process before it starts: Ctrl-C as at a terminal, and SIGTERM (on which gpuprof
    dashboard stops its Streamlit child) once the thread that started it, pytest's, is gone, however it went."""
    ctrl_c_as_at_a_terminal()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class DashboardServer:
    """`gpuprof dashboard ARGS` in a process group of its own; `ctrl_c()` is the test's own Ctrl-C."""

    def __init__(self, args: tuple[str, ...], cwd: Path | None):
        self.process = subprocess.Popen([sys.executable, "-m", "gpuprof", "dashboard", *args],
                                        stdout=subprocess.PIPE, text=True, cwd=cwd, start_new_session=True,
                                        preexec_fn=_as_at_a_terminal_until_pytest_dies)
        _SERVERS.append(self.process)
        self.folder, self.url = self._wait_for_url()

    def _wait_for_url(self) -> tuple[str, str]:
        """The folder and URL it prints, within START_TIMEOUT_S even when it prints nothing."""
        found: list[tuple[str, str]] = []

        def read() -> None:
            for line in self.process.stdout:
                match = URL_LINE.match(line)
                if match:
                    found.append((match.group(1), match.group(2)))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not found:
            self.kill()
            raise AssertionError(f"gpuprof dashboard printed no URL within {START_TIMEOUT_S:.0f} s "
                                 f"(exit code {self.process.returncode})")
        return found[0]

    @property
    def pid(self) -> int:
        return self.process.pid

    def ctrl_c(self) -> int:
        """What a Ctrl-C at its terminal does (SIGINT to the foreground group); its exit code."""
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"gpuprof dashboard did not stop within {STOP_TIMEOUT_S:.0f} s of Ctrl-C") from None

    def kill(self) -> None:
        kill_group(self.process)
        if self.process in _SERVERS:
            _SERVERS.remove(self.process)


@pytest.fixture
def start_dashboard():
    """start_dashboard(*args, cwd=None) -> a running DashboardServer; every one is killed at teardown."""
    started: list[DashboardServer] = []

    def start(*args: str, cwd: Path | None = None) -> DashboardServer:
        started.append(DashboardServer(args, cwd))
        return started[-1]

    yield start
    for server in started:
        server.kill()
