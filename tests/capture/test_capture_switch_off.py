"""When the Profiler itself breaks, all of it stops: none of gpuprof's code runs in the loop afterwards
(no hook on the model, the optimizer, autograd, the GradScaler or clip_grad_norm_), and training goes on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from capture_loop import batch, tiny_model

import gpuprof
from gpuprof.run.schema import EventKind

GPUPROF_DIR = str(Path(gpuprof.__file__).parent)
BREAKS_AT = 2
STEPS = 6


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


def break_the_writer_at(prof, step: int) -> None:
    """The disk fills up: writing the steps stream fails from `step` on (events still write)."""
    write = prof.writer.write

    def write_or_fail(stream, records):
        if stream == "steps" and prof.step_index >= step:
            raise OSError(28, "No space left on device")
        return write(stream, records)

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
    assert watched_after[1:] == [[]] * (STEPS - BREAKS_AT - 1), watched_after[1:]
    assert broken_at == BREAKS_AT  # the step counter stopped there
    run = gpuprof.load_run(tmp_path / "run")
    disabled = run.events[run.events["kind"] == EventKind.PROFILER_DISABLED]
    assert disabled["step"].tolist() == [BREAKS_AT] and "No space left" in disabled["message"].iloc[0]
    assert run.meta["status"] == "finished" and run.meta.get("numerics_keep_state")  # its facts stand
    assert run.steps["step"].tolist() == list(range(BREAKS_AT))
