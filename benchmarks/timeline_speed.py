"""How long the Timeline page's data takes: `step_timeline` for every step of the shared GPU traces,
and one "step" of a large trace (copies of a100_2rank_nccl back to back, read as a single window).

    .venv/bin/python benchmarks/timeline_speed.py [--copies 25]

Prints one JSON line per measurement: events in the step, intervals drawn, seconds (load excluded).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "traces"
sys.path.insert(0, str(ROOT / "benchmarks"))

from trace_speed import replicate  # noqa: E402

from gpuprof.analysis.trace.loader import load_trace  # noqa: E402
from gpuprof.analysis.trace.timeline import step_intervals, step_timeline, thin, trace_steps  # noqa: E402


def shared_steps() -> None:
    for folder in sorted(p for p in SHARED.iterdir() if p.is_dir()):
        trace = load_trace(folder)
        rank = min(trace.ranks)
        for step in trace_steps(trace, rank):
            started = time.perf_counter()
            timeline = step_timeline(trace, step, rank)
            print(json.dumps({"trace": folder.name, "step": step, "events": timeline.events,
                              "drawn": len(timeline.intervals), "seconds": round(time.perf_counter() - started, 3)}))


def one_large_window(copies: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "rank-0.json"
        replicate(SHARED / "a100_2rank_nccl" / "nccl_data.json.gz", copies, path)
        rank_trace = load_trace(path).ranks[0]
        events = rank_trace.events
        start_us, end_us = int(events["ts_us"].min()), int(events["end_us"].max())
        started = time.perf_counter()
        intervals = step_intervals(rank_trace, start_us, end_us)
        drawn = thin(intervals, end_us - start_us)
        print(json.dumps({"trace": f"a100_2rank_nccl x{copies} as one window", "events": len(intervals),
                          "drawn": len(drawn), "seconds": round(time.perf_counter() - started, 3)}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=25, help="copies of a100_2rank_nccl in the large window")
    args = parser.parse_args()
    if not SHARED.is_dir():
        print(f"timeline_speed: no shared traces at {SHARED}", file=sys.stderr)
        return 2
    shared_steps()
    one_large_window(args.copies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
