"""Child processes the tests start: the gpuprof CLI, and torchrun jobs on a free port of this machine."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

CLI_TIMEOUT_S = 400


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
