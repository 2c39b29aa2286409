"""When the Profiler itself breaks, its collectors stop: none of their code runs in the loop afterwards (no hook
on the model, the optimizer, autograd's engine, the GradScaler or clip_grad_norm_), and training goes on. What
still runs is cheap and never lets a detection go: the step records, the loss taken at backward() and its
non-finite flag, until they fail too. A collector that fails alone is switched off alone: the others, NaN
forensics among them, still blame a later non-finite step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import capture_loop
import torch
from capture_loop import POISONED, batch, tiny_model

import gpuprof
from gpuprof.capture import losses
from gpuprof.capture.profiler import STILL_RUNNING
from gpuprof.numerics.blame import NOT_REPRODUCED
from gpuprof.run.schema import EventKind

pytestmark = pytest.mark.newest_torch  # run again on the newest torch tested (scripts/test.sh)
GPUPROF_DIR = str(Path(gpuprof.__file__).parent)
BREAKS_AT = 2
STEPS = 6
FAILS_AT, NAN_AT, LOOP_STEPS = 3, 6, 8


class Calls:
    """Every Python function of gpuprof that runs while it is watching (sys.setprofile sees hooks called
    from C too)."""

    def __init__(self):
        self.seen: list[str] = []

    def __enter__(self):
        sys.setprofile(self._on_event)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)

    def _on_event(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(GPUPROF_DIR):
            self.seen.append(f"{frame.f_code.co_filename.removeprefix(GPUPROF_DIR)}:{frame.f_code.co_name}")


def break_the_writer_at(prof, step: int, stream: str = "steps", until: int | None = None) -> None:
    """The disk fills up: writing `stream` fails from `step` on (events still write), until step `until` if given
    (space freed)."""
    write = prof.writer.write

    def write_or_fail(stream_written, records):
        if stream_written == stream and step <= prof.step_index < (until or float("inf")):
            raise OSError(28, "No space left on device")
        return write(stream_written, records)

    prof.writer.write = write_or_fail


def training_step(model, optimizer, scaler, step: int) -> float:
    tokens = batch(step)
    loss = model(input_ids=tokens, labels=tokens).loss
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@pytest.mark.capture_may_switch_off
def test_a_broken_profiler_runs_none_of_its_code_in_the_loop_again(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    watched_before, watched_after = [], []
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, scaler=scaler,
                         sample_interval_s=0, layer_interval=1) as prof:
        break_the_writer_at(prof, BREAKS_AT)
        for step in range(STEPS):
            with Calls() as calls:
                training_step(model, optimizer, scaler, step)
            (watched_before if step < BREAKS_AT else watched_after).append(calls.seen)
            prof.step()
        broken_at = prof.step_index
    assert all(watched_before), "gpuprof's hooks ran in every step before the break"
    assert watched_after[0], "the step that broke it was watched"
    # the step after: only the loss taken at backward(), for the bare step record that fails too (the disk is full)
    assert watched_after[1] and {call.split(":")[0] for call in watched_after[1]} <= {"/capture/losses.py",
                                                                                      "/torch_compat.py"}
    assert watched_after[2:] == [[]] * (STEPS - BREAKS_AT - 2), watched_after[2:]
    assert broken_at == BREAKS_AT + 2  # the step counter went on while the bare step records ran
    run = gpuprof.load_run(tmp_path / "run")
    disabled = run.events[run.events["kind"] == EventKind.PROFILER_DISABLED]
    assert disabled["step"].tolist() == [BREAKS_AT, BREAKS_AT + 1]
    assert all("No space left" in message for message in disabled["message"])
    assert disabled["message"].iloc[1].endswith("still running: nothing")
    assert run.meta["status"] == "finished" and run.meta.get("numerics_keep_state")  # its facts stand
    assert run.steps["step"].tolist() == list(range(BREAKS_AT))


def poisoned_loop(run_dir: Path, break_capture) -> list[float]:
    """The tiny GPT-2 loop (per-layer rows every step) with a NaN row at NAN_AT, `break_capture(prof)` first."""
    return capture_loop.train(run_dir, steps=LOOP_STEPS, nan_at=NAN_AT, on_start=break_capture, layer_interval=1,
                              sample_interval_s=0)["losses"]


def events_of(run, kind: str) -> list[dict]:
    return run.events[run.events["kind"] == kind].to_dict("records")


@pytest.mark.capture_may_switch_off
def test_a_failing_collector_is_switched_off_alone_and_a_later_nan_is_still_blamed(tmp_path):
    """The per-layer rows (the gradient collector's) cannot be written at step FAILS_AT: that collector stops, the
    event names the ones still running, and NaN forensics blames the poisoned weight at NAN_AT."""
    seen = poisoned_loop(tmp_path / "run", lambda prof: break_the_writer_at(prof, FAILS_AT, "layers"))
    run = gpuprof.load_run(tmp_path / "run")
    assert run.steps["step"].tolist() == list(range(LOOP_STEPS))
    assert run.steps["loss"].iloc[:NAN_AT].tolist() == pytest.approx(seen[:NAN_AT], rel=1e-6)
    assert run.layers["step"].max() == FAILS_AT - 1
    [disabled] = events_of(run, EventKind.COLLECTOR_DISABLED)
    assert (disabled["step"], disabled["details"]["collector"]) == (FAILS_AT, "gradients")
    assert {"numerics", "numerics_tape", "phases"} <= set(disabled["details"]["still_running"])
    assert "still running: " in disabled["message"] and "numerics" in disabled["message"]
    [nonfinite] = events_of(run, EventKind.NONFINITE)
    assert nonfinite["step"] == NAN_AT
    assert (nonfinite["details"]["phase"], nonfinite["details"]["tensor"]) == ("state", POISONED)


@pytest.mark.capture_may_switch_off
def test_after_capture_is_switched_off_the_steps_and_a_later_nan_are_still_recorded(tmp_path):
    """The steps stream cannot be written at step FAILS_AT (the disk filled, then space was freed): the Profiler
    switches its collectors off, and the event says which and what still runs. The steps after it are recorded
    with the loop's losses, and the NaN at NAN_AT is a `nonfinite` event that says why it is not blamed."""
    seen = poisoned_loop(tmp_path / "run", lambda prof: break_the_writer_at(prof, FAILS_AT, until=FAILS_AT + 1))
    run = gpuprof.load_run(tmp_path / "run")
    steps = run.steps.set_index("step")
    assert steps.index.tolist() == [step for step in range(LOOP_STEPS) if step != FAILS_AT]
    assert steps["loss"].loc[:NAN_AT - 1].tolist() == pytest.approx(
        [loss for step, loss in enumerate(seen[:NAN_AT]) if step != FAILS_AT], rel=1e-6)
    assert steps["loss_finite"].loc[NAN_AT:].eq(False).all() and steps["step_time_s"].gt(0).all()
    [disabled] = events_of(run, EventKind.PROFILER_DISABLED)
    assert disabled["step"] == FAILS_AT and "No space left" in disabled["message"]
    assert {"gradients", "numerics", "phases"} <= set(disabled["details"]["switched_off"])
    assert disabled["details"]["still_running"] == list(STILL_RUNNING)
    assert disabled["message"].endswith(f"still running: {', '.join(STILL_RUNNING)}")
    [nonfinite] = events_of(run, EventKind.NONFINITE)
    assert (nonfinite["step"], nonfinite["details"]["trigger"], nonfinite["details"]["phase"]) == (NAN_AT, "loss", None)
    [why] = nonfinite["details"]["notes"]
    assert why.startswith(NOT_REPRODUCED) and f"switched off at step {FAILS_AT}" in why
    assert not losses._in_use()  # the loss taken at backward() stops with the run
