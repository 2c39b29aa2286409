"""The loop's own batch functions, found from its source at the first training call and timed as data:
a generator function iterated by the loop, and a method of the loop's own class; a function that runs
the model itself is not one."""

from __future__ import annotations

import time

import torch
from capture_loop import batch, tiny_model

import gpuprof

DELAY_S = 0.05


def batches(steps: int):
    for step in range(steps):
        time.sleep(DELAY_S)
        yield batch(step)


class Feeder:
    def __init__(self):
        self.step = 0

    def next_batch(self) -> torch.Tensor:
        time.sleep(DELAY_S)
        self.step += 1
        return batch(self.step)


def train(prof, model, optimizer, inputs) -> None:
    model(input_ids=inputs, labels=inputs).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    prof.step()


def test_a_generator_function_and_a_method_are_data(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gpuprof.profile(tmp_path / "gen", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for inputs in enumerate(batches(3)):
            train(prof, model, optimizer, inputs[1])
    feeder, original = Feeder(), vars(Feeder)["next_batch"]
    with gpuprof.profile(tmp_path / "method", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for _ in range(3):
            tokens = feeder.next_batch()
            train(prof, model, optimizer, tokens)
    assert vars(Feeder)["next_batch"] is original  # put back at close
    for name, function in (("gen", "batches"), ("method", "Feeder.next_batch")):
        run = gpuprof.load_run(tmp_path / name)
        assert (run.steps["data_time_s"][1:] >= DELAY_S).all(), name
        assert [source["function"] for source in run.meta["phase_sources"]] == [function]


def step_of(model, inputs):
    """Runs the model and hands its batch back: what the loop assigns its batch from, yet no batch function."""
    time.sleep(DELAY_S)
    return inputs, model(input_ids=inputs, labels=inputs).loss


def test_a_function_that_runs_the_model_is_not_data(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader([batch(step) for step in range(3)], batch_size=None)
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        inputs = batch(0)
        for _ in loader:  # data the step fetches, so data is not timed from the step's start instead
            inputs, loss = step_of(model, inputs)
            loss.backward()
            optimizer.step()
            prof.step()
    run = gpuprof.load_run(tmp_path / "run")
    assert "step_of" in [source["function"] for source in run.meta["phase_sources"]]  # found, then seen to run it
    assert (run.steps["data_time_s"] < DELAY_S).all()


def test_a_batch_function_called_in_the_model_call_is_data(tmp_path):
    """`model(input_ids=feeder.next_batch())`: its result is bound to no name, yet it makes the model's inputs."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    feeder = Feeder()
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0,
                         stack_interval_s=0.01) as prof:
        for _ in range(4):
            model(input_ids=feeder.next_batch()).logits.float().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            prof.step()
    run = gpuprof.load_run(tmp_path / "run")
    assert [source["function"] for source in run.meta["phase_sources"]] == ["Feeder.next_batch"]
    later = run.stacks[(run.stacks["step"] > 0) & (run.stacks["inner_function"] == "Feeder.next_batch")]
    assert len(later) and set(later["phase"]) == {"data"}  # sampled inside it: data, not other
