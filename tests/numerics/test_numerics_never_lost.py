"""A detection is never lost, on any loop: hypothesis writes training loops (the loss's shape and where it
is made, the precision, accumulation, clipping, one or two optimizers, where and when a value goes
non-finite) and every one of them gives a `nonfinite` event at its first bad step, blamed or with the
reason it could not be, while no part of capture switches itself off."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from numerics_helpers import events
from transformers.modeling_outputs import CausalLMOutput

import gpuprof
from gpuprof.numerics.blame import NOT_REPRODUCED
from gpuprof.numerics.investigation import STEPPED_DESPITE_SCALER
from gpuprof.numerics.detectors import PERSISTENT_OVERFLOW_STEPS
from gpuprof.run.schema import BLAME_PHASES, EventKind

pytestmark = pytest.mark.newest_torch  # run again on the newest torch tested (scripts/test.sh)

VOCAB, WIDTH, SEQ, BATCH = 32, 16, 8, 2
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_SHAPES = ("0-d", "[1]", "vector", "float", "dict", "model output")
FAULTS = ("forward", "loss", "weight", "gradient")
# Reproducible in CI: the same examples every run, none remembered between runs; a loop's time is no failure.
# No shrinking: a failing example is printed as found, within the test's time on a loaded CPU.
NEVER_LOST = settings(max_examples=24, deadline=None, derandomize=True, database=None,
                      phases=[Phase.explicit, Phase.reuse, Phase.generate], suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Loop:
    loss_shape: str
    loss_in_model: bool
    precision: str
    accumulation: int
    clip: bool
    optimizers: int
    fault: str
    fault_step: int
    fault_micro_batch: int

    @property
    def first_bad_step(self) -> int:
        """A GradScaler skips steps with non-finite gradients (its business) until it has skipped a few in a
        row; a non-finite loss is flagged at once. With two optimizers and clipping, the loop clips every
        parameter after unscaling both: the NaN total norm turns the head's finite gradients NaN after its
        optimizer found none, and that optimizer steps with them: a bad step at once."""
        if self.fault == "gradient" and self.precision == "fp16" and not (self.clip and self.optimizers == 2):
            return self.fault_step + PERSISTENT_OVERFLOW_STEPS - 1
        return self.fault_step

    @property
    def steps(self) -> int:
        return self.first_bad_step + 2


@st.composite
def loops(draw) -> Loop:
    accumulation = draw(st.sampled_from([1, 2]))
    return Loop(
        loss_shape=draw(st.sampled_from(LOSS_SHAPES)), loss_in_model=draw(st.booleans()),
        precision=draw(st.sampled_from(tuple(DTYPES))), accumulation=accumulation, clip=draw(st.booleans()),
        optimizers=draw(st.sampled_from([1, 2])), fault=draw(st.sampled_from(FAULTS)),
        fault_step=draw(st.integers(1, 3)), fault_micro_batch=draw(st.integers(0, accumulation - 1)),
    )


class TinyLM(torch.nn.Module):
    """Embedding, one hidden layer, a head; its loss terms when given targets. `poison` makes the hidden
    activations (forward), their gradient (backward) or its loss non-finite."""

    def __init__(self, loss_shape: str):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.hidden = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)
        self.loss_shape = loss_shape
        self.poison: str | None = None

    def forward(self, tokens, targets=None):
        hidden = torch.tanh(self.hidden(self.embed(tokens)))
        if self.poison == "forward":
            hidden = hidden * float("nan")
        elif self.poison == "gradient":
            hidden = hidden + 0.0  # a tensor of its own for the hook
            hidden.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        logits = self.head(hidden)
        return logits if targets is None else loss_terms(logits, targets, self.loss_shape, self.poison == "loss")


def loss_terms(logits, targets, shape: str, poisoned: bool):
    """The loss in the loop's `shape`: the language-model loss and a small auxiliary term."""
    lm = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    aux = 1e-3 * logits.float().pow(2).mean()
    if poisoned:
        aux = aux * torch.log(torch.zeros((), device=aux.device))  # -inf: the loss function's own op goes bad
    if shape == "vector":
        return torch.stack([lm.float(), aux])
    if shape == "dict":
        return {"lm": lm, "aux": aux}
    total = lm + aux
    if shape == "model output":  # a Hugging Face output: logits beside the loss
        return CausalLMOutput(loss=total, logits=logits)
    return total.reshape(1) if shape == "[1]" else total


def backward_target(loss) -> torch.Tensor:
    """What the loop calls backward() on: the sum of its loss terms."""
    if isinstance(loss, CausalLMOutput):
        return loss.loss
    return sum(loss.values()) if isinstance(loss, dict) else loss.sum()


def reported(loss, shape: str):
    """What the loop passes to prof.step(loss=...)."""
    if shape == "float":
        return float(backward_target(loss).detach())
    if shape == "model output":
        return loss
    return {k: v.detach() for k, v in loss.items()} if isinstance(loss, dict) else loss.detach()


def run_loop(loop: Loop, run_dir: str) -> None:
    torch.manual_seed(0)
    model = TinyLM("0-d" if loop.loss_shape == "float" else loop.loss_shape)
    if loop.optimizers == 2:  # Muon-style: one optimizer for the matrices, another for the rest
        optimizers = [torch.optim.AdamW([*model.embed.parameters(), *model.hidden.parameters()], lr=1e-3),
                      torch.optim.SGD(model.head.parameters(), lr=1e-2)]
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=loop.precision == "fp16")
    dtype = DTYPES[loop.precision]
    generator = torch.Generator().manual_seed(1)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizers if len(optimizers) > 1 else optimizers[0],
                         scaler=scaler, sample_interval_s=0) as prof:
        for step in range(loop.steps):
            if loop.fault == "weight" and step == loop.fault_step:
                with torch.no_grad():
                    model.hidden.weight[0, 0] = float("nan")
            losses = []  # the step's micro-batch losses: passed together, as accumulating loops pass them
            for micro in range(loop.accumulation):
                bad_here = step == loop.fault_step and micro == loop.fault_micro_batch
                persists = loop.fault == "gradient" and step > loop.fault_step  # the scaler's skips must persist
                model.poison = loop.fault if bad_here or persists else None
                tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
                targets = tokens.roll(-1, 1)
                with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                    if loop.loss_in_model:
                        loss = model(tokens, targets)
                    else:
                        loss = loss_terms(model(tokens), targets, model.loss_shape, model.poison == "loss")
                scaler.scale(backward_target(loss) / loop.accumulation).backward()
                losses.append(reported(loss, loop.loss_shape))
            if loop.clip:
                for optimizer in optimizers:
                    scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for optimizer in optimizers:
                scaler.step(optimizer)
            scaler.update()
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            prof.step(loss=losses if loop.accumulation > 1 else losses[0], tokens=tokens.numel() * loop.accumulation)


@pytest.mark.timeout(1800)
@NEVER_LOST
@given(loop=loops())
def test_every_loop_reports_its_first_bad_step(loop):
    with tempfile.TemporaryDirectory() as run_dir:
        run_loop(loop, run_dir)
        switched_off = events(run_dir, EventKind.COLLECTOR_DISABLED) + events(run_dir, EventKind.PROFILER_DISABLED)
        assert not switched_off, [event["message"] for event in switched_off]
        nonfinite = events(run_dir, EventKind.NONFINITE)
        assert nonfinite, f"{loop}: no nonfinite event"
        first = min(nonfinite, key=lambda event: event["step"])
        assert first["step"] == loop.first_bad_step, (loop, first["message"])
        reasons = [note for note in first["notes"] if note.startswith(NOT_REPRODUCED)]
        assert first["phase"] in BLAME_PHASES or reasons, (loop, first["message"])
        steps = gpuprof.load_run(run_dir).steps
        before = steps[steps["step"] < loop.fault_step]
        assert before["loss"].map(float).notna().all() and before["loss_finite"].all(), loop


def test_a_scaler_skipping_one_of_two_optimizers_says_that_the_other_stepped():
    """The hidden layer's gradient goes inf: AdamW (embedding, hidden layer) finds it and is skipped, SGD (the head,
    whose gradient is finite) steps."""
    loop = Loop(loss_shape="0-d", loss_in_model=True, precision="fp16", accumulation=1, clip=False, optimizers=2,
                fault="gradient", fault_step=1, fault_micro_batch=0)
    with tempfile.TemporaryDirectory() as run_dir:
        run_loop(loop, run_dir)
        skipped = {event["step"]: event for event in events(run_dir, EventKind.STEP_SKIPPED)}
    assert "skipped the step of 1 of 2 optimizers (the rest stepped) at step 1" in skipped[1]["message"]
    assert (skipped[1]["skipped_optimizers"], skipped[1]["optimizers"]) == (1, 2)


def test_an_optimizer_stepping_with_gradients_a_clip_made_nonfinite_is_the_first_bad_step():
    """The AMP recipe for several optimizers, with a clip over all of them: the hidden layer's gradient goes inf,
    the clip's NaN total norm turns the head's gradients NaN after SGD's unscale found them finite, and SGD steps.
    The step is reported there, blamed on the backward pass that made the inf, with why a scaler did not stop it."""
    loop = Loop(loss_shape="0-d", loss_in_model=True, precision="fp16", accumulation=1, clip=True, optimizers=2,
                fault="gradient", fault_step=2, fault_micro_batch=0)
    with tempfile.TemporaryDirectory() as run_dir:
        run_loop(loop, run_dir)
        first = min(events(run_dir, EventKind.NONFINITE), key=lambda event: event["step"])
    assert (first["step"], first["phase"], first["trigger"]) == (2, "backward", "grads"), first
    assert STEPPED_DESPITE_SCALER in first["notes"]
