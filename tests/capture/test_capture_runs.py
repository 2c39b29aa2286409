"""Real recorded runs of the tiny GPT-2 on CPU: values in the run directory match what the loop saw."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn.utils import clip_grad
from capture_loop import BATCH, SEQ, batch, tiny_model, train

import gpuprof
from gpuprof.capture import gradients

pytestmark = pytest.mark.newest_torch  # run again on the newest torch tested (scripts/test.sh)


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fp32") / "run"
    seen = train(run_dir, steps=5, layer_interval=2, update_ratio_interval=2)
    return gpuprof.load_run(run_dir), seen


def test_fp32_steps_match_the_loop(fp32_run):
    run, seen = fp32_run
    steps = run.steps
    assert steps["step"].tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(steps["loss"], seen["losses"], rtol=1e-6)
    # global norm before clipping == what clip_grad_norm_ computed on the same gradients
    np.testing.assert_allclose(steps["grad_norm"], seen["clip_norms"], rtol=1e-5)
    np.testing.assert_allclose(steps["lr"], seen["lrs"])
    assert steps["step_skipped"].tolist() == [False] * 5
    assert steps["micro_batches"].tolist() == [1] * 5
    assert (steps["tokens"] == BATCH * SEQ).all()
    np.testing.assert_allclose(steps["tokens_per_s"], steps["tokens"] / steps["step_time_s"])


def test_fp32_phases_add_up_and_flops_follow_the_formula(fp32_run):
    run, _ = fp32_run
    steps = run.steps
    phases = steps[["data_time_s", "forward_time_s", "backward_time_s", "optimizer_time_s", "other_time_s"]]
    assert (phases > 0).all().all()
    np.testing.assert_allclose(phases.sum(axis=1), steps["step_time_s"], rtol=1e-9)
    model = tiny_model()
    n_params = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    expected = 6 * n_params + 12 * 2 * 4 * 32 * SEQ
    assert run.meta["model"]["flops_per_token"] == expected
    assert run.meta["model"]["seq_len"] == SEQ
    np.testing.assert_allclose(steps["flops_per_s"], steps["tokens_per_s"] * expected)
    assert steps["mfu"].isna().all() and run.meta["peak_flops_per_s"] is None  # CPU: peak unknown
    assert run.meta["status"] == "finished" and run.meta["compute_dtype"] == "fp32"


def test_layer_norms_and_update_ratios(fp32_run, tmp_path):
    run, _ = fp32_run
    layers = run.layers
    assert sorted(layers["step"].unique()) == [0, 2, 4]
    params = layers[(layers["step"] == 2) & (layers["level"] == "param")].set_index("layer")
    block = layers[(layers["step"] == 2) & (layers["layer"] == "transformer.h.1")].iloc[0]
    in_block = params[params.index.str.startswith("transformer.h.1.")]
    assert math.isclose(block["grad_norm"], math.sqrt((in_block["grad_norm"] ** 2).sum()), rel_tol=1e-6)

    # recompute step 2's gradients and update by hand from the same seed and data
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        inputs = batch(step)
        model(input_ids=inputs, labels=inputs).loss.backward()
        if step == 2:
            grads = {n: p.grad.norm().item() for n, p in model.named_parameters()}
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    name = "transformer.h.0.mlp.c_fc.weight"
    weight = dict(model.named_parameters())[name].detach()
    assert math.isclose(params.loc[name, "grad_norm"], grads[name], rel_tol=1e-5)
    ratio = (weight - before[name]).norm().item() / weight.norm().item()
    assert math.isclose(params.loc[name, "update_ratio"], ratio, rel_tol=1e-4)


def test_profiling_does_not_change_numerics(tmp_path):
    bare = train(None, steps=4)
    profiled = train(tmp_path / "run", steps=4, numerics=True)  # every default collector on
    assert profiled["losses"] == bare["losses"]
    assert profiled["clip_norms"] == bare["clip_norms"]


def test_bf16_autocast_run(tmp_path):
    seen = train(tmp_path / "run", steps=3, precision="bf16")
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["compute_dtype"] == "bf16"
    np.testing.assert_allclose(run.steps["loss"], seen["losses"], rtol=1e-6)
    np.testing.assert_allclose(run.steps["grad_norm"], seen["clip_norms"], rtol=1e-4)


def test_fp16_scaler_records_the_injected_overflow_as_the_skipped_step(tmp_path):
    seen = train(tmp_path / "run", steps=5, precision="fp16", overflow_at=2, scheduler=True)
    run = gpuprof.load_run(tmp_path / "run")
    steps = run.steps.set_index("step")
    assert steps["step_skipped"].tolist() == [False, False, True, False, False]
    assert steps["scaler_scale"].tolist() == [256.0, 256.0, 128.0, 128.0, 128.0]
    assert steps["scaler_growth_tracker"].tolist() == [1, 2, 0, 1, 2]
    assert steps.loc[2, "grad_norm_finite"] == False  # noqa: E712 - numpy bool
    assert steps.drop(index=2)["grad_norm_finite"].all()
    finite = steps.drop(index=2)
    np.testing.assert_allclose(finite["grad_norm"], np.array(seen["clip_norms"])[[0, 1, 3, 4]], rtol=1e-4)
    events = run.events.set_index("kind")
    assert events.loc["step_skipped", "step"] == 2
    assert events.loc["lr_step_on_skipped_step", "step"] == 2  # the scheduler stepped though the optimizer didn't
    assert run.meta["compute_dtype"] == "fp16"


def test_gradient_accumulation_counts_one_step_per_optimizer_step(tmp_path):
    seen = train(tmp_path / "run", steps=3, accumulation=3)
    steps = gpuprof.load_run(tmp_path / "run").steps
    assert steps["step"].tolist() == [0, 1, 2]
    assert steps["micro_batches"].tolist() == [3, 3, 3]
    assert (steps["tokens"] == 3 * BATCH * SEQ).all()
    np.testing.assert_allclose(steps["grad_norm"], seen["clip_norms"], rtol=1e-5)
    np.testing.assert_allclose(steps["loss"], seen["losses"], rtol=1e-6)


@pytest.mark.parametrize("clip", ["all", "split"])
def test_the_loops_own_clip_norm_is_recorded_without_a_pass_of_gpuprofs(tmp_path, monkeypatch, clip):
    own_passes = []
    monkeypatch.setattr(gradients, "tensor_norms", lambda *args, **kwargs: own_passes.append(1))
    seen = train(tmp_path / "run", steps=3, layer_interval=0, update_ratio_interval=0, clip=clip)
    np.testing.assert_allclose(gpuprof.load_run(tmp_path / "run").steps["grad_norm"], seen["clip_norms"], rtol=1e-6)
    assert own_passes == []


def test_the_clip_watch_leaves_torch_as_it_found_it(tmp_path):
    originals = clip_grad._get_total_norm, torch.nn.utils.get_total_norm
    train(tmp_path / "run", steps=2)
    assert (clip_grad._get_total_norm, torch.nn.utils.get_total_norm) == originals


@pytest.mark.parametrize("clip", ["none", "first_block"])
def test_grad_norms_before_any_clipping_in_loops_that_clip_nothing_or_a_part(tmp_path, clip):
    seen = train(tmp_path / "run", steps=4, clip=clip, layer_interval=2)
    run = gpuprof.load_run(tmp_path / "run")
    np.testing.assert_allclose(run.steps["grad_norm"], seen["grad_norms"], rtol=1e-5)
    params = run.layers[run.layers["level"] == "param"]
    assert sorted(params["step"].unique()) == [0, 2]
    for step, rows in params.groupby("step"):  # per-parameter norms square-sum to the global norm, before clipping
        assert math.isclose(math.sqrt((rows["grad_norm"] ** 2).sum()), seen["grad_norms"][step], rel_tol=1e-5)


class RaisesAtStep:
    name = "flaky"

    def __init__(self, step):
        self.fail_step, self.calls = step, []

    def on_step_end(self, prof, state):
        self.calls.append(state.step)
        if state.step == self.fail_step:
            raise RuntimeError("collector bug")
        return {"flaky_grad_norm": state.grad_norm}


@pytest.mark.capture_may_switch_off
def test_a_raising_collector_is_switched_off_and_training_goes_on(tmp_path, caplog):
    flaky = RaisesAtStep(2)
    bare = train(None, steps=5)
    seen = train(tmp_path / "run", steps=5, collectors=[flaky])
    assert seen["losses"] == bare["losses"]
    assert flaky.calls == [0, 1, 2]
    run = gpuprof.load_run(tmp_path / "run")
    assert run.steps["step"].tolist() == [0, 1, 2, 3, 4]
    assert run.steps["flaky_grad_norm"].tolist()[:2] == run.steps["grad_norm"].tolist()[:2]
    assert run.steps["flaky_grad_norm"].iloc[2:].isna().all()
    disabled = run.events[run.events["kind"] == "collector_disabled"]
    assert disabled["step"].tolist() == [2]
    assert disabled["details"].iloc[0]["collector"] == "flaky"
    assert sum("collector 'flaky' failed" in r.getMessage() for r in caplog.records) == 1


def test_out_of_memory_is_recorded_then_re_raised(tmp_path):
    model = tiny_model()
    with pytest.raises(torch.OutOfMemoryError):
        with gpuprof.profile(tmp_path / "run", model=model) as prof:
            prof.step()
            with prof.phase("forward"):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["status"] == "failed"
    oom = run.events[run.events["kind"] == "oom"].iloc[0]
    assert (oom["step"], oom["severity"]) == (1, "critical")
    assert oom["details"]["error"].startswith("CUDA out of memory")


def test_the_three_line_api_without_model_optimizer_or_phases(tmp_path):
    with gpuprof.profile(tmp_path / "run", sample_interval_s=0) as prof:
        for step in range(3):
            prof.step(loss=torch.tensor(float(step)) / 2, tokens=100)
    run = gpuprof.load_run(tmp_path / "run")
    steps = run.steps
    assert steps["loss"].tolist() == [0.0, 0.5, 1.0]
    assert steps["loss_finite"].tolist() == [True, True, True]
    assert steps[["grad_norm", "step_skipped", "lr", "data_time_s", "flops_per_s"]].isna().all().all()
    np.testing.assert_allclose(steps["other_time_s"], steps["step_time_s"])
    assert run.system.empty and run.meta["model"] is None


def test_gpuprofs_own_work_is_not_the_next_steps_time(tmp_path):
    """A trace window exported at step 3's prof.step() is capture_time_s there, not step 4's time."""
    train(tmp_path / "run", steps=7, trace_steps=range(2, 4))
    steps = gpuprof.load_run(tmp_path / "run").steps.set_index("step")
    export_s = steps.loc[3, "capture_time_s"]
    others = steps["capture_time_s"].drop(index=3)
    assert export_s > 5 * others.median()  # writing a trace is far more than the per-step bookkeeping
    # the step after it does not carry it: before, the export was the bulk of its other_time_s
    assert steps.loc[4, "other_time_s"] < export_s
    assert (steps["capture_time_s"] >= 0).all()
