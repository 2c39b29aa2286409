"""What other processes took of the host's CPUs while the run trained.

Each system sample holds the whole host's CPU use (`host_cpu_pct`) and the run's own processes' there
(`job_cpu_pct`: the rank's process and its DataLoader workers, or under torchrun every local rank), over
the same window: the difference is what other processes took. On a saturated host of few cores that difference
stops growing with the load (it cannot pass the cores the run leaves), so each sample also holds how long the
loop's own thread waited for a core (`loop_cpu_wait_pct`, Linux's schedstat): of the time it wanted a CPU, the
share the host did not give it. A step is given the sample whose window holds the step's end. Read from the first
rank's samples and steps (its host), measured steps only.

Another job on the machine slows a run only where the host has no core to spare: a loop waiting for a
core is slow however its code is written, and no change to the code shows as a gain until the load goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from gpuprof.analysis.run.summary import column

# The host this busy (percent of all its CPUs): a thread that wants a core waits for one.
SATURATED_HOST_CPU_PCT = 90.0
SLOW_STEP_QUANTILE = 0.9  # the slowest tenth of the measured steps
# Other processes holding this many cores (or this many more during the slowest steps), with the host
# saturated in this share of the samples: the run competed for its cores.
CONTENDED_CORES = 0.5
CONTENDED_SATURATED_PCT = 25.0
# The loop's thread waiting for a core this share of the time it wanted one (median over the samples): the run
# competed for its cores whatever the CPU figures say.
CONTENDED_LOOP_WAIT_PCT = 20.0
# Two runs whose loops got shares of the CPU they wanted this far apart (the larger over the smaller, and by this
# many points) saw different loads: the load alone would make a CPU-bound step that much slower in one of them.
# Both, as two runs recorded side by side on a saturated host read shares of a few percent that differ by a
# large ratio and no more than that.
DIFFERENT_LOAD_RATIO = 1.5
DIFFERENT_LOAD_POINTS = 15.0
# Fewer samples than this over the measured steps (a run of a second, sampled at 1 Hz) do not follow the load.
MIN_FOLLOWED_SAMPLES = 3
# The system columns the load is read from.
COLUMNS = ("time_unix_s", "host_cpu_pct", "job_cpu_pct", "loop_cpu_wait_pct")


@dataclass(frozen=True)
class HostLoad:
    cpu_count: int
    samples: int
    other_cpu_cores: float  # median over the samples of the measured steps
    saturated_pct: float  # of those samples, the share taken with the host's CPUs saturated
    slow_steps_other_cpu_cores: float | None  # median over the slowest tenth of the steps
    slow_steps_saturated_pct: float | None
    other_steps_other_cpu_cores: float | None  # median over the rest
    loop_cpu_wait_pct: float | None = None  # median over the samples; None where the kernel keeps no schedstat

    @property
    def contended(self) -> bool:
        if self.loop_cpu_wait_pct is not None and self.loop_cpu_wait_pct >= CONTENDED_LOOP_WAIT_PCT:
            return True
        return self.other_cpu_cores >= CONTENDED_CORES and self.saturated_pct >= CONTENDED_SATURATED_PCT

    @property
    def loop_cpu_received_pct(self) -> float | None:
        """Of the CPU time the loop wanted, the share it got."""
        return None if self.loop_cpu_wait_pct is None else 100.0 - self.loop_cpu_wait_pct

    @property
    def followed(self) -> bool:
        return self.samples >= MIN_FOLLOWED_SAMPLES

    @property
    def slow_steps_excess_cores(self) -> float:
        """How many more cores other processes held during the slowest steps than during the rest."""
        if self.slow_steps_other_cpu_cores is None or self.other_steps_other_cpu_cores is None:
            return 0.0
        return self.slow_steps_other_cpu_cores - self.other_steps_other_cpu_cores

    @property
    def slow_steps_contended(self) -> bool:
        return (self.slow_steps_excess_cores >= CONTENDED_CORES
                and (self.slow_steps_saturated_pct or 0.0) >= CONTENDED_SATURATED_PCT)

    def to_dict(self) -> dict:
        return {"host_cpu_count": self.cpu_count, "host_samples": self.samples,
                "other_cpu_cores": self.other_cpu_cores, "host_saturated_pct": self.saturated_pct,
                "slow_steps_other_cpu_cores": self.slow_steps_other_cpu_cores,
                "slow_steps_host_saturated_pct": self.slow_steps_saturated_pct,
                "other_steps_other_cpu_cores": self.other_steps_other_cpu_cores,
                "loop_cpu_wait_pct": self.loop_cpu_wait_pct}


def other_cpu_samples(system: pd.DataFrame, cpu_count: int) -> pd.DataFrame:
    """One row per sample that read both CPU figures: its time, the cores other processes held, and
    whether the host was saturated."""
    host_pct, own_pct = column(system, "host_cpu_pct"), column(system, "job_cpu_pct")
    read = host_pct.notna() & own_pct.notna()
    samples = pd.DataFrame({
        "time_unix_s": column(system, "time_unix_s")[read],
        "other_cpu_cores": ((host_pct - own_pct)[read].clip(lower=0) * cpu_count / 100),
        "saturated": host_pct[read] >= SATURATED_HOST_CPU_PCT,
        "loop_cpu_wait_pct": column(system, "loop_cpu_wait_pct")[read],
    })
    return samples.drop_duplicates("time_unix_s").sort_values("time_unix_s", ignore_index=True)


def host_load(steps: pd.DataFrame, system: pd.DataFrame, cpu_count: int | None, first_measured_step: int,
              interval_s: float | None) -> HostLoad | None:
    """The host load over one rank's measured steps; None when the run did not record its own CPU use."""
    if not cpu_count or steps.empty or system.empty:
        return None
    samples = other_cpu_samples(system, cpu_count)
    steps = steps[column(steps, "step") >= first_measured_step]
    times = pd.DataFrame({"time_unix_s": column(steps, "time_unix_s"), "step_time_s": column(steps, "step_time_s")})
    times = times.dropna().sort_values("time_unix_s", ignore_index=True)
    if samples.empty or times.empty:
        return None
    measured = samples[samples["time_unix_s"] >= times["time_unix_s"].iloc[0] - times["step_time_s"].iloc[0]]
    if measured.empty:
        return None
    per_step = pd.merge_asof(times, samples, on="time_unix_s", direction="forward",
                             tolerance=2 * (interval_s or 1.0)).dropna(subset=["other_cpu_cores"])
    slow = per_step["step_time_s"] >= per_step["step_time_s"].quantile(SLOW_STEP_QUANTILE)
    return HostLoad(
        cpu_count=int(cpu_count), samples=len(measured),
        other_cpu_cores=float(measured["other_cpu_cores"].median()),
        saturated_pct=float(100 * measured["saturated"].mean()),
        slow_steps_other_cpu_cores=_median(per_step.loc[slow, "other_cpu_cores"]),
        slow_steps_saturated_pct=float(100 * per_step.loc[slow, "saturated"].astype(bool).mean()) if slow.any() else None,
        other_steps_other_cpu_cores=_median(per_step.loc[~slow, "other_cpu_cores"]),
        loop_cpu_wait_pct=_median(measured["loop_cpu_wait_pct"].dropna()),
    )


def _median(values: pd.Series) -> float | None:
    return float(np.median(values)) if len(values) else None
