"""Child processes the tests start: the gpuprof CLI, and torchrun jobs on a free port of this machine."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

CLI_TIMEOUT_S = 400
JOB_BOUND_S = 420  # a whole torchrun job, start-up of two torch processes on a loaded machine included
STOP_BOUND_S = 60


def gpuprof_cli(*args, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`python -m gpuprof ARGS`, its output captured; one OpenMP thread, as concurrent tiny runs only slow each
    other with more."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "gpuprof", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(n_procs: int = 2) -> list[str]:
    """`python -m torch.distributed.run` for `n_procs` ranks on this machine, its store on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n_procs),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port())]


# Busy for 60 s at most: one left behind by a killed test stops by itself.
SPIN = [sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"]


def spinner_outside_the_job() -> int:
    """A busy process that is not this one's child (started by a shell that exits at once), by pid: another
    job on the host."""
    shell = subprocess.run(["sh", "-c", f"{shlex.join(SPIN)} >/dev/null 2>&1 & echo $!"],
                           capture_output=True, text=True, check=True)
    return int(shell.stdout.strip())


def stop(job: subprocess.Popen) -> None:
    """torchrun starts each worker in a session of its own: SIGTERM lets the agent stop them; then
    SIGKILL for whatever of the job is left, worker by worker."""
    workers = []
    with contextlib.suppress(psutil.NoSuchProcess):
        workers = psutil.Process(job.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(timeout=STOP_BOUND_S)
    for process in [*workers, psutil.Process(job.pid) if job.poll() is None else None]:
        with contextlib.suppress(psutil.NoSuchProcess, AttributeError):
            process.kill()
    job.wait(timeout=STOP_BOUND_S)


def events_on_disk(run_dir: Path, kind: str) -> list[dict]:
    """The `kind` events every rank has handed to the OS so far (the job may still run)."""
    found = []
    for path in sorted(run_dir.glob("rank-*/events.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                event = json.loads(line)
                if event["kind"] == kind:
                    found.append(event)
    return found


def wait_for(condition, job, bound_s: float = JOB_BOUND_S):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if job.poll() is not None and not condition():
            return condition()
        time.sleep(1.0)
    return condition()


def hang_events_of_every_rank(run_dir: Path, step: int):
    """Each rank's `hang` event at `step` (a loaded machine may stall an earlier step past the timeout too)."""
    events = [event for event in events_on_disk(run_dir, "hang") if event["step"] == step]
    return events if sorted(event["rank"] for event in events) == [0, 1] else None
