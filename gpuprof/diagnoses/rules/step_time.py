"""Step-time statistics: erratic steps, and warm-up steps that would distort averages."""

from __future__ import annotations

from gpuprof.analysis.run.slow_steps import SlowSteps, slow_steps
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.knob import knob
from gpuprof.diagnoses.registry import rule
from gpuprof.diagnoses.rules.host_load import CONTENTION_FIX

STEP_TIME_CV_WARNING = 0.25
# A steady rate needs this many measured steps before its spread means anything.
MIN_MEASURED_STEPS = 5
WARMUP_INFLATION_INFO_PCT = 10.0
VARIANCE_FIX = (
    "Look at what the slow steps do differently: periodic evaluation, checkpointing or logging "
    "inside the loop, data-loader stalls, Python GC (gc.freeze() after setup), recompilation on "
    "new shapes (pad to fixed lengths)."
)


@rule("step-time-variance", "host")
def step_time_variance(ctx):
    summary = ctx.summary
    if summary.measured_steps < MIN_MEASURED_STEPS or summary.step_time_cv is None:
        return None
    cv, p50_s, p99_s = summary.step_time_cv, summary.step_time_p50_s, summary.step_time_p99_s
    if cv < STEP_TIME_CV_WARNING:
        return None
    times = summary.training_step_times  # evaluation left out, as in every step-time figure
    evaluation = summary.eval_times.reindex(times.index).fillna(0.0)
    slow = times[times >= summary.step_time_p90_s]
    profile = slow_steps(ctx.run.query, times.index, slow.index, evaluation, ctx.first_rank)
    title = f"Step time is erratic: p99 {p99_s:.3g}s vs p50 {p50_s:.3g}s{slow_steps_clause(profile)}"
    fix = slow_steps_sites_text(profile) + VARIANCE_FIX
    load = ctx.host_load
    # Running every step at the median speed would save the excess of the mean over it; none of that is the
    # loop's to gain where the host's other jobs made the spread.
    gain_pct = max(0.0, 100 * (1 - p50_s / summary.step_time_mean_s))
    if load is not None and load.slow_steps_contended:
        title += f"; the slowest steps ran while other processes held {load.slow_steps_excess_cores:.1f} more CPUs"
    # the host made the spread where its load rose in the slow steps, or where it was busy throughout and the
    # slow steps show nothing of the loop's own (no line of it holds their extra time)
    if load is not None and (load.slow_steps_contended or (load.contended and not profile.sites)):
        title += "; the spread comes from the host's other jobs as much as from the loop, so no gain is claimed"
        fix = f"{CONTENTION_FIX} Then, if steps are still erratic: {fix[0].lower()}{fix[1:]}"
        gain_pct = None
    return Finding(
        rule="step-time-variance",
        severity="warning",
        title=title,
        evidence={
            "step_time_cv": cv,
            "step_time_p50_s": p50_s,
            "step_time_p99_s": p99_s,
            "slowest_steps": [int(step) for step in slow.index[:10]],
            "evaluation_left_out": bool(summary.evaluation),
            **profile.to_dict(),
            "threshold_cv": STEP_TIME_CV_WARNING,
            **(load.to_dict() if load is not None else {}),
        },
        fix=fix,
        est_gain_pct=gain_pct,
    )


def slow_steps_clause(profile: SlowSteps) -> str:
    """"; the slowest steps take +0.0031s more in other, all of them evaluating" (nothing when no phase grew)."""
    if profile.phase is None:
        return ""
    evaluating = {0: "", len(profile.steps): ", all of them steps that evaluate"}.get(
        profile.evaluating, f", {profile.evaluating} of them steps that evaluate")
    return f"; the slowest steps take +{profile.excess_s:.3g}s more in {profile.phase}{evaluating}"


def slow_steps_sites_text(profile: SlowSteps) -> str:
    """Where the stack sampler found the loop in that extra time, as the user's lines."""
    if not profile.sites:
        return ""
    named = ", ".join(f"{label} ({count} of {profile.samples} sample(s))" for label, count in profile.sites.items())
    return f"In the slowest steps' {profile.phase} time the loop was at {named}. "


@rule("warmup-pollution", "host")
def warmup_pollution(ctx):
    summary = ctx.summary
    measured_mean_s = float(summary.measured_step_times.mean()) if summary.measured_steps else None
    if not summary.warmup.n_steps or not measured_mean_s:
        return None
    all_mean_s = float(summary.step_times.mean())  # evaluation in, on both sides
    inflation_pct = 100 * (all_mean_s / measured_mean_s - 1)
    if inflation_pct < WARMUP_INFLATION_INFO_PCT:
        return None
    return Finding(
        rule="warmup-pollution",
        severity="info",
        title=f"The first {summary.warmup.n_steps} step(s) would inflate the mean step time by {inflation_pct:.0f}%",
        evidence={
            "warmup_steps": summary.warmup.n_steps,
            "warmup_reason": summary.warmup.reason,
            "step_time_mean_all_s": all_mean_s,
            "step_time_mean_measured_s": measured_mean_s,
            "inflation_pct": inflation_pct,
            "threshold_pct": WARMUP_INFLATION_INFO_PCT,
        },
        fix=(
            f"Leave the first {summary.warmup.n_steps} step(s) out of any benchmark (gpuprof's figures "
            "already do); with torch.compile, run warm-up iterations before timing and mark dynamic "
            "dimensions to avoid recompiles."
        ),
    )


@knob("gc-freeze", rule="step-time-variance")
def gc_freeze(patch):
    """gc.freeze() once the model and optimizer exist (at the script's first optimizer step): the objects
    built during setup move out of the collector's reach, so its passes over them stop stalling steps."""

    def freeze(model) -> str:
        import gc

        gc.freeze()
        return "import gc\ngc.freeze()  # after setup: the collector no longer walks what setup built"

    patch.model(freeze)
