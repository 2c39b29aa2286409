"""Non-finite values, GradScaler trouble and an LR scheduler stepping on skipped steps.

Detection is gpuprof.numerics': the events its monitor recorded live when it ran for the
whole run, else its detectors replayed over the recorded steps (a run recorded with
`numerics=False`, or whose monitor was switched off). The rules add evidence and a fix.
"""

from __future__ import annotations

import pandas as pd

from gpuprof.analysis.run.summary import column, flag
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule
from gpuprof.numerics.blame import EVALUATION_TRIGGER, Blame
from gpuprof.numerics.detectors import ScalerTimeline
from gpuprof.run import query as q
from gpuprof.run.schema import BLAME_PHASES, EventKind, bundle_in_run, source_text

NUMERICS_COLLECTOR = "numerics"
SCALER_TROUBLE_KINDS = (EventKind.SCALER_PERSISTENT_OVERFLOW, EventKind.SCALER_SCALE_BELOW_ONE)


def as_event_dicts(events: pd.DataFrame) -> list[dict]:
    """Recorded events in the shape gpuprof.numerics' detectors return: kind, step, message, details."""
    return [
        {"kind": row.kind, "step": None if pd.isna(row.step) else int(row.step), "message": row.message,
         "details": row.details if isinstance(row.details, dict) else {}}
        for row in events.sort_values("time_unix_s").itertuples()
    ]


def numerics_ran_live(ctx) -> bool:
    """The numerics monitor was on and never switched off, so its events are complete."""
    if (ctx.meta.get("options") or {}).get("numerics", False) is False:
        return False
    disabled = as_event_dicts(ctx.events_of(EventKind.COLLECTOR_DISABLED))
    return not any(event["details"].get("collector") == NUMERICS_COLLECTOR for event in disabled)


def detector_events(ctx, kinds: tuple[str, ...], replay) -> list[dict]:
    """The run's live events of `kinds`, or `replay()` when the monitor did not run throughout."""
    if numerics_ran_live(ctx):
        return as_event_dicts(ctx.events_of(*kinds))
    return [event for event in replay() if event["kind"] in kinds]


@rule("nonfinite-values", "numerics")
def nonfinite_values(ctx):
    # Only the rows with a false flag come back: a run of any size has few of them.
    steps = ctx.step_rows(q.any_false("loss_finite", "grad_norm_finite"))
    bad_loss = ~flag(steps, "loss_finite", True)
    # A non-finite gradient GradScaler caught and skipped is its normal calibration, not damage.
    bad_grad = ~flag(steps, "grad_norm_finite", True) & ~flag(steps, "step_skipped", False)
    blames = as_event_dicts(ctx.events_of(EventKind.NONFINITE))
    bad = steps[bad_loss | bad_grad]
    if bad.empty and not blames:
        return None
    blame = blames[0] if blames else None
    first_step = int(bad["step"].min()) if not bad.empty else blame["step"]
    return Finding(
        rule="nonfinite-values",
        severity="critical",
        title=_title(blame, first_step, bad.empty) + (_blame_text(blame, first_step) if blame else ""),
        evidence={
            "first_nonfinite_step": first_step,
            "nonfinite_loss_steps": steps.loc[bad_loss, "step"].nunique(),
            "nonfinite_grad_unskipped_steps": steps.loc[bad_grad, "step"].nunique(),
            "origin": {"step": blame["step"], **blame["details"]} if blame else None,
        },
        fix=_replay_text(ctx, blame) + _start_text(blame) + " Usual causes: an LR too high (lower it, add warm-up"
        + (", `clip_grad_norm_(1.0)`" if ctx.loop_clipping is None else "") + "), fp16 overflow (use bf16 or a "
        "GradScaler), log/sqrt/divide of zero (add an epsilon), bad input data.",
    )


def _title(blame: dict | None, first_step: int, steps_finite: bool) -> str:
    """What went non-finite: a training step's loss or gradients, or only an evaluation after its update."""
    if steps_finite and blame and blame["details"].get("trigger") == EVALUATION_TRIGGER:
        return f"Non-finite evaluation output after step {first_step}'s update (no training step after it)"
    return f"Non-finite loss or gradients from step {first_step}"


def _blame_text(blame: dict, first_step: int) -> str:
    """The blame after the title's "from step N": its step only where it is another one."""
    what = Blame.from_details({"rank": 0, "step": blame["step"], **blame["details"]}).what_and_where()
    return f": {what}" if blame["step"] == first_step else f"; at step {blame['step']}: {what}"


def _replay_text(ctx, blame: dict | None) -> str:
    """The command that re-runs the blamed step, with the bundle where the run keeps it; none where this copy
    of the run holds no bundle (copies leave them out: they hold the model and optimizer state)."""
    recorded = blame["details"].get("bundle") if blame else None
    if not recorded or not bundle_in_run(ctx.run.path, recorded).is_file():
        return ""
    here = str(bundle_in_run(ctx.run.path, recorded))
    # what re-runs it, as training wrote it (numerics.investigation.replay_command), the bundle where it is now
    command = (blame["details"].get("replay_with") or f"gpuprof replay {recorded}").replace(recorded, here)
    if "\n" in command:  # the command line cannot rebuild this model: the Python that replays it
        return f"Re-run the first bad step from Python (the command line cannot rebuild this model):\n{command}\n"
    return f"Re-run the first bad step with `{command}`. "


def _start_text(blame: dict | None) -> str:
    """Where to start looking: the blamed tensor, module, op and source line that were found."""
    details = blame["details"] if blame else {}
    if details.get("phase") == "state":
        return f"Start at `{details.get('tensor')}`: {BLAME_PHASES['state']}, so look at the update before it."
    where = [f"`{details[key]}`" for key in ("module", "op") if details.get(key)]
    if details.get("source"):
        behind = f" (in `{source_text(details['library_source'])}`)" if details.get("library_source") else ""
        where.append(f"the line `{source_text(details['source'])}`{behind}")
    if not where:
        return "Start at the first non-finite step's inputs and the loss."
    return f"Start at {', '.join(where)} ({details.get('phase')} pass)."


def replay_scaler(steps: pd.DataFrame) -> list[dict]:
    timeline = ScalerTimeline()
    skipped = flag(steps, "step_skipped", False)
    events = []
    for step, was_skipped, scale in zip(steps["step"], skipped, column(steps, "scaler_scale")):
        if pd.notna(scale):
            events += timeline.observe(int(step), bool(was_skipped), float(scale))
    return events


def scaler_fix(hardware) -> str:
    """bf16 needs no scaler, but only a GPU from Ampere on has it: elsewhere the overflow itself is the fix."""
    bf16 = {True: "use bf16 autocast (no scaler needed); otherwise ",
            None: "use bf16 autocast (no scaler needed) on Ampere or newer; otherwise "}.get(hardware.bf16, "")
    return (f"Gradients overflow fp16 again and again: {bf16}find the overflowing layer (see nonfinite-values), "
            "lower the LR, clip gradients after scaler.unscale_(optimizer). A scale below 1 means the gradients "
            "are non-finite even unscaled: a real NaN, not an fp16 range problem.")


@rule("gradscaler-trouble", "numerics")
def gradscaler_trouble(ctx):
    steps = ctx.first_rank_steps  # numerics figures are the same on every DDP rank
    if steps.empty or column(steps, "scaler_scale").isna().all():
        return None
    trouble = detector_events(ctx, SCALER_TROUBLE_KINDS, lambda: replay_scaler(steps))
    if not trouble:
        return None
    skipped = flag(steps, "step_skipped", False)
    # Skips before the first real step are GradScaler finding its scale (benign warm-up).
    after_warmup = skipped.iloc[int(skipped.to_numpy().argmin()):] if not skipped.all() else skipped
    scale = column(steps, "scaler_scale").dropna()
    collapsed = any(event["kind"] == EventKind.SCALER_SCALE_BELOW_ONE for event in trouble)
    return Finding(
        rule="gradscaler-trouble",
        severity="critical" if collapsed else "warning",
        title=f"GradScaler skipped {int(after_warmup.sum())} of {len(after_warmup)} optimizer steps after warm-up"
        + (f"; its scale fell to {scale.min():g}" if collapsed else ""),
        evidence={
            "skipped_steps": int(skipped.sum()),
            "skipped_after_warmup_steps": int(after_warmup.sum()),
            "steps": len(skipped),
            "events": [{"kind": e["kind"], "step": e["step"], **e["details"]} for e in trouble],
            "scaler_scale_last": float(scale.iloc[-1]),
            "scaler_scale_min": float(scale.min()),
        },
        fix=scaler_fix(ctx.hardware),
        # Every skipped step after warm-up is a wasted step.
        est_gain_pct=100 * float(after_warmup.sum()) / len(skipped),
    )


@rule("lr-step-on-skipped", "numerics")
def lr_step_on_skipped(ctx):
    events = ctx.events_of(EventKind.LR_STEP_ON_SKIPPED)
    if events.empty:
        return None
    steps = sorted(int(step) for step in events["step"].dropna().unique())
    return Finding(
        rule="lr-step-on-skipped",
        severity="warning",
        title=f"The LR scheduler stepped on {len(steps)} step(s) where GradScaler skipped optimizer.step()",
        evidence={"steps": steps[:20], "count": len(steps)},
        fix=(
            "Step the scheduler only when the optimizer stepped: scale = scaler.get_scale(); "
            "scaler.update(); if scaler.get_scale() >= scale: scheduler.step()."
        ),
    )
