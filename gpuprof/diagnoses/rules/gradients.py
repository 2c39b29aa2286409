"""Training dynamics: exploding or vanishing gradients and loss spikes.

Spikes and per-block outliers are defined once, in gpuprof.numerics.detectors: the rules
take the events the numerics monitor recorded, or replay its detectors over the recorded
steps and layers when it did not run throughout (see numerics.detector_events).
"""

from __future__ import annotations

import pandas as pd

from gpuprof.analysis.run.summary import column
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule
from gpuprof.diagnoses.rules.numerics import detector_events
from gpuprof.numerics.detectors import LayerGradients, SpikeDetector
from gpuprof.run.schema import EventKind


def replay_spikes(steps: pd.DataFrame, name: str, kind: str) -> list[dict]:
    detector = SpikeDetector(kind, name)
    events = []
    for step, value in zip(steps["step"], column(steps, name)):
        events += detector.observe(int(step), None if pd.isna(value) else float(value))
    return events


def replay_blocks(layers: pd.DataFrame) -> list[dict]:
    """LayerGradients' exploding/vanishing events, replayed over the per-parameter gradient norms."""
    params = layers[layers["level"] == "param"] if "level" in layers.columns else layers
    params = params[params["rank"] == params["rank"].min()] if not params.empty else params
    if params.empty:
        return []
    names = list(dict.fromkeys(params["layer"]))
    # one row per step, a column per parameter in the order recorded (one pivot: a groupby per step took
    # a quarter of a second over 10k steps)
    wide = params.pivot_table(index="step", columns="layer", values="grad_norm", aggfunc="last", dropna=False)
    wide = wide.reindex(columns=names).sort_index()
    detector = LayerGradients(names)
    events = []
    for step, norms in zip(wide.index, wide.to_numpy(dtype="float64")):
        if not pd.isna(norms).any():
            events += detector.observe(int(step), norms.tolist())
    return events


def spikes(ctx, name: str, kind: str) -> list[dict]:
    steps = ctx.first_rank_steps
    return detector_events(ctx, (kind,), lambda: replay_spikes(steps, name, kind) if not steps.empty else [])


def block_outliers(ctx, kind: str) -> list[dict]:
    # One replay yields both exploding and vanishing events: run it once for both rules.
    return detector_events(ctx, (kind,), lambda: ctx.memo("replayed_blocks", lambda: replay_blocks(ctx.first_rank_layers)))


def event_summary(events: list[dict]) -> list[dict]:
    return [{"step": event["step"], **event["details"]} for event in events[:10]]


@rule("exploding-gradients", "numerics")
def exploding_gradients(ctx):
    norm_spikes = spikes(ctx, "grad_norm", EventKind.GRAD_NORM_SPIKE)
    blocks = block_outliers(ctx, EventKind.EXPLODING_GRADIENT)
    if not norm_spikes and not blocks:
        return None
    first = (norm_spikes or blocks)[0]
    return Finding(
        rule="exploding-gradients",
        severity="warning",
        title=f"Gradients exploded at step {first['step']}"
        + (f" in {first['details']['layer']}" if "layer" in first["details"] else ""),
        evidence={
            "grad_norm_spikes": event_summary(norm_spikes),
            "exploding_blocks": event_summary(blocks),
            "grad_clip": ctx.config_value("grad_clip", "max_grad_norm"),
            "loop_clips_to": (ctx.loop_clipping or {}).get("max_norm"),
        },
        fix=_clip_advice(ctx) + "lower the peak LR or lengthen its warm-up, and check the batch at that step.",
    )


def _clip_advice(ctx) -> str:
    """Clip, unless the loop does already: then clipping bounded the update, not what grew the gradients."""
    clipping = ctx.loop_clipping
    if clipping is None:
        return (f"Clip gradients: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"
                f"{ctx.workload_flags('--grad-clip 1.0')}; ")
    to = "" if clipping.get("max_norm") is None else f" to {clipping['max_norm']:g}"
    return (f"The loop already clips gradients{to}, which bounds each update but not what made the gradients "
            "grow: ")


@rule("vanishing-gradients", "numerics")
def vanishing_gradients(ctx):
    blocks = block_outliers(ctx, EventKind.VANISHING_GRADIENT)
    if not blocks:
        return None
    return Finding(
        rule="vanishing-gradients",
        severity="warning",
        title=f"{len(blocks)} block(s) get gradients far smaller than the median block",
        evidence={"vanishing_blocks": event_summary(blocks)},
        fix=(
            "Check those blocks' initialisation and activations (saturating sigmoid/tanh, a missing "
            "residual or LayerNorm, a detach() cutting the graph); for deep stacks use pre-LayerNorm "
            "residual blocks and scaled init."
        ),
    )


@rule("loss-spike", "numerics")
def loss_spike(ctx):
    found = spikes(ctx, "loss", EventKind.LOSS_SPIKE)
    if not found:
        return None
    first = found[0]
    return Finding(
        rule="loss-spike",
        severity="warning",
        title=f"Loss spiked to {first['details']['value']:.4g} at step {first['step']}",
        evidence={"spikes": event_summary(found)},
        fix=(
            "Lower the LR or lengthen warm-up, clip gradients, and look at the data in the spiking "
            "steps (corrupt or out-of-distribution batches); with Adam, a larger eps or lower beta2 helps."
        ),
    )
