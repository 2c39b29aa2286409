"""Time and peak memory of `gpuprof analyze` and of the dashboard's first render as a run grows in ranks.

    .venv/bin/python benchmarks/scale.py                        # 1, 16, 64, 256 ranks x 10,000 steps, then 1024
    .venv/bin/python benchmarks/scale.py --ranks 256 --steps 10000
    .venv/bin/python benchmarks/scale.py --ranks 1024 --steps 100000 --system-hz 1 --no-dashboard

Synthesises each run under /tmp (or --tmp) in gpuprof's layout, as a finished run leaves it
(meta.json, rank-R/{meta.json, steps, system, events, layers}.parquet), from the shape of
sample_runs/ddp-2rank: its meta, its columns and its step-time distribution, one straggler rank,
on a synthetic GPU so that the device rules run too. Steps of 1.4 s with 10 Hz device samples make
14 system rows per step and rank (256 x 10,000 steps: 36M rows).

Every measurement runs in a fresh subprocess (peak RSS from os.wait4 of that process alone):
`gpuprof analyze RUN --json`, and the Run and Distributed pages' first render through Streamlit's
AppTest. Prints one JSON line per size, and the machine's load average (the CPUs are shared).
Targets at 256 ranks x 10,000 steps: analyze <= 10 s and <= 1 GiB; Run page <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "sample_runs" / "ddp-2rank"
GIB = 2**30
STEP_TIME_S = 1.4
LAYER_EVERY_STEPS = 100
STRAGGLER_EXTRA_S = 0.2
RENDER_SCRIPT = """
import os, sys, time
from streamlit.testing.v1 import AppTest
from gpuprof.dashboard import APP_PATH, RUNS_DIR_ENV
os.environ[RUNS_DIR_ENV] = sys.argv[1]
app = AppTest.from_file(str(APP_PATH), default_timeout=600)
app.query_params["page"] = sys.argv[2]
app.query_params["run"] = sys.argv[3]
started = time.perf_counter()
app.run()
assert not app.exception and not app.error, [e.value for e in [*app.exception, *app.error]]
print(time.perf_counter() - started)
"""


def step_table(rank: int, n_steps: int, start_s: float, straggler: int, template: pd.DataFrame,
               rng: np.random.Generator) -> pa.Table:
    """The template run's step times resampled, with 2 % noise; the straggler does more forward work."""
    measured = template[template["step"] > 0]
    pick = rng.integers(0, len(measured), n_steps)
    noise = rng.normal(1, 0.02, (5, n_steps))
    phases = {p: np.round(measured[f"{p}_time_s"].to_numpy()[pick] * noise[i], 4)
              for i, p in enumerate(("data", "forward", "backward", "optimizer", "other"))}
    if rank == straggler:
        phases["forward"] = phases["forward"] + STRAGGLER_EXTRA_S
    step_time = np.round(sum(phases.values()), 4)
    tokens = int(template["tokens"].iloc[0])
    loss = np.round(9 * np.exp(-np.arange(n_steps) / max(n_steps / 3, 1)) + 2, 3)
    table = {
        "step": np.arange(n_steps), "rank": np.full(n_steps, rank), "time_unix_s": start_s + np.cumsum(step_time),
        "step_time_s": step_time, **{f"{p}_time_s": v for p, v in phases.items()},
        "micro_batches": np.ones(n_steps, dtype=np.int64), "loss": loss, "tokens": np.full(n_steps, tokens),
        "tokens_per_s": np.round(tokens / step_time, 1), "flops_per_s": np.round(tokens * 9.46e6 / step_time, -6),
        "mfu": np.round(tokens * 9.46e6 / step_time / 989e12, 5), "grad_norm": np.round(np.abs(rng.normal(1, 0.1, n_steps)), 3),
        "grad_norm_finite": np.ones(n_steps, dtype=bool), "loss_finite": np.ones(n_steps, dtype=bool),
        "scaler_scale": np.full(n_steps, np.nan), "scaler_growth_tracker": np.full(n_steps, np.nan),
        "step_skipped": np.zeros(n_steps, dtype=bool), "lr": np.full(n_steps, 6e-4),
        "mem_allocated_bytes": np.full(n_steps, 20.0 * GIB), "mem_reserved_bytes": np.full(n_steps, 24.0 * GIB),
        "mem_peak_allocated_bytes": np.full(n_steps, 30.0 * GIB), "mem_alloc_retries": np.zeros(n_steps),
        "mem_ooms": np.zeros(n_steps), "mem_nvml_used_bytes": np.full(n_steps, 26.0 * GIB),
        "mem_nvml_gap_bytes": np.full(n_steps, 2.0 * GIB), "mem_rss_bytes": np.full(n_steps, 6 * GIB),
    }
    return pa.table(table)


def system_table(rank: int, start_s: float, seconds: float, rate_hz: float, rng: np.random.Generator) -> pa.Table:
    times = start_s + np.arange(0, seconds, 1 / rate_hz)
    n = len(times)
    util = rng.integers(60, 101, n).astype(float)
    throttled = rng.random(n) < 0.02
    reasons = pa.array([["sw_power_cap"] if t else [] for t in throttled], type=pa.list_(pa.string()))
    return pa.table({
        "time_unix_s": times, "rank": np.full(n, rank), "device_index": np.full(n, rank % 8),
        "gpu_util_pct": util, "mem_util_pct": np.round(util * 0.6), "mem_used_bytes": np.full(n, 26.0 * GIB),
        "mem_total_bytes": np.full(n, 80.0 * GIB), "power_w": 300 + 3 * util, "temp_c": 55 + util // 5,
        "sm_clock_mhz": np.where(throttled, 1600.0, 1980.0), "throttle_reasons": reasons,
        "host_cpu_pct": np.round(util / 3), "proc_rss_bytes": np.full(n, 6 * GIB),
    })


def layer_table(rank: int, n_steps: int, layers: list[str], rng: np.random.Generator) -> pa.Table:
    steps = np.repeat(np.arange(0, n_steps, LAYER_EVERY_STEPS), len(layers))
    return pa.table({
        "step": steps, "rank": np.full(len(steps), rank), "layer": np.tile(layers, len(steps) // len(layers)),
        "level": np.full(len(steps), "block"), "grad_norm": np.round(np.abs(rng.normal(0.1, 0.02, len(steps))), 4),
        "update_ratio": np.full(len(steps), np.nan),
    })


def synthesise(run_dir: Path, n_ranks: int, n_steps: int, system_hz: float) -> None:
    meta = json.loads((TEMPLATE / "meta.json").read_text())
    template = pd.read_parquet(TEMPLATE / "rank-0" / "steps.parquet")
    layers = list(dict.fromkeys(pd.read_parquet(TEMPLATE / "rank-0" / "layers.parquet")["layer"]))
    events = pd.read_parquet(TEMPLATE / "rank-0" / "events.parquet")
    rank_meta = json.loads((TEMPLATE / "rank-0" / "meta.json").read_text())
    start_s = time.time() - n_steps * STEP_TIME_S
    device = {"index": 0, "name": "synthetic H100", "kind": "cuda", "total_memory_bytes": 80 * GIB, "capability": [9, 0]}
    straggler = n_ranks // 3 if n_ranks > 1 else -1
    for rank in range(n_ranks):
        rng = np.random.default_rng(rank)
        folder = run_dir / f"rank-{rank}"
        folder.mkdir(parents=True)
        steps = step_table(rank, n_steps, start_s, straggler, template, rng)
        pq.write_table(steps, folder / "steps.parquet")
        seconds = float(steps["time_unix_s"][-1].as_py()) - start_s
        pq.write_table(system_table(rank, start_s, seconds, system_hz, rng), folder / "system.parquet")
        pq.write_table(layer_table(rank, n_steps, layers, rng), folder / "layers.parquet")
        events.assign(rank=rank).to_parquet(folder / "events.parquet", index=False)
        (folder / "meta.json").write_text(json.dumps({**rank_meta, "rank": rank, "local_rank": rank % 8,
                                                      "world_size": n_ranks, "device": device}))
    meta.update(name=run_dir.name, world_size=n_ranks, devices=[device], start_unix_s=start_s,
                end_unix_s=time.time(), peak_flops_per_s=989e12, compute_dtype="bf16",
                distributed={"backend": "nccl", "world_size": n_ranks})
    (run_dir / "meta.json").write_text(json.dumps(meta))


def measured(command: list[str]) -> dict:
    """Seconds, peak RSS and output tail of `command`, run under a tiny parent that reports the
    peak RSS of its one child (ru_maxrss of RUSAGE_CHILDREN)."""
    wrapper = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
               "r = subprocess.run(sys.argv[1:], capture_output=True); "
               "sys.stderr.write(r.stderr.decode()[-2000:]); "
               "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode); "
               "print(r.stdout.decode()[-200:])")
    result = subprocess.run([sys.executable, "-c", wrapper, *command], capture_output=True, text=True, cwd=REPO)
    first, _, rest = result.stdout.partition("\n")
    wall_s, max_rss_kib, returncode = first.split()
    if int(returncode):
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    return {"s": round(float(wall_s), 2), "peak_rss_mib": round(int(max_rss_kib) / 1024), "out": rest.strip()}


def run_size(tmp: Path, n_ranks: int, n_steps: int, system_hz: float, dashboard: bool) -> dict:
    root = tmp / f"scale-{n_ranks}x{n_steps}"
    shutil.rmtree(root, ignore_errors=True)
    started = time.perf_counter()
    synthesise(root / "run", n_ranks, n_steps, system_hz)
    size_mb = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6
    result = {"ranks": n_ranks, "steps": n_steps, "step_rows": n_ranks * n_steps,
              "system_rows": sum(pq.read_metadata(f).num_rows for f in (root / "run").glob("rank-*/system.parquet")),
              "size_mb": round(size_mb), "synthesis_s": round(time.perf_counter() - started, 1),
              "load_avg": os.getloadavg()[0]}
    analyze = measured([sys.executable, "-m", "gpuprof", "analyze", str(root / "run"), "--json"])
    result["analyze"] = {key: analyze[key] for key in ("s", "peak_rss_mib")}
    if dashboard:
        for page in ("Run", "Distributed"):
            render = measured([sys.executable, "-c", RENDER_SCRIPT, str(root), page, "run"])
            result[f"{page.lower()}_page"] = {"s": round(float(render["out"].split()[-1]), 2),
                                             "process_s": render["s"], "peak_rss_mib": render["peak_rss_mib"]}
    shutil.rmtree(root, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 16, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--system-hz", type=float, default=10.0)
    parser.add_argument("--no-dashboard", action="store_true", help="time gpuprof analyze only")
    parser.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    for n_ranks in args.ranks:
        print(json.dumps(run_size(args.tmp, n_ranks, args.steps, args.system_hz, not args.no_dashboard)), flush=True)


if __name__ == "__main__":
    main()
