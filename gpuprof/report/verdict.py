"""The verdict of a run: what bounds its step, why (the measured share), and what to do next.

Each share of step time comes from the signal that measures it:
- input: the data phase (phase timings), else a trace's data-loader time;
- communication: a trace window (collectives hide inside backward in the phase timings);
- compute, host/launch, memory copies: a device trace on a GPU (NVML utilization for one GPU
  without a trace); the forward/backward/optimizer and `other` phases on a CPU, else a CPU trace
  (its host ops are the compute): a bare trace's verdict reads every share from the trace.
Evaluation inside the loop is no share of the training step: it is said apart, with how long and
how often. Where the stack sampler ran, an input or host share names the user's functions that
hold it (gpuprof.analysis.run.hotspots).
A run that stopped (a hang, ranks that failed or died: the `failure` rules) says so before anything
else; then critical numerics or memory trouble bounds the run whatever the timings say; then a straggler the
other ranks wait for at least BOUND_MIN_SHARE_PCT of a step (their phases hold that wait). A bound other than
compute is named when its share reaches `BOUND_MIN_SHARE_PCT`; otherwise the step is bound by
its compute, once every other bound was measured. Where one was not, the verdict names the
missing signal and how to record it instead of guessing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import pandas as pd

from gpuprof.analysis.run.hotspots import MIN_PHASE_SAMPLES, phase_samples, site_label, top_sites
from gpuprof.analysis.run.summary import primary_device
from gpuprof.diagnoses.finding import CATEGORY_TITLES
from gpuprof.diagnoses.fits import Hardware
from gpuprof.diagnoses.recorded_loop import FP32_NAMES, eager_attention, recorded_dtype, unfused_optimizers
from gpuprof.diagnoses.rules.optimizer import UNFUSED_OPTIMIZER
from gpuprof.report.format import fmt, fmt_ms, fmt_share, rank_list
from gpuprof.run.jsonable import json_safe
from gpuprof.run.schema import COMPUTE_PHASES, MODEL_PHASES

# A bound other than compute is the verdict from this share of step time on (dataloader-bound's warning).
BOUND_MIN_SHARE_PCT = 15.0
STRAGGLER_RULES = ("late-arrival", "rank-straggler")  # a rank the others wait for
# The bounds of a run that stopped or whose values went non-finite: that is its news, not its speed.
STOPPED_BOUNDS = ("failure", "numerics")
# Categories of the trace's step breakdown (gpuprof.analysis.trace.steps) behind each bound; host
# ops (`cpu_exec`) are compute in a CPU-only trace and host work beside a device's kernels.
TRACE_COLUMNS = {
    "input": ("dataloader_us",),
    "communication": ("communication_us",),
    "memory": ("memcpy_us", "memset_us"),
    "host": ("runtime_us", "other_us"),
    "compute": ("kernel_us",),
}
# The phase whose time a bound measured from the phase timings is: its user functions are named.
BOUND_PHASES = {"input": "data", "host": "other"}
WHAT = {
    "input": "waiting for the next batch",
    "host": "host work and kernel launches, the device waiting",
    "compute": "computing",
    "communication": "communication not hidden behind compute",
    "memory": "copying and setting memory",
}
# Without a device nothing waits for launches: the host bound is the loop's Python outside the model.
WHAT_ON_CPU = {**WHAT, "host": "host work outside the model's forward, backward and optimizer step"}
# The usual first moves per bound; for compute and host, those the loop already makes are left out
# where its `loop` facts were recorded (loop_levers).
NEXT_STEPS = {
    "input": "Feed the step faster: DataLoader(num_workers=4, pin_memory=True, persistent_workers=True), "
             "cheaper batch preparation.",
    "host": "Cut host work per step: torch.compile or CUDA graphs for many small kernels, no .item()/print "
            "of device values inside the step, a fused optimizer.",
    "compute": "Make the compute cheaper: bf16 autocast, fused attention (sdpa), a fused optimizer, "
               "torch.compile; then a larger micro-batch while memory allows.",
    "communication": "Hide or shrink communication: overlap it with backward (DDP buckets, FSDP prefetch), "
                     "NCCL on GPUs, fewer or larger collectives, gradient accumulation.",
    "memory": "Lower the peak: activation checkpointing, a smaller micro-batch with gradient accumulation, bf16.",
    "numerics": "Find the first non-finite value: the Numerics page, or gpuprof replay on its bundle.",
}
# The same where no GPU ran: nothing only a GPU has (pinned memory, CUDA graphs, bf16 tensor cores, NCCL).
NEXT_STEPS_WITHOUT_GPU = {
    **NEXT_STEPS,
    "input": "Feed the step faster: loader workers, one per free CPU core (DataLoader(num_workers=..., "
             "persistent_workers=True)), cheaper batch preparation.",
    "host": "Cut host work per step: torch.compile to fuse many small operations, no .item()/print of tensor "
            "values inside the step, a fused optimizer.",
    "compute": "Make the compute cheaper: torch.compile, a fused optimizer, fused attention (sdpa) where the model "
               "has attention; then a larger micro-batch while memory allows.",
    "communication": "Hide or shrink communication: overlap it with backward (DDP buckets, FSDP prefetch), fewer or "
                     "larger collectives, gradient accumulation.",
}
# Findings about how to measure the run, not how to speed it up: never a verdict's next step.
HOST_CONTENTION = "host-contention"
ABOUT_MEASURING = {"warmup-pollution", HOST_CONTENTION}
MISSING_WHY = {
    "phases": "The run did not time the step's phases: waiting for data cannot be told from the work.",
    "trace window": "Without a trace window, communication (and on a GPU, compute from launch overhead) "
                    "cannot be told apart.",
}
HOW_TO_RECORD = {
    "steps": "step records: call prof.step() once per optimizer step",
    "phases": "phase timings: pass model= and optimizer= to gpuprof.profile (its hooks split every step), "
              "or time the parts with prof.phase(\"data\") and friends",
    "trace window": "a trace window: gpuprof.profile(..., trace_steps=range(10, 12)), or "
                    "gpuprof train --trace-steps 10:12",
    "device metrics": "NVML device samples: an NVIDIA GPU with nvidia-ml-py installed, and gpuprof.profile's "
                      "sample_interval_s=\"auto\", its default (every 0.1 s where a GPU is sampled)",
    # Not a verdict's: what the dashboard's pages need beyond a bare trace.
    "numerics": "loss, gradient norms and NaN/Inf checks per step: prof.step(loss=loss); a non-finite step is "
                "then blamed on its module and op, with a bundle to replay",
    "memory snapshots": "CUDA memory snapshots: prof.memory_snapshot() in the loop (memory_history=True for the "
                        "allocation timeline), and one on every out-of-memory error",
}


@dataclass(frozen=True)
class Verdict:
    """`bound`: a diagnoses category, or None when `missing` (a signal of HOW_TO_RECORD) was not recorded."""

    bound: str | None
    share_pct: float | None
    why: str
    next_step: str
    missing: str | None = None
    evaluation: dict | None = None  # the summary's evaluation figures, when the loop evaluates (said in `why`)
    subject: str | None = None  # where the bound lies, when a finding names it ("nan in transformer.wte")

    @property
    def headline(self) -> str:
        if self.bound is None:
            return f"Not enough signal to say what bounds the step: no {self.missing}"
        if self.bound == "failure":
            return f"Stopped by {self.subject or CATEGORY_TITLES[self.bound]}"
        share = f" ({fmt_share(self.share_pct)})" if self.share_pct is not None else ""
        subject = f": {self.subject}" if self.subject else ""
        return f"Bound by {CATEGORY_TITLES[self.bound]}{share}{subject}"

    @property
    def severity(self) -> str:
        """How loudly to show it: critical when the run stopped or its numbers went non-finite; a warning when
        a signal is missing or memory bounds the step; else info (a speed to gain)."""
        if self.bound in STOPPED_BOUNDS:
            return "critical"
        return "warning" if self.bound in (None, "memory") else "info"

    def to_dict(self) -> dict:
        return json_safe({**asdict(self), "headline": self.headline})


def decide(summary, findings: list, trace_steps: pd.DataFrame, device_trace: bool, meta: dict | None = None,
           sites: pd.DataFrame | None = None) -> Verdict:
    """The verdict from the run's summary, its ranked findings and its traces' step breakdown; `meta`,
    the run's, says what the loop already runs with (its `loop` facts), so that the next step is not one
    the loop took; `sites`, the run's hotspots, which of the user's functions hold a share."""
    verdict = bound_verdict(summary, findings, trace_steps, device_trace, meta, sites)
    contention = next((f for f in findings if f.rule == HOST_CONTENTION), None)
    if contention is not None:
        # what the timings mean comes first where they are the verdict; a run that stopped or went non-finite leads
        # with that
        why = (f"{verdict.why} {contention.title}: its times include their load." if verdict.bound in STOPPED_BOUNDS
               else f"{contention_lead(contention)} {verdict.why}")
        verdict = replace(verdict, why=why)
    if not summary.evaluation:
        return verdict
    return replace(verdict, why=f"{verdict.why} {evaluation_text(summary.evaluation, meta)}",
                   evaluation=summary.evaluation)


def contention_lead(contention) -> str:
    """What a run whose host was busy leads with: its timings hold other jobs' load before they hold the loop's."""
    return f"These timings measure the host's other jobs too: {contention.title[0].lower()}{contention.title[1:]}."


def evaluation_text(figures: dict, meta: dict | None = None) -> str:
    every = f"every {fmt(figures['every_steps'], '{:.0f}')} steps, " if figures["every_steps"] is not None else ""
    timed = [site_label(source["function"], source["file"], source["line"])
             for source in (meta or {}).get("phase_sources") or [] if source.get("role") == "eval"]
    calls = f" Timed as evaluation: {', '.join(timed)}." if timed else ""
    return (f"Evaluation inside the loop is left out of the step's bound: {fmt(figures['steps_with_eval'], '{:d}')} "
            f"time(s), {every}{fmt_ms(figures['mean_s'])} each "
            f"({fmt_share(figures['share_pct'])} of the run's time).{calls}")


def bound_verdict(summary, findings: list, trace_steps: pd.DataFrame, device_trace: bool, meta: dict | None,
                  sites: pd.DataFrame | None) -> Verdict:
    stopped = next((f for f in findings if f.category == "failure" and f.severity == "critical"), None)
    if stopped is not None:
        nonfinite = critical_trouble(summary, [f for f in findings if f.category == "numerics"])
        if nonfinite is not None:  # the values went non-finite first: that explains the stop
            return replace(nonfinite, why=f"{nonfinite.why} Then the run stopped: {stopped.title}.")
        return Verdict("failure", None, f"{stopped.title}.", next_step("failure", findings),
                       subject=failure_subject(stopped))
    if summary.n_steps == 0 and summary.damaged_ranks:
        return unreadable_steps(summary.damaged_ranks)
    if summary.n_steps == 0:
        return missing("steps", "The run recorded no step.")
    trouble = critical_trouble(summary, findings) or straggler(findings)
    if trouble is not None:
        return trouble
    shares, sources = step_shares(summary, trace_steps, device_trace)
    # a CPU trace's host time (between its ops) runs on the cores that compute: a bound only where it is the larger
    others = {bound: share for bound, share in shares.items() if bound != "compute" and share >= BOUND_MIN_SHARE_PCT
              and not (bound == "host" and sources[bound] == "CPU trace" and share < shares["compute"])}
    if others:
        bound = max(others, key=others.get)
        return measured(bound, shares[bound], sources[bound], findings, meta, sites)
    signal = missing_signal(summary, shares, grouped=(meta or {}).get("process_group") is not False)
    if signal is not None:
        return unmeasured(signal, summary, shares)
    return measured("compute", shares["compute"], sources["compute"], findings, meta, sites)


def failure_subject(stopped) -> str:
    """What stopped the run, in a few words: a hang, an exception (its type), or a rank that died unseen."""
    if stopped.rule == "rank-hang":
        return "a hang"
    if stopped.evidence.get("raised"):
        return f"an exception ({str(stopped.evidence.get('error') or '').split(':')[0] or 'raised'})"
    return "a dead rank"


def unreadable_steps(ranks: list[int]) -> Verdict:
    """Steps were recorded, in files that cannot be read: not a loop that did not step."""
    return Verdict(None, None, f"The steps files of rank(s) {rank_list(ranks, shown=8)} are damaged and were left "
                   "out (see the notes); no other rank has readable steps.",
                   "Restore the damaged files from a copy, or record the run again.", missing="readable steps")


def with_failed_rules(verdict: Verdict, failures: list[str]) -> Verdict:
    """The verdict saying which rules failed: their findings are missing from what it weighed."""
    if not failures:
        return verdict
    said = "; ".join(failures)
    return replace(verdict, why=f"{verdict.why} Incomplete: {said} (its findings are missing from this verdict).")


def critical_trouble(summary, findings: list) -> Verdict | None:
    """Non-finite training or memory at its limit (an OOM): the run's first problem, whatever its speed."""
    for bound, share_pct, base in (("numerics", nonfinite_steps_pct(summary), "of steps non-finite"),
                                   ("memory", peak_memory_pct(summary), "of device memory at the peak")):
        finding = next((f for f in findings if f.category == bound and f.severity == "critical"), None)
        if finding is not None:
            share_pct = share_pct or None  # an evaluation or update blamed, no training step non-finite: no share
            share = f": {fmt_share(share_pct)} {base}" if share_pct is not None else ""
            return Verdict(bound, share_pct, f"{finding.title}{share}.", next_step(bound, findings),
                           subject=origin_text(finding.evidence.get("origin")))
    return None


def straggler(findings: list) -> Verdict | None:
    """A rank the others wait for at a collective, for a share of the step that bounds it: their phases hold that
    wait (in the backward's all-reduce, or in `other` at a collective of the loop's), so the rank at fault
    bounds the step before any phase share does."""
    finding = next((f for f in findings if f.rule in STRAGGLER_RULES and f.severity != "info"
                    and (f.est_gain_pct or 0.0) >= BOUND_MIN_SHARE_PCT), None)
    if finding is None:
        return None
    rank = finding.evidence.get("last_rank", finding.evidence.get("slow_rank"))
    return Verdict("communication", finding.est_gain_pct, f"{finding.title}.", finding.fix,
                   subject=f"waiting for rank {rank}")


def origin_text(origin) -> str | None:
    """Where a value first went non-finite, in a few words ("nan in transformer.wte"; the step is in the why),
    from a non-finite finding's origin; None when it names no module, tensor or op."""
    origin = origin if isinstance(origin, dict) else {}
    where = origin.get("module") or origin.get("tensor") or origin.get("op")
    return f"{origin.get('first') or 'non-finite'} in {where}" if where else None


def nonfinite_steps_pct(summary) -> float | None:
    health = summary.health
    bad = max(health.get("nonfinite_loss_steps") or 0, health.get("nonfinite_grad_steps") or 0)
    return 100 * bad / summary.n_steps if summary.n_steps else None


def peak_memory_pct(summary) -> float | None:
    peak = summary.peak_mem_reserved_bytes or summary.peak_mem_allocated_bytes
    total = summary.device_mem_total_bytes
    return 100 * peak / total if peak and total else None


def step_shares(summary, trace_steps: pd.DataFrame, device_trace: bool) -> tuple[dict, dict]:
    """Share of step time (pct) per bound, from the signal that measures each; and that signal's name."""
    shares, sources = {}, {}
    on_gpu = summary.device_kind == "cuda"

    def take(values: dict, source: str, bounds) -> None:
        for bound in bounds:
            shares[bound], sources[bound] = values[bound], source

    phases = phase_shares(summary)
    if phases is not None:
        take(phases, "phase timings", ("input",) if on_gpu else ("input", "host", "compute"))
    if not trace_steps.empty:
        trace = trace_shares(trace_steps, device_trace)
        take(trace, "trace window", ("communication",))
        # A CPU trace's host ops are the compute: it measures every bound the phases did not.
        bounds = ("input", "host", "memory", "compute") if device_trace else ("input", "host", "compute")
        take(trace, "device trace" if device_trace else "CPU trace", [b for b in bounds if b not in shares])
    if on_gpu and "compute" not in shares and summary.world_size == 1 and summary.gpu_util_mean_pct is not None:
        busy = summary.gpu_util_mean_pct
        take({"compute": busy, "host": 100 - busy}, "NVML utilization", ("compute", "host"))
    return shares, sources


def phase_shares(summary) -> dict | None:
    """Input, host and compute shares from the phase timings; None when the run did not time phases."""
    split = summary.phase_split_pct
    if any(split.get(phase) is None for phase in MODEL_PHASES):
        return None
    return {"input": split["data"], "host": split.get("other") or 0.0,
            "compute": sum(split.get(phase) or 0.0 for phase in COMPUTE_PHASES)}


def trace_shares(steps: pd.DataFrame, device_trace: bool) -> dict:
    """Share of traced step time per bound, over every step and rank of the trace windows."""
    columns = {bound: list(names) for bound, names in TRACE_COLUMNS.items()}
    columns["host" if device_trace else "compute"].append("cpu_exec_us")
    total_us = float(steps["step_time_us"].sum())
    return {bound: 100 * float(steps[names].to_numpy().sum()) / total_us if total_us else 0.0
            for bound, names in columns.items()}


def missing_signal(summary, shares: dict, grouped: bool = True) -> str | None:
    """The signal still needed before compute can be called the bound, or None when all were measured; `grouped`:
    the ranks joined a process group (without one they do not communicate)."""
    if "input" not in shares:
        return "phases"
    if "communication" not in shares and summary.world_size > 1 and grouped:
        return "trace window"
    if "compute" not in shares:
        return "trace window" if summary.device_kind == "cuda" else "phases"
    return None


def measured(bound: str, share_pct: float, source: str, findings: list, meta: dict | None,
             sites: pd.DataFrame | None = None) -> Verdict:
    what = (WHAT if primary_device(meta or {}).get("kind") == "cuda" else WHAT_ON_CPU)[bound]
    why = f"{what[0].upper()}{what[1:]}: {fmt_share(share_pct)} of step time ({source})"
    where = sites_text(sites, BOUND_PHASES[bound]) if sites is not None and bound in BOUND_PHASES \
        and source == "phase timings" else ""
    why += f"; {where}." if where else "."
    return Verdict(bound, share_pct, why, next_step(bound, findings, meta))


def sites_text(sites: pd.DataFrame, phase: str) -> str:
    """"84 % of the step in get_batch (train.py:116)" for the top user functions of `phase`; or how few stack
    samples it has when too few to name them."""
    rows = top_sites(sites, phase)
    named = [f"{fmt_share(share)} in {label}" for share, label in zip(rows["share_pct"], rows["label"])]
    if named:
        return f"{', '.join(named)} of the step"
    samples = phase_samples(sites, phase)
    if 0 < samples < MIN_PHASE_SAMPLES:
        return f"{samples} stack sample(s) of it, too few to name the functions (a longer run, or a smaller stack_interval_s, names them)"
    return ""


def next_step(bound: str, findings: list, meta: dict | None = None) -> str:
    """Where the step is slow (not a failure or numerics), the fix worth the most: of the findings with an expected
    gain, the largest (one about this bound on a tie). Else the fix of the top warning about this bound that is
    not worth nothing, else the usual first moves the loop does not make yet, else the fix of an information-only
    finding about it (one below its rule's threshold: a small share)."""
    actionable = [f for f in findings if f.rule not in ABOUT_MEASURING]
    worth = [f for f in actionable if f.worth_pct > 0]
    if worth and bound not in STOPPED_BOUNDS:
        return fix_of(max(worth, key=lambda f: (f.worth_pct, f.category == bound)))
    about = [f for f in actionable if f.category == bound and (f.est_gain_pct is None or f.worth_pct > 0)]
    warning = next((f for f in about if f.severity != "info"), None)
    if warning is not None:
        return fix_of(warning)
    levers = loop_levers(bound, meta, minor={f.rule for f in findings if f.severity == "info"})
    if not levers and about:
        return fix_of(about[0])
    if levers is None:
        return (NEXT_STEPS if Hardware.of(meta or {}).on_gpu else NEXT_STEPS_WITHOUT_GPU)[bound]
    if bound == "host":
        return f"Cut host work per step: {', '.join(levers)}."
    if not levers:
        return ("The usual levers are in place (autocast, fused attention and optimizer, torch.compile): a larger "
                "micro-batch while memory allows, then the slowest kernels of a trace window (gpuprof trace).")
    return f"Make the compute cheaper: {', '.join(levers)}; then a larger micro-batch while memory allows."


def fix_of(finding) -> str:
    gain = f", est. gain {fmt_share(finding.worth_pct)} of step time" if finding.worth_pct > 0 else ""
    return f"{finding.fix} (finding {finding.rule}{gain})"


def loop_levers(bound: str, meta: dict | None, minor: set[str] = frozenset()) -> list[str] | None:
    """NEXT_STEPS' levers for a compute or host bound that the loop does not use yet, read from its `loop`
    facts; None for another bound or without the facts. `minor`: the rules whose findings are information only
    (the fused optimizer is left out when UNFUSED_OPTIMIZER's is: the optimizer is a small share of the step)."""
    loop = (meta or {}).get("loop") or {}
    model, optimizer = loop.get("model"), loop.get("optimizer") or {}
    if bound not in ("compute", "host") or not isinstance(model, dict):
        return None
    compiled = bool(model.get("compiled"))
    unfused = unfused_optimizers(optimizer) if UNFUSED_OPTIMIZER not in minor else []
    fused = f"a fused optimizer (torch.optim.{unfused[0].get('class') or 'AdamW'}(..., fused=True))" if unfused else ""
    on_gpu = primary_device(meta).get("kind") == "cuda"
    if bound == "host":
        wanted = {
            "torch.compile(model) or CUDA graphs for many small kernels": not compiled and on_gpu,
            "torch.compile(model) to fuse many small operations": not compiled and not on_gpu,
            "CUDA graphs (torch.compile(model, mode='reduce-overhead'))": compiled and on_gpu,
            "no .item()/print of device values inside the step": True,
            fused: bool(unfused),
        }
    else:
        wanted = {
            Hardware.of(meta).autocast or "": on_gpu and recorded_dtype(meta) in FP32_NAMES,
            "fused attention (torch.nn.functional.scaled_dot_product_attention)": eager_attention(model),
            fused: bool(unfused),
            "torch.compile(model)": not compiled,
        }
    return [lever for lever, missing_here in wanted.items() if missing_here]


def unmeasured(signal: str, summary, shares: dict) -> Verdict:
    """The verdict when no measured bound stands out and `signal`, needed to rule the rest out, is missing."""
    measured_text = ", ".join(f"{CATEGORY_TITLES[bound]} {fmt_share(share)}" for bound, share in shares.items())
    why = MISSING_WHY[signal] + (f" Measured: {measured_text} of step time." if measured_text else "")
    one_gpu = summary.device_kind == "cuda" and summary.world_size == 1
    return missing(signal, why, alternative="device metrics" if one_gpu and signal == "trace window" else None)


def missing(signal: str, why: str, alternative: str | None = None) -> Verdict:
    how = HOW_TO_RECORD[signal] + (f"; or {HOW_TO_RECORD[alternative]}" if alternative else "")
    return Verdict(None, None, why, f"Record {how}.", missing=signal)
