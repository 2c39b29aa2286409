"""Other processes on the run's host taking the CPUs the loop needs (gpuprof.analysis.run.host_load)."""

from __future__ import annotations

from gpuprof.analysis.run.host_load import CONTENDED_CORES, CONTENDED_LOOP_WAIT_PCT, CONTENDED_SATURATED_PCT
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

CONTENTION_FIX = (
    "Give the run its machine: stop or move the other jobs (top shows them), or put them and the run "
    "on separate cores (taskset -c, a cpuset). Until then this run's timings, and any comparison with "
    "it, measure the other jobs too."
)


@rule("host-contention", "host")
def host_contention(ctx):
    load = ctx.host_load
    if load is None or not load.contended:
        return None
    return Finding(
        rule="host-contention",
        severity="warning",
        title=(f"Other processes held {load.other_cpu_cores:.1f} of the host's {load.cpu_count} CPUs while "
               f"this run trained (host saturated in {load.saturated_pct:.0f} % of the samples{_waited(load)})"),
        evidence={**load.to_dict(), "threshold_other_cpu_cores": CONTENDED_CORES,
                  "threshold_saturated_pct": CONTENDED_SATURATED_PCT, "threshold_loop_cpu_wait_pct": CONTENDED_LOOP_WAIT_PCT},
        fix=CONTENTION_FIX,
    )


def _waited(load) -> str:
    if load.loop_cpu_wait_pct is None:
        return ""
    return f"; the loop waited for a core {load.loop_cpu_wait_pct:.0f} % of the time it wanted one"
