"""What the rule tests share: a healthy step of a synthetic GPU run, a second rank for it, and one rule's findings."""

from __future__ import annotations

from gpuprof.diagnoses.context import RunContext
from gpuprof.diagnoses.registry import RULES
from gpuprof.run.reader import load_run
from gpuprof.run.writer import RunWriter

STEP_TIME_S = 0.2
CPU_DEVICE = {"index": None, "name": "x86_64", "kind": "cpu", "total_memory_bytes": None, "capability": None}


def fired(run, rule_id):
    """The findings of the rule `rule_id` alone on `run`."""
    return RULES[rule_id].findings(RunContext.of(run))


def healthy_step(step: int) -> dict:
    """A step of a well-fed A100 run: steady time, half the memory, no retries."""
    return {
        "step": step, "rank": 0, "time_unix_s": 1000.0 + STEP_TIME_S * (step + 1),
        "step_time_s": STEP_TIME_S * (3 if step == 0 else 1), "data_time_s": 0.002,
        "forward_time_s": 0.06, "backward_time_s": 0.12, "optimizer_time_s": 0.015, "other_time_s": 0.003,
        "loss": 4.0, "tokens": 8192, "mfu": 0.45, "grad_norm": 1.0, "grad_norm_finite": True,
        "loss_finite": True, "mem_allocated_bytes": 38 * 2**30, "mem_reserved_bytes": 40 * 2**30,
        "mem_peak_allocated_bytes": 39 * 2**30, "mem_alloc_retries": 0, "mem_ooms": 0,
    }


def second_rank(run, *, status: str = "finished", step=None, events=(), steps: int = 20):
    """Rank 1 of `run` (written with world_size 2), with its rank meta, steps and events."""
    writer = RunWriter(run.path, 1)
    for index in range(steps):
        writer.write("steps", [{**healthy_step(index), "rank": 1, **(step(index) if step else {})}])
    writer.write("events", list(events))
    writer.write_rank_meta({"rank": 1, "world_size": 2, "status": status, "host": "elsewhere", "pid": 1})
    writer.close()
    return load_run(run.path)
