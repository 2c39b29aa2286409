"""A loop that steps two optimizers, as the nanoGPT speedruns do: Muon for the blocks' weight
matrices and AdamW for the embeddings, biases and norms, handed over as `optimizer=[muon, adamw]`.
NaN forensics keeps the state from before the first update and blames as with one optimizer;
phases, gradient norms (under a GradScaler that unscales one optimizer at a time), loop facts and
the replay bundle cover both. Given only one of them, the run says which parameters it missed."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from numerics_helpers import FAULT_CASES, VOCAB, events
from test_numerics_any_loop import BATCH, DTYPES, SEQ, user_model

import gpuprof
from gpuprof.cli import main
from gpuprof.diagnoses import diagnose
from gpuprof.workloads.gpt2.faults import SPIKED_LR, Injector, parse

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")

MUON_LR, ADAMW_LR = 0.02, 1e-3


def is_matrix(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 2 and name.startswith("transformer.h.")


def two_optimizer_loop(run_dir, *, steps: int, precision: str = "fp32", fault: str | None = None,
                       give: str = "both", spike_in: str = "both", **profile_options):
    """`give`: which optimizers gpuprof is handed ("both" or "adamw"); `spike_in`: whose lr an
    lr-spike fault raises. Returns the optimizers and the true gradient norm of each step (unscaled,
    before any update)."""
    injector = Injector([parse(fault)] if fault else [])
    model = injector.prepare_model(user_model())
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if is_matrix(n, p)], lr=MUON_LR)
    adamw = torch.optim.AdamW([p for n, p in named if not is_matrix(n, p)], lr=ADAMW_LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=precision == "fp16")
    dtype, generator, true_norms = DTYPES[precision], torch.Generator().manual_seed(1), []
    given = [muon, adamw] if give == "both" else adamw
    with gpuprof.profile(run_dir, model=model, optimizer=given, scaler=scaler, sample_interval_s=0,
                         **profile_options) as prof:
        for step in range(steps):
            for name, optimizer, lr in (("muon", muon, MUON_LR), ("adamw", adamw, ADAMW_LR)):
                for group in optimizer.param_groups:
                    group["lr"] = injector.lr(step, lr) if spike_in in ("both", name) else lr
            injector.before_step(step, model)
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
            y = injector.targets(step, x.roll(-1, 1))
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                logits = model(x).logits
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            scaler.scale(loss).backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            true_norms.append(float(torch.nn.utils.get_total_norm(grads)) / scaler.get_scale())
            scaler.step(muon)  # unscales Muon's gradients only: AdamW's are still scaled in its pre-hook
            scaler.step(adamw)
            scaler.update()
            muon.zero_grad(set_to_none=True)
            adamw.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach(), tokens=x.numel())
    return (muon, adamw), true_norms


SAME_AS_ONE_OPTIMIZER = [case for case in FAULT_CASES if case[:2] in {
    ("attn-overflow@1", "fp16"), ("sqrt-zero@1", "fp32"), ("embedding-nan@1", "fp32"), ("ignored-labels@1", "bf16")}]


@pytest.mark.parametrize("fault,precision,step,phase,module,op,first", SAME_AS_ONE_OPTIMIZER,
                         ids=[f"{c[0]}-{c[1]}" for c in SAME_AS_ONE_OPTIMIZER])
def test_a_fault_gets_the_blame_it_gets_with_one_optimizer(tmp_path, fault, precision, step, phase, module, op, first):
    run_dir = tmp_path / "run"
    two_optimizer_loop(run_dir, steps=step + 1, precision=precision, fault=fault)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == \
        (step, phase, module, op, first)
    assert not any("none of the optimizers" in note for note in event["notes"])


@pytest.mark.parametrize("spike_in", ["muon", "adamw"])
def test_an_lr_spike_in_either_optimizer_is_blamed_on_its_update(tmp_path, spike_in):
    """The state is kept before the first optimizer steps, so the step after the spike starts from
    finite, oversized weights: the blame is a forward op there, with the spike's update as the cause."""
    run_dir = tmp_path / "run"
    two_optimizer_loop(run_dir, steps=3, fault="lr-spike@1", spike_in=spike_in)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"]) == (2, "forward")
    cause = event["cause"]
    assert cause["kind"] == "oversized_update" and cause["step"] == 1
    assert (cause["param_group"], cause["lr"]) == ({"muon": 0, "adamw": 1}[spike_in], SPIKED_LR)
    assert f"of param group {cause['param_group']}" in cause["summary"]


def test_the_bundle_replays_both_optimizers(tmp_path, capsys):
    run_dir = tmp_path / "run"
    two_optimizer_loop(run_dir, steps=2, fault="ignored-labels@1")  # a model the CLI can rebuild
    [event] = events(run_dir, "nonfinite")
    saved = torch.load(event["bundle"], weights_only=True)["optimizer"]
    assert [entry["class"] for entry in saved] == ["Muon", "AdamW"]
    capsys.readouterr()
    assert main(["replay", event["bundle"]]) == 0
    assert "same blame as recorded during training" in capsys.readouterr().out


def test_phases_norms_and_facts_cover_both_optimizers(tmp_path):
    run_dir = tmp_path / "run"
    _, true_norms = two_optimizer_loop(run_dir, steps=4, precision="fp16")
    run = gpuprof.load_run(run_dir)
    steps = run.steps.set_index("step")
    assert (steps["optimizer_time_s"] > 0).all()
    assert run.events[run.events["kind"] == "phase_unavailable"].empty
    for step, true_norm in enumerate(true_norms):
        if math.isfinite(true_norm):  # the scaler's first steps may overflow
            assert steps.loc[step, "grad_norm"] == pytest.approx(true_norm, rel=1e-4)
    facts = run.meta["loop"]["optimizer"]
    assert [member["class"] for member in facts["members"]] == ["Muon", "AdamW"]
    assert facts["params_without_optimizer"] == 0
    assert "params-without-optimizer" not in [finding.rule for finding in diagnose(run)]


def test_given_one_of_two_optimizers_the_run_names_what_it_missed(tmp_path):
    run_dir = tmp_path / "run"
    two_optimizer_loop(run_dir, steps=2, fault="sqrt-zero@1", give="adamw")
    run = gpuprof.load_run(run_dir)
    matrices = [n for n, p in user_model().named_parameters() if is_matrix(n, p)]
    facts = run.meta["loop"]["optimizer"]
    assert facts["params_without_optimizer"] == len(matrices)
    assert facts["params_without_optimizer_names"][0] == matrices[0]
    [finding] = [f for f in diagnose(run) if f.rule == "params-without-optimizer"]
    assert "optimizer=[" in finding.fix
    [event] = events(run_dir, "nonfinite")  # Muon's update came before the state was kept: said in a note
    assert any(f"{len(matrices)} trainable parameters" in note for note in event["notes"])


def test_skip_undoes_both_optimizers_updates(tmp_path):
    run_dir = tmp_path / "run"
    optimizers, _ = two_optimizer_loop(run_dir, steps=3, fault="sqrt-zero@1", on_nonfinite="skip")
    for optimizer in optimizers:
        tensors = [p for group in optimizer.param_groups for p in group["params"]]
        tensors += [value for state in optimizer.state.values() for value in state.values()
                    if isinstance(value, torch.Tensor)]
        assert all(torch.isfinite(tensor).all() for tensor in tensors), type(optimizer).__name__
    assert gpuprof.load_run(run_dir).steps["loss"].notna().all()  # step 2 ran from the weights step 1 left
