"""Speed and peak memory of gpuprof's trace analyzer against HolisticTraceAnalysis (HTA), and
against the floor any analyzer pays: reading the file, gunzip, and one JSON parse.

Measures "load + temporal breakdown + kernel breakdown" on the shared real traces and on
a large trace synthesized by replicating a real one (shifted in time, with fresh
correlation ids and step numbers), each run in a fresh process so peak RSS is its own.
The floor is `msgspec.json.decode` of the whole (gunzipped) document into Python objects. The CLI columns time
what a user runs, the whole `gpuprof trace --json` process (every view it prints, imports included), against HTA's
analysis after its imports: the least flattering ratio, the one to quote.
Speed-ups are given in wall time and in CPU time (the process and its children, after imports):
on a machine other jobs load, the CPU-time ratio is the one that still measures the analyzers.

    .venv/bin/python benchmarks/trace_speed.py                      # HTA from --hta-python
    .venv/bin/python benchmarks/trace_speed.py --replicate 42       # about 1.7M events

HTA's newest release is PyPI `traceinsight` (0.6.1, the `hta` package), a benchmark-only
dependency (`pip install -e .[bench]`). It requires jupyterlab, which its analysis never
imports: to keep the project's environment as it is, install it beside it with
`pip install --no-deps --target /tmp/hta traceinsight==0.6.1 pydot pyparsing networkx` and pass
`--hta-path /tmp/hta` (the project's Python then runs HTA with that folder on its path), or
give `--hta-python` a Python where it is installed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACES = Path(os.environ.get("GPUPROF_SHARED_TRACES") or ROOT.parent / "shared" / "traces")
REAL_TRACES = ("a100_2rank_nccl", "v100_ns_timestamps", "sampled_world128")

# Each runs in its own process; prints one JSON line with seconds (after imports) and peak RSS.
GPUPROF_RUN = """
import json, os, resource, sys, time
from gpuprof.analysis.trace import TraceAnalysis
start, cpu_start = time.perf_counter(), sum(os.times()[:4])
analysis = TraceAnalysis(sys.argv[1])
analysis.temporal_breakdown(); analysis.kernel_type_breakdown(); analysis.top_kernels()
seconds, cpu_s = time.perf_counter() - start, sum(os.times()[:4]) - cpu_start
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "peak_rss_mb": peak / 1024}))
"""
HTA_RUN = """
import json, logging, os, resource, sys, time
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
start, cpu_start = time.perf_counter(), sum(os.times()[:4])
analysis = TraceAnalysis(trace_dir=sys.argv[1])
analysis.get_temporal_breakdown(visualize=False)
analysis.get_gpu_kernel_breakdown(visualize=False, include_memory_kernels=True)
seconds, cpu_s = time.perf_counter() - start, sum(os.times()[:4]) - cpu_start
peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "peak_rss_mb": peak / 1024}))
"""
# What a user runs: the whole `gpuprof trace --json` command, every view it prints, imports and start-up included.
CLI_RUN = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
done = subprocess.run([sys.executable, "-m", "gpuprof", "trace", "--json", sys.argv[1]], capture_output=True, text=True)
seconds = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
if done.returncode:
    sys.exit(done.stderr.strip()[-200:])
print(json.dumps({"seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024}))
"""

FLOOR_RUN = """
import gzip, json, os, resource, sys, time
from pathlib import Path
import msgspec
start, cpu_start = time.perf_counter(), sum(os.times()[:4])
for file in sorted(Path(sys.argv[1]).iterdir()):
    data = file.read_bytes()
    msgspec.json.decode(gzip.decompress(data) if data[:2] == b"\\x1f\\x8b" else data)
seconds, cpu_s = time.perf_counter() - start, sum(os.times()[:4]) - cpu_start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "cpu_s": cpu_s, "peak_rss_mb": peak / 1024}))
"""


def measure(python: str, script: str, trace_dir: Path, timeout_s: float, path: str | None = None) -> dict | None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))}
    try:
        result = subprocess.run([python, "-c", script, str(trace_dir)], capture_output=True, text=True,
                                timeout=timeout_s, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {result.returncode}: {last[:120]}"}
    return json.loads(result.stdout.strip().splitlines()[-1])


def replicate(source: Path, copies: int, destination: Path) -> int:
    """Write `copies` back-to-back copies of a one-file trace; returns the event count."""
    document = json.loads(gzip.decompress(source.read_bytes()) if source.suffix == ".gz" else source.read_bytes())
    events = document.pop("traceEvents")
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    start = min(e["ts"] for e in timed)
    span = max(e["ts"] + e.get("dur", 0) for e in timed) - start
    max_id = max(max(e.get("args", {}).get(k, 0) or 0 for e in events if isinstance(e.get("args"), dict))
                 for k in ("correlation", "External id")) + 1
    destination.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(destination, "w") as out:
        out.write(json.dumps(document)[:-1] + ', "traceEvents": [')
        for copy in range(copies):
            for event in events:
                event = _shifted(event, copy, span * 1.01, max_id)
                out.write(("," if count else "") + json.dumps(event))
                count += 1
        out.write("]}")
    return count


def _shifted(event: dict, copy: int, period: float, id_offset: int) -> dict:
    if copy == 0:
        return event
    event = dict(event)
    if isinstance(event.get("ts"), (int, float)):
        event["ts"] = event["ts"] + copy * period
    if isinstance(event.get("id"), int):
        event["id"] = event["id"] + copy * id_offset
    name = event.get("name")
    if isinstance(name, str) and name.startswith("ProfilerStep#"):
        event["name"] = f"ProfilerStep#{int(name.split('#')[1]) + copy * 1000}"
    if isinstance(event.get("args"), dict):
        args = dict(event["args"])
        for key in ("correlation", "External id"):
            if isinstance(args.get(key), int) and args[key] > 0:
                args[key] += copy * id_offset
        event["args"] = args
    return event


def count_events(trace_dir: Path) -> int:
    """Events in the (small, real) trace files of a folder."""
    total = 0
    for file in trace_dir.iterdir():
        data = file.read_bytes()
        total += len(json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)["traceEvents"])
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=DEFAULT_TRACES, help="the shared traces folder")
    parser.add_argument("--hta-python", default=os.environ.get("HTA_PYTHON", "/tmp/hta-venv/bin/python"),
                        help="a Python with traceinsight (HTA) installed")
    parser.add_argument("--hta-path", help="a folder holding traceinsight's `hta` package (pip install --target), "
                        "run with this script's Python")
    parser.add_argument("--replicate", type=int, default=25, help="copies of a100_2rank_nccl in the large trace")
    parser.add_argument("--large-replicate", type=int, default=0,
                        help="also time gpuprof alone on this many copies (100 copies ≈ 1 GB of JSON)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds allowed per measurement")
    args = parser.parse_args()
    if args.hta_path:
        args.hta_python = sys.executable
    have_hta = Path(args.hta_python).exists() or args.hta_python == sys.executable
    if not have_hta:
        print(f"HTA not measured: {args.hta_python} not found (see this script's docstring)")

    if not any((args.traces / name).is_dir() for name in REAL_TRACES):
        print(f"no shared traces in {args.traces} (pass --traces or set GPUPROF_SHARED_TRACES)")
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpuprof-trace-bench-"))
    cases = [(name, args.traces / name, count_events(args.traces / name), True)
             for name in REAL_TRACES if (args.traces / name).is_dir()]
    source = args.traces / "a100_2rank_nccl" / "nccl_data.json.gz"
    for copies, with_hta in ((args.replicate, True), (args.large_replicate, False)):
        if copies and source.exists():
            target = work / f"a100_x{copies}"
            events = replicate(source, copies, target / "rank-0.json")
            cases.append((f"a100 x{copies}", target, events, with_hta))

    print(f"{'trace':<20} {'events':>10} {'file MB':>7} {'gpuprof s':>10} {'HTA s':>9} {'speed-up':>9} {'CPU s-up':>9} "
          f"{'gpuprof MB':>11} {'HTA MB':>8} {'mem ratio':>10} {'floor s':>8} {'vs floor':>9} {'CLI s':>7} "
          f"{'CLI s-up':>9} {'CLI MB':>7}")
    for name, trace_dir, events, with_hta in cases:
        size_mb = sum(f.stat().st_size for f in trace_dir.iterdir()) / 2**20
        ours = measure(sys.executable, GPUPROF_RUN, trace_dir, args.timeout)
        theirs = (measure(args.hta_python, HTA_RUN, trace_dir, args.timeout, args.hta_path)
                  if (have_hta and with_hta) else None)
        floor = measure(sys.executable, FLOOR_RUN, trace_dir, args.timeout)
        cli = measure(sys.executable, CLI_RUN, trace_dir, args.timeout)
        print(_row(name, events, size_mb, ours, theirs, floor) + _cli_columns(cli, theirs), flush=True)
    shutil.rmtree(work)
    return 0


def _row(name: str, events: int, size_mb: float, ours: dict, theirs: dict | None, floor: dict) -> str:
    def figure(result, key, fmt):
        if result is None:
            return "-"
        return result.get("error", "")[:9] if "error" in result else format(result[key], fmt)

    ratio_time = ratio_cpu = ratio_mem = "-"
    if ours and theirs and "error" not in ours and "error" not in theirs:
        ratio_time = f"{theirs['seconds'] / ours['seconds']:.1f}x"
        ratio_cpu = f"{theirs['cpu_s'] / ours['cpu_s']:.1f}x"
        ratio_mem = f"{ours['peak_rss_mb'] / theirs['peak_rss_mb']:.2f}"
    if ours and "error" in ours:
        print(f"gpuprof failed on {name}: {ours['error']}")
    if theirs and "error" in theirs:
        print(f"HTA failed on {name}: {theirs['error']}")
    vs_floor = (f"{ours['seconds'] / floor['seconds']:.2f}x"
                if ours and floor and "error" not in ours and "error" not in floor else "-")
    return (f"{name:<20} {events:>10,} {size_mb:>7.1f} {figure(ours, 'seconds', '.2f'):>10} "
            f"{figure(theirs, 'seconds', '.2f'):>9} {ratio_time:>9} {ratio_cpu:>9} {figure(ours, 'peak_rss_mb', '.0f'):>11} "
            f"{figure(theirs, 'peak_rss_mb', '.0f'):>8} {ratio_mem:>10} {figure(floor, 'seconds', '.2f'):>8} "
            f"{vs_floor:>9}")


def _cli_columns(cli: dict | None, theirs: dict | None) -> str:
    """The user's command against HTA's analysis alone (its imports left out): the least flattering ratio."""
    if not cli or "error" in cli:
        return f" {'failed':>7}" + (f" ({cli['error']})" if cli else "")
    ratio = f"{theirs['seconds'] / cli['seconds']:.1f}x" if theirs and "error" not in theirs else "-"
    return f" {cli['seconds']:>7.2f} {ratio:>9} {cli['peak_rss_mb']:>7.0f}"


if __name__ == "__main__":
    sys.exit(main())
