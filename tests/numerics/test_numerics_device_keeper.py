"""keep_state "when_bad" decided on the device (device_keeper.py, device_copy.py): the Triton kernels
run here under Triton's interpreter on CPU tensors, the same code a CUDA device compiles.
benchmarks/gpu_validate.py runs them compiled on a GPU."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from numerics_helpers import FAULT_CASES, events
from test_numerics_any_loop import nanogpt_loop

from gpuprof.numerics import device_copy, keeping
from gpuprof.numerics.device_keeper import ConditionalKeeper
from gpuprof.numerics.state import StateKeeper

pytestmark = pytest.mark.slow  # the Triton interpreter

pytest.importorskip("triton")

KERNELS = "gpuprof.numerics.device_copy_kernels"
ON_DEVICE = {"keep_state": "when_bad"}  # on the CPU, "auto" reads the values on the host
INTERPRETED_PROGRAMS_PER_TENSOR = 2


@pytest.fixture
def device_keeping(monkeypatch):
    """The device path on the CPU: Triton's interpreter (read when the kernels are defined), and the
    device copy allowed on this device. Yields the keepers made, to check which path ran."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(device_copy, "available", lambda device: True)
    # the interpreter runs every program in Python, even the ones that exit at once: two programs a tensor
    # still split each tensor's bytes between programs, for an eighth of the interpreted launches
    monkeypatch.setattr(device_copy, "PROGRAMS_PER_TENSOR", INTERPRETED_PROGRAMS_PER_TENSOR)
    _forget_kernels()
    made: list = []
    original_start = keeping.StepKeeping.start

    def start(self, device, undo_updates=False):
        original_start(self, device, undo_updates)
        made.append(self)

    monkeypatch.setattr(keeping.StepKeeping, "start", start)
    yield made
    _forget_kernels()


def _forget_kernels() -> None:
    sys.modules.pop(KERNELS, None)
    device_copy._kernel.cache_clear()


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, generator=generator), "b": torch.randn(7, 3, generator=generator).bfloat16(),
            "count": torch.arange(5, dtype=torch.int32), "w::step": torch.tensor(3.0)}


def test_healthy_values_copy_nothing_and_a_bad_one_copies_the_state_once(device_keeping):
    keeper = ConditionalKeeper(torch.device("cpu"))
    live = state(0)
    keeper.prepare(live, step=0)
    finite, bad = torch.tensor([1.0, 2.0]), torch.tensor([1.0, math.nan])
    keeper.take_if(finite, step=0, end=False)
    assert keeper.state_before(0) is None

    keeper.take_if(bad, step=1, end=False)
    kept = keeper.state_before(1)
    for name, tensor in live.items():
        assert torch.equal(kept[name], tensor), name
    assert not keeper.taken_at_end()

    before = {name: t.clone() for name, t in live.items()}
    for tensor in live.values():
        tensor.add_(1)
    keeper.take_if(torch.tensor([math.inf]), step=2, end=True)  # held until step 1 is read
    assert keeper.state_before(2) is None
    assert all(torch.equal(keeper.state_before(1)[name], before[name]) for name in live)

    keeper.unfreeze()
    keeper.take_if(torch.tensor([-math.inf]), step=3, end=True)
    assert all(torch.equal(keeper.state_before(3)[name], live[name]) for name in live)
    assert keeper.taken_at_end()


def test_tensors_the_byte_copy_leaves_out_are_copied_every_step(device_keeping):
    """Tensors on another device than the keeper's (Adam's step counters on the CPU beside a GPU's
    state; here the keeper's device is "meta"), and tensors that are not contiguous."""
    keeper = ConditionalKeeper(torch.device("meta"))
    transposed = torch.randn(4, 6).t()
    live = {"w::step": torch.tensor(2.0), "v::step": torch.tensor(5.0), "count": torch.tensor(1),
            "t": transposed, "on-device": torch.empty(3, device="meta")}
    keeper.prepare(live, step=0)
    copies = keeper.per_step_copies()
    assert set(copies) == {"w::step", "v::step", "count", "t"}
    live["w::step"].add_(1)
    transposed.add_(1)
    assert (copies["w::step"].item(), copies["v::step"].item(), copies["count"].item()) == (2.0, 5.0, 1)
    assert copies["count"].dtype == torch.int64 and torch.equal(copies["t"] + 1, transposed)

    on_cpu = ConditionalKeeper(torch.device("cpu"))
    on_cpu.prepare({"w": torch.randn(3), "t": transposed}, step=0)
    assert set(on_cpu.per_step_copies()) == {"t"}


@pytest.mark.parametrize("fault,precision,step,phase,module,op,first", [
    case for case in FAULT_CASES if (case[0], case[1]) in {
        ("attn-overflow@1", "fp16"), ("embedding-nan@1", "bf16"), ("ignored-labels@1", "fp32"),
        ("lr-spike@1", "bf16"), ("sqrt-zero@1", "bf16"), ("sqrt-zero@1", "fp16")}
], ids=lambda value: str(value))
def test_every_fault_gets_its_blame_from_the_device_copy(tmp_path, device_keeping, fault, precision, step, phase,
                                                         module, op, first):
    nanogpt_loop(tmp_path / "run", steps=step + 1, precision=precision, fault=fault, numerics=ON_DEVICE)
    assert [k.on_device for k in device_keeping] == [True]
    [event] = events(tmp_path / "run", "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == \
        (step, phase, module, op, first)
    assert not any("not reproduced" in note for note in event.get("notes", []))


def test_a_failing_device_copy_falls_back_to_a_copy_every_step(tmp_path, device_keeping, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(device_copy.ConditionalCopy, "copy_if", broken)
    nanogpt_loop(tmp_path / "run", steps=2, precision="fp32", fault="ignored-labels@1", numerics=ON_DEVICE)
    assert isinstance(device_keeping[0].keeper, StateKeeper)
    [fallback] = events(tmp_path / "run", "state_keeping_fallback")
    assert "no kernel here" in fallback["message"]
    [event] = events(tmp_path / "run", "nonfinite")  # the detection and its blame are kept
    assert (event["step"], event["phase"], event["op"]) == (1, "loss", "aten::nll_loss_forward")


def test_skip_policy_keeps_every_step(tmp_path, device_keeping):
    nanogpt_loop(tmp_path / "run", steps=2, precision="fp32", numerics=ON_DEVICE, on_nonfinite="skip")
    assert [type(k.keeper) for k in device_keeping] == [StateKeeper]
