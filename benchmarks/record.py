"""Run one benchmark command and keep its raw output, with where and when it ran, in benchmarks/results/.

    .venv/bin/python benchmarks/record.py dashboard-render -- .venv/bin/python benchmarks/dashboard_render.py

writes benchmarks/results/<date>-dashboard-render.txt: the command, the commit (and whether the tree had changes),
the machine (CPU model, cores, memory, GPU), the load average before and after, the wall time and exit code, then
everything the command printed, stdout and stderr interleaved as they came. The README's figures cite these files.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the result's name: benchmarks/results/<date>-<name>.txt")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: the benchmark command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the benchmark command after --")
    out_path = RESULTS / f"{datetime.date.today().isoformat()}-{args.name}.txt"
    header = provenance(command)
    started = time.monotonic()
    with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as child:
        printed = [echo(line) for line in child.stdout]
    wall_s = time.monotonic() - started
    footer = [f"exit code: {child.returncode}", f"wall time: {wall_s:.1f} s", f"load average after: {load_text()}"]
    out_path.write_text("\n".join(header + ["", *(line.rstrip("\n") for line in printed), ""] + footer) + "\n")
    print(f"raw output: {out_path.relative_to(REPO)}", file=sys.stderr)
    return child.returncode


def echo(line: str) -> str:
    sys.stdout.write(line)
    sys.stdout.flush()
    return line


def provenance(command: list[str]) -> list[str]:
    return [
        f"command: {shlex.join(command)}",
        f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"commit: {git('rev-parse', '--short', 'HEAD')}{' (with uncommitted changes)' if git('status', '--porcelain', '--untracked-files=no') else ''}",
        f"machine: {cpu_model()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.1f} GiB, {gpu_text()}",
        f"python: {platform.python_version()}",
        f"load average before: {load_text()}",
    ]


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def gpu_text() -> str:
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        listed = ""
    return f"GPU: {', '.join(listed.splitlines())}" if listed else "no GPU"


def load_text() -> str:
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
