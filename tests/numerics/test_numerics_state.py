"""The kept state: frozen on the device by a bad step even when the host reads the flag later (CUDA's case);
the weight sample read every step; the watched loss on either path."""

from __future__ import annotations

import math

import pytest
import torch

from gpuprof.numerics.keeping import _WeightSample
from gpuprof.numerics.monitor import _device_float, _host_float
from gpuprof.numerics.state import StateKeeper, live_tensors


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer, StateKeeper(torch.device("cpu"))


def _train_step(model, optimizer, x):
    model(x).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_bad_step_freezes_the_copy_before_the_host_reads_it():
    model, optimizer, keeper = _setup()
    params = {name for name, _ in model.named_parameters()}
    _train_step(model, optimizer, torch.ones(1, 4))  # optimizer state exists from here on
    keeper.refresh(live_tensors(model, optimizer), params, step=1, unread_steps=True)
    before_step_1 = {name: t.clone() for name, t in live_tensors(model, optimizer).items()}
    _train_step(model, optimizer, torch.full((1, 4), float("nan")))
    keeper.freeze_if(torch.tensor(True))  # step 1's flag, set on the device; the host has not read it
    keeper.refresh(live_tensors(model, optimizer), params, step=2, unread_steps=True)  # step 2 begins

    kept = keeper.state_before(1)
    assert kept is not None and keeper.state_before(2) is None
    assert set(kept) == set(before_step_1)
    assert all(torch.equal(kept[name], before_step_1[name]) for name in kept)
    assert not torch.isfinite(model.weight).all()  # while the live weights are ruined
    assert float(keeper.param_absmax()) == max(float(before_step_1[n].abs().max()) for n in params)


def test_state_that_appears_later_starts_a_new_generation():
    model, optimizer, keeper = _setup()
    params = {name for name, _ in model.named_parameters()}
    keeper.refresh(live_tensors(model, optimizer), params, step=0, unread_steps=False)
    _train_step(model, optimizer, torch.ones(1, 4))
    keeper.refresh(live_tensors(model, optimizer), params, step=1, unread_steps=False)
    assert "weight::exp_avg" not in keeper.state_before(0) and "weight::exp_avg" in keeper.state_before(1)
    keeper.release(1)
    assert keeper.state_before(0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_sample_follows_updates_made_in_place(dtype):
    model, optimizer, _ = _setup()
    model.to(dtype)
    sample = _WeightSample(model, torch.device("cpu"), refresh_steps=50)
    largest = lambda: max(p.detach().abs().max().item() for p in model.parameters())  # noqa: E731
    assert sample.absmax(0).item() == largest()
    with torch.no_grad():
        model.weight.mul_(1e3)  # what an oversized update does, in place
    assert sample.absmax(1).item() == largest() > 1.0
    with torch.no_grad():
        model.bias[0] = float("nan")
    assert math.isnan(sample.absmax(2).item())


@pytest.mark.parametrize("loss, flagged", [(2.5, False), (float("nan"), True), (float("inf"), True),
                                           (torch.tensor(float("nan")), True), (None, False)])
def test_a_loss_is_watched_on_the_device_path_as_on_the_host_one(loss, flagged):
    """A loss passed as a float reaches the device vector by its finiteness alone (no copy to the device)."""
    zero, inf = torch.zeros(()), torch.full((), math.inf)
    assert (not math.isfinite(_device_float(loss, zero, inf).item())) == flagged
    assert (not math.isfinite(_host_float(loss))) == flagged
