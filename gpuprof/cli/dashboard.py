"""`gpuprof dashboard [RUNS_DIR] [--port N]`: serve the Streamlit dashboard on localhost."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gpuprof.errors import GpuprofError

LOCALHOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "dashboard",
        help="open the dashboard on a folder of runs",
        description="Serve the gpuprof dashboard on localhost. Default folder: ./runs.",
    )
    parser.add_argument("runs_dir", nargs="?", type=Path, help="folder holding run directories")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    parser.add_argument("--host", default=LOCALHOST,
                        help=f"address to listen on (default {LOCALHOST}; 0.0.0.0 exposes it to the network)")
    parser.add_argument("--refresh-s", type=float, default=None,
                        help="auto-refresh interval for live runs in seconds (default 5)")
    parser.set_defaults(func=run)


def free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def streamlit_command(runs_dir: Path, host: str, port: int) -> list[str]:
    from gpuprof.dashboard import APP_PATH

    return [
        sys.executable, "-m", "streamlit", "run", str(APP_PATH),
        "--server.address", host, "--server.port", str(port), "--server.headless", "true",
        "--browser.gatherUsageStats", "false", "--global.developmentMode", "false",
        "--server.fileWatcherType", "none", "--logger.level", "error", "--client.toolbarMode", "viewer",
        "--", str(runs_dir),
    ]


def wait_until_healthy(server: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise GpuprofError(f"the dashboard server exited with code {server.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{url}_stcore/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise GpuprofError(f"the dashboard server did not answer within {STARTUP_TIMEOUT_S:.0f} s")


def stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)  # unwinds through run()'s finally, which stops the server


def run(args: argparse.Namespace) -> int:
    from gpuprof.dashboard import MIN_REFRESH_S, REFRESH_ENV, default_runs_dir

    runs_dir = (args.runs_dir or default_runs_dir()).resolve()
    if not runs_dir.is_dir():
        raise GpuprofError(f"runs folder {runs_dir} does not exist or is not a folder")
    if not 0 <= args.port < 65536:
        raise GpuprofError(f"--port must be between 1 and 65535, got {args.port}")
    if args.refresh_s is not None and args.refresh_s < MIN_REFRESH_S:
        raise GpuprofError(f"--refresh-s must be at least {MIN_REFRESH_S:g}, got {args.refresh_s:g}")
    port = args.port or free_port(args.host)
    url = f"http://{args.host}:{port}/"
    env = dict(os.environ, **({REFRESH_ENV: str(args.refresh_s)} if args.refresh_s else {}))
    # Streamlit's own "you can now view" banner would repeat the URL printed below; its errors go to stderr.
    server = subprocess.Popen(streamlit_command(runs_dir, args.host, port), env=env, stdout=subprocess.DEVNULL)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        wait_until_healthy(server, url)
        print(f"gpuprof dashboard on {runs_dir}: {url}  (Ctrl-C to stop)", flush=True)
        _print_unlisted_traces(runs_dir)
        return server.wait()
    except KeyboardInterrupt:
        print("gpuprof dashboard: stopped", file=sys.stderr)
        return 0
    finally:
        stop(server)


def _print_unlisted_traces(runs_dir: Path) -> None:
    """The traces the dashboard leaves out, said where the user started it (the Runs page says it too)."""
    from gpuprof.report.format import code_parts
    from gpuprof.run.reader import unlisted_traces_note

    note = unlisted_traces_note(runs_dir)
    if note:
        print("note: " + "".join(part for part, _ in code_parts(note)), flush=True)
