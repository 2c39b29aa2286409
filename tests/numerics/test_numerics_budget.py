"""The memory budget of keep_state "when_bad" (numerics/budget.py): where the kept state goes, decided
from measured memory, and NaN forensics blaming under each choice, on the host path and on the
device path (Triton's interpreter on CPU tensors, as in test_numerics_device_keeper.py)."""

from __future__ import annotations

import json

import pytest
import torch
from numerics_helpers import events
from test_numerics_any_loop import nanogpt_loop, user_model
from test_numerics_device_keeper import ON_DEVICE, device_keeping  # noqa: F401 - the fixture

from gpuprof.errors import GpuprofError
from gpuprof.numerics import budget
from gpuprof.numerics.budget import Pool
from gpuprof.numerics.options import NumericsOptions
from gpuprof.numerics.state import live_tensors

GIB = 2**30
H200_BYTES = 150_109_880_320  # torch.cuda.mem_get_info's total on the H200 of benchmarks/results/2026-11-30-h200.json
GPT2 = {"124M": 124_439_808, "1.5B": 1_557_611_200}  # GPT2LMHeadModel parameter counts


def gpt2_sizes(name: str) -> dict[str, int]:
    """What keep_state copies for GPT-2 under AdamW in fp32: weight, exp_avg and exp_avg_sq (4 bytes each)."""
    params = GPT2[name]
    return {"state": params * 12, "parameters": params * 4}


def h200(free_bytes: int) -> Pool:
    return Pool("device", H200_BYTES, free_bytes)


def test_gpt2_124m_fits_an_h200_and_1_5b_goes_to_pinned_host_memory():
    host = Pool("host", 2048 * GIB, 1800 * GIB)  # a DGX-class host
    small = budget.place(gpt2_sizes("124M"), (h200(120 * GIB), host), budget.DEFAULT_BUDGET_PCT, step=1, measured=True)
    assert (small.what, small.where, small.bytes) == ("state", "device", gpt2_sizes("124M")["state"])
    large = budget.place(gpt2_sizes("1.5B"), (h200(120 * GIB), host), budget.DEFAULT_BUDGET_PCT, step=1, measured=True)
    assert (large.what, large.where) == ("state", "host")  # 18.7 GB: over 5 % of the H200's 140 GB
    assert "over" not in large.reason and "fits the host's budget after step 0" in large.reason


def test_a_small_host_keeps_the_parameters_alone_and_a_full_device_nothing():
    host = budget.host_pool()  # this machine, measured
    assert host.total_bytes > 0 and 0 < host.free_bytes <= host.total_bytes and host.peak_bytes > 0
    sizes = gpt2_sizes("1.5B")
    if sizes["state"] <= host.budget_bytes(budget.DEFAULT_BUDGET_PCT):
        pytest.skip("this host's budget holds 1.5B parameters' state")
    cheaper = budget.place(sizes, (h200(120 * GIB), host), budget.DEFAULT_BUDGET_PCT, step=1, measured=True)
    assert (cheaper.what, cheaper.where, cheaper.bytes) == ("parameters", "device", sizes["parameters"])
    assert "fits none" in cheaper.reason
    # a run tuned close to its memory limit: 3 GiB free on the device, half of which is 1.5 GiB
    full = budget.place(sizes, (h200(3 * GIB), host), budget.DEFAULT_BUDGET_PCT, step=1, measured=True)
    assert (full.what, full.where, full.bytes, full.kept) == ("nothing", "none", 0, False)
    assert "half of 3 GiB free" in full.reason


def test_the_budget_is_the_least_of_the_share_and_half_the_free_memory_counting_the_copy_held():
    pool = h200(10 * GIB)
    assert pool.budget_bytes(5) == 5 * GIB  # half of the 10 GiB free, under 5 % of 140 GiB
    assert pool.budget_bytes(5, held_bytes=20 * GIB) == int(H200_BYTES * 0.05)
    assert pool.budget_bytes(0) == 0
    # re-planned with its own copy held, a copy that fitted still fits (no flip-flopping between pools)
    sizes = {"state": 6 * GIB, "parameters": 2 * GIB}
    first = budget.place(sizes, (h200(14 * GIB),), 5, step=1, measured=True)
    again = budget.place(sizes, (h200(8 * GIB),), 5, step=51, measured=True, held={"device": 6 * GIB})
    assert (first.where, again.where) == ("device", "device")


def test_before_the_first_step_only_the_host_is_measured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: pytest.fail("the device is not measured yet"))
    assert [pool.name for pool in budget.pools_for(torch.device("cuda"), measured=False)] == ["host"]
    assert [pool.name for pool in budget.pools_for(torch.device("cpu"), measured=True)] == ["host"]
    placement = budget.place({"state": 10, "parameters": 5}, (budget.host_pool(),), 5, step=0, measured=False)
    assert "before the first step ends" in placement.reason


@pytest.mark.parametrize("value", [-1, 101, "5", True, None])
def test_a_bad_budget_is_one_clear_error(value):
    with pytest.raises(GpuprofError, match="memory_budget_pct must be a number from 0 to 100"):
        NumericsOptions(memory_budget_pct=value)


def tiny_pct(what: str) -> float:
    """A budget in percent of this host that holds the parameters of the tests' model but not its whole
    state (`what` "parameters"), or nothing at all ("nothing")."""
    if what == "nothing":
        return 0.0
    params = budget.nbytes(live_tensors(user_model()).values())  # with the buffers
    return 2.0 * params / budget.host_pool().total_bytes * 100  # AdamW's whole state is 3x the parameters


def meta(run_dir) -> dict:
    return json.loads((run_dir / "meta.json").read_text())


# fault, precision, expected (step, phase, module, op, first): from numerics_helpers.FAULT_CASES
FORWARD_FAULT = ("attn-overflow@1", "fp16", (1, "forward", "transformer.h.1.attn", "aten::bmm", "inf"))
LOSS_FAULT = ("ignored-labels@1", "fp32", (1, "loss", None, "aten::nll_loss_forward", "nan"))
STATE_FAULT = ("embedding-nan@1", "bf16", (1, "state", "transformer.wte", None, "nan"))


def blame_of(run_dir) -> tuple:
    [event] = events(run_dir, "nonfinite")
    return event, (event["step"], event["phase"], event["module"], event["op"], event["first"])


@pytest.mark.parametrize("fault,precision,expected", [FORWARD_FAULT, STATE_FAULT], ids=["forward", "state"])
def test_the_host_path_blames_with_the_parameters_alone(tmp_path, fault, precision, expected):
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=expected[0] + 1, precision=precision, fault=fault,
                 numerics={"memory_budget_pct": tiny_pct("parameters")})
    event, blame = blame_of(run_dir)
    assert blame == expected
    assert event["kept_state"] == "the parameters and buffers alone in host memory"
    assert any("the optimizer's state was not kept" in note for note in event["notes"])
    placement = meta(run_dir)["numerics_state_placement"]
    assert (placement["what"], placement["where"], placement["measured"]) == ("parameters", "host", True)
    [said] = events(run_dir, "state_placement")  # the first step's fits the budget: not an event
    assert (said["severity"], said["step"], said["measured"]) == ("warning", 1, True) and "fits none" in said["reason"]


def test_the_host_path_says_why_nothing_was_kept(tmp_path):
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=2, precision="fp32", fault=LOSS_FAULT[0], numerics={"memory_budget_pct": 0})
    [event] = events(run_dir, "nonfinite")
    assert event["phase"] is None and event["kept_state"] == "not kept (over the memory budget)"
    assert "not reproduced: the state before this step was not kept (over the memory budget: neither" in \
        event["message"]
    assert meta(run_dir)["numerics_state_placement"]["what"] == "nothing"


def test_the_default_budget_keeps_the_whole_state_and_says_so_in_meta(tmp_path):
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=2, precision="fp32", fault=LOSS_FAULT[0])
    event, blame = blame_of(run_dir)
    assert blame == LOSS_FAULT[2] and event["kept_state"] == "the whole state in host memory"
    placement = meta(run_dir)["numerics_state_placement"]
    assert (placement["what"], placement["where"], placement["from_step"], placement["measured"]) == \
        ("state", "host", 1, True)
    assert placement["bytes"] > 0 and placement["pools"][0]["name"] == "host"
    assert events(run_dir, "state_placement") == []  # only a cheaper keep is an event


def device_beside_this_host(free_bytes: int):
    """pools_for's answer with an 80 GiB device of `free_bytes` free beside this machine's host, measured
    (the device is measured from the run's first step on)."""
    return lambda device, measured: ((Pool("device", 80 * GIB, free_bytes),) if measured else ()) + (budget.host_pool(),)


@pytest.mark.parametrize("what,where,device_free,fault,precision,expected", [
    ("state", "device", 60 * GIB, *FORWARD_FAULT), ("state", "host", 2 * 2**20, *STATE_FAULT),
    ("parameters", "host", None, *FORWARD_FAULT),
], ids=["device", "pinned-host", "parameters-on-the-cpu-host"])
def test_the_device_path_blames_under_each_placement(tmp_path, device_keeping, monkeypatch, what, where, device_free,
                                                     fault, precision, expected):
    """The Triton kernel copies into the buffers the budget placed (here all of them in this host's memory)."""
    if device_free is not None:
        monkeypatch.setattr(budget, "pools_for", device_beside_this_host(device_free))
    options = {**ON_DEVICE, "memory_budget_pct": tiny_pct("parameters") if what == "parameters" else 5.0}
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=expected[0] + 1, precision=precision, fault=fault, numerics=options)
    assert [k.on_device for k in device_keeping] == [True]
    event, blame = blame_of(run_dir)
    assert blame == expected
    assert event["kept_state"] == f"{budget.WHAT[what]} {budget.WHERE[where]}"
    placement = meta(run_dir)["numerics_state_placement"]
    assert (placement["what"], placement["where"]) == (what, where)
    assert not any("not reproduced" in note for note in event.get("notes", []))


def test_the_device_path_keeps_nothing_over_budget_and_says_why(tmp_path, device_keeping):
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=2, precision="fp32", fault=LOSS_FAULT[0],
                 numerics={**ON_DEVICE, "memory_budget_pct": 0})
    [event] = events(run_dir, "nonfinite")
    assert event["phase"] is None and "over the memory budget" in event["message"]
    assert device_keeping[0].keeper.held_bytes() == {"none": 0}
