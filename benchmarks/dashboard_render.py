"""First render of a large run in the dashboard, through Streamlit's AppTest (no browser).

    .venv/bin/python benchmarks/dashboard_render.py [--steps 100000] [--hours 4] [--rate-hz 10]

Writes a synthetic run with gpuprof's own run writer (100k optimizer steps, hours of 10 Hz
device samples, per-layer gradient norms every 10 steps), compacts it to Parquet as a
finished run would be, then times the Run page from a cold cache (reading, summarising,
diagnosing, downsampling, drawing) and a rerun, and each stage alone. Prints JSON; the target
for the first render is under 2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from gpuprof.dashboard import APP_PATH, RUNS_DIR_ENV
from gpuprof.run import schema
from gpuprof.run.writer import RunWriter

N_LAYERS = 12
LAYER_EVERY_STEPS = 10
GIB = 2**30


def step_records(n_steps: int, start_s: float, rng: np.random.Generator) -> tuple[list[dict], float]:
    phases = {name: rng.gamma(20, scale, n_steps) for name, scale in
              (("data", 2e-4), ("forward", 1.5e-3), ("backward", 3e-3), ("optimizer", 5e-4))}
    step_time = sum(phases.values()) * 1.02
    ends = start_s + np.cumsum(step_time)
    loss = 10 * np.exp(-np.arange(n_steps) / (n_steps / 5)) + 2 + rng.normal(0, 0.05, n_steps)
    records = [{
        "step": i, "rank": 0, "time_unix_s": ends[i], "step_time_s": step_time[i],
        **{f"{name}_time_s": values[i] for name, values in phases.items()},
        "other_time_s": step_time[i] * 0.02 / 1.02, "micro_batches": 1, "loss": loss[i],
        "loss_finite": True, "tokens": 8192, "tokens_per_s": 8192 / step_time[i],
        "mfu": 0.35 * 0.1 / step_time[i] / 10, "grad_norm": abs(rng.normal(1, 0.2)), "grad_norm_finite": True,
        "scaler_scale": 65536.0, "step_skipped": False, "lr": 3e-4,
        "mem_allocated_bytes": 20 * GIB, "mem_reserved_bytes": 24 * GIB, "mem_peak_allocated_bytes": 30 * GIB,
    } for i in range(n_steps)]
    return records, float(ends[-1])


def system_records(start_s: float, seconds: float, rate_hz: float, rng: np.random.Generator) -> list[dict]:
    times = start_s + np.arange(0, seconds, 1 / rate_hz)
    util = np.clip(rng.normal(85, 8, len(times)), 0, 100)
    return [{
        "time_unix_s": t, "rank": 0, "device_index": 0, "gpu_util_pct": u, "power_w": 300 + 3 * u,
        "temp_c": 60 + u / 5, "sm_clock_mhz": 1980.0, "mem_used_bytes": 30 * GIB, "mem_total_bytes": 80 * GIB,
        "host_cpu_pct": 30.0, "proc_rss_bytes": 8 * GIB,
    } for t, u in zip(times, util)]


def layer_records(n_steps: int, rng: np.random.Generator) -> list[dict]:
    return [{"step": step, "rank": 0, "layer": f"transformer.h.{layer}", "grad_norm": abs(rng.normal(0.1, 0.02))}
            for step in range(0, n_steps, LAYER_EVERY_STEPS) for layer in range(N_LAYERS)]


def write_run(run_dir: Path, n_steps: int, hours: float, rate_hz: float) -> None:
    rng = np.random.default_rng(0)
    start_s = time.time() - hours * 3600
    writer = RunWriter(run_dir, rank=0)
    steps, end_s = step_records(n_steps, start_s, rng)
    writer.write("steps", steps)
    writer.write("system", system_records(start_s, hours * 3600, rate_hz, rng))
    writer.write("layers", layer_records(n_steps, rng))
    writer.write_run_meta({
        "format": schema.FORMAT, "format_version": schema.FORMAT_VERSION, "run_id": "bench", "name": "large",
        "status": "finished", "start_unix_s": start_s, "end_unix_s": end_s, "world_size": 1,
        "devices": [{"index": 0, "name": "synthetic GPU", "kind": "cuda", "total_memory_bytes": 80 * GIB,
                     "capability": [9, 0]}],
        "model": {"class": "GPT2LMHeadModel"}, "config": {"variant": "synthetic", "model_size": "124m"},
        "peak_flops_per_s": 989e12,
    })
    writer.close()


def stage_times(run_dir: Path) -> dict:
    """Seconds of each stage of that render, timed alone: where the time goes when it is slow."""
    from gpuprof.dashboard.charts import run_panels
    from gpuprof.diagnoses.context import RunContext
    from gpuprof.diagnoses.registry import all_rules
    from gpuprof.run.reader import load_run

    started = time.perf_counter()
    run = load_run(run_dir)
    for stream in schema.STREAMS:
        getattr(run, stream)
    times = {"read_s": time.perf_counter() - started}
    started = time.perf_counter()
    context = RunContext.of(run)
    times["summary_s"] = time.perf_counter() - started
    rule_times = {}
    for registered in all_rules():
        started = time.perf_counter()
        registered.findings(context)
        rule_times[registered.id] = time.perf_counter() - started
    times["diagnoses_s"] = sum(rule_times.values())
    times["slowest_rules_s"] = dict(sorted(rule_times.items(), key=lambda item: -item[1])[:3])
    started = time.perf_counter()
    run_panels(run, 0)
    times["charts_s"] = time.perf_counter() - started
    return {key: round(value, 2) if isinstance(value, float) else {k: round(v, 2) for k, v in value.items()}
            for key, value in times.items()}


def time_renders(runs_root: Path) -> tuple[float, float]:
    """Seconds of the Run page's first render (cold cache) and of a rerun (what a click costs)."""
    from streamlit.testing.v1 import AppTest

    os.environ[RUNS_DIR_ENV] = str(runs_root)
    app = AppTest.from_file(str(APP_PATH), default_timeout=300)
    app.query_params["page"] = "Run"
    app.query_params["run"] = "large"
    times = []
    for _ in range(2):
        started = time.perf_counter()
        app.run()
        times.append(time.perf_counter() - started)
        if app.exception or app.error:
            raise SystemExit(f"the page failed: {[e.value for e in app.exception] + [e.value for e in app.error]}")
    return times[0], times[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--hours", type=float, default=4.0)
    parser.add_argument("--rate-hz", type=float, default=10.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        write_run(root / "large", args.steps, args.hours, args.rate_hz)
        written_s = time.perf_counter() - started
        render_s, rerun_s = time_renders(root)
        stages = stage_times(root / "large")
        size_mb = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6
    print(json.dumps({
        "steps": args.steps, "system_samples": int(args.hours * 3600 * args.rate_hz),
        "run_size_mb": round(size_mb, 1), "write_s": round(written_s, 1),
        "first_render_s": round(render_s, 2), "rerun_s": round(rerun_s, 2), "target_s": 2.0, "stages": stages,
    }))


if __name__ == "__main__":
    main()
