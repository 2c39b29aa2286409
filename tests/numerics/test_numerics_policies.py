"""Healthy runs are untouched; record / raise / skip; torch.compile'd models; the Hugging Face default."""

from __future__ import annotations

import re

import pytest
import torch
from numerics_helpers import VOCAB, events

import gpuprof
from gpuprof.cli import main
from gpuprof.numerics.replay import replay, same_blame
from gpuprof.workloads.gpt2 import build_model, lm_loss, train


def _all_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_healthy_run_has_no_events_and_identical_losses(tiny):
    instrumented = tiny(steps=3)
    recorded = train(instrumented)
    plain = train(tiny(steps=3, run_dir=None))
    assert recorded.losses == plain.losses
    assert events(instrumented.run_dir, "nonfinite") == []
    assert events(instrumented.run_dir, "collector_disabled") == []


def test_skip_policy_keeps_parameters_finite(tiny):
    skipped = train(tiny(inject=["sqrt-zero@1"], steps=3, on_nonfinite="skip"))
    assert _all_finite(skipped.model)
    assert all(loss == loss for loss in skipped.losses)  # no NaN loss after the skipped step
    [event] = events(skipped.config.run_dir, "nonfinite")
    assert (event["step"], event["phase"]) == (1, "backward")

    recorded = train(tiny(inject=["sqrt-zero@1"], steps=3, run_dir=skipped.config.run_dir + "-record"))
    assert not _all_finite(recorded.model)  # the same fault, recorded only, ruins the weights


def test_raise_policy_stops_training_with_one_line(tiny, capsys):
    """`gpuprof train --on-nonfinite raise`: the event is written, then NonFiniteError ends the run."""
    config = tiny()
    args = ["train", "--model", "tiny", "--vocab-size", str(VOCAB), "--seq-len", "16", "--batch-size", "2",
            "--steps", "3", "--data", config.data, "--run-dir", config.run_dir,
            "--inject", "ignored-labels@1", "--on-nonfinite", "raise"]
    assert main(args) == 1
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("gpuprof train: stopped")]
    assert "step 1: first nan from aten::nll_loss_forward (loss, outside any module)" in line
    [event] = events(config.run_dir, "nonfinite")
    assert event["step"] == 1 and event["bundle"] in line
    assert gpuprof.load_run(config.run_dir).meta["status"] == "failed"


def _tiny_model(tiny):
    torch.manual_seed(0)
    return build_model(tiny())


def _batches(steps: int, ignored_at: int):
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        inputs = torch.randint(0, VOCAB, (2, 16), generator=generator)
        targets = torch.full_like(inputs, -100) if step == ignored_at else inputs.roll(-1, 1)
        yield inputs, targets


def test_compiled_model_is_replayed_in_eager(tiny, tmp_path, capsys):
    model = _tiny_model(tiny)
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_dir = tmp_path / "compiled"
    with gpuprof.profile(run_dir, model=compiled, optimizer=optimizer, sample_interval_s=0,
                         loss_fn=lambda m, batch: lm_loss(m, *batch)) as prof:
        for inputs, targets in _batches(3, ignored_at=2):
            loss = lm_loss(compiled, inputs, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss, batch=(inputs, targets))
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["op"]) == (2, "loss", None, "aten::nll_loss_forward")

    # a custom loss_fn cannot travel in a bundle: the CLI says so, the Python API takes it
    assert main(["replay", event["bundle"]]) == 2
    assert "custom loss_fn" in capsys.readouterr().err
    replayed, recorded = replay(event["bundle"], model=_tiny_model(tiny), loss_fn=lambda m, b: lm_loss(m, *b))
    assert same_blame(replayed, recorded) and replayed.op == "aten::nll_loss_forward"


def test_hugging_face_loop_needs_no_batch_or_loss_fn(tiny, tmp_path):
    """model(input_ids=..., labels=...).loss: the forward call is kept and replayed as is."""
    model = _tiny_model(tiny)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_dir = tmp_path / "hf"
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for inputs, targets in _batches(3, ignored_at=1):
            loss = model(input_ids=inputs, labels=torch.where(targets == -100, -100, inputs)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["op"]) == (1, "loss", None, "aten::nll_loss_forward")
    assert "loss = model(input_ids=inputs" in event["source"]  # the user's line, transformers' behind it
    assert "transformers" in event["library_source"] and "cross_entropy" in event["library_source"]


def _overflowing_update_event(run_dir, keep_state: str) -> dict:
    """Finite gradients, a huge learning rate: the weight turns Inf inside optimizer.step()."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, sample_interval_s=0,
                         numerics={"state_interval": 1, "keep_state": keep_state},
                         loss_fn=lambda m, x: m(x).pow(2).mean()) as prof:
        for step in range(3):
            optimizer.param_groups[0]["lr"] = 1e37 if step == 1 else 1e-6
            x = torch.randn(8, 4) * 100  # gradients in the hundreds: lr * grad passes fp32 max
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss, batch=x)
    [event] = events(run_dir, "nonfinite")
    return event


def test_an_update_that_overflows_is_blamed_on_the_optimizer(tmp_path):
    event = _overflowing_update_event(tmp_path, keep_state="every_step")
    assert (event["step"], event["trigger"], event["phase"], event["first"]) == (1, "params", "optimizer", "inf")
    assert event["tensor"].split(".")[0] == event["module"] and event["op"].startswith("aten::")


def test_state_kept_only_when_bad_says_an_overflowing_update_may_show_as_state(tmp_path):
    """The CPU default copies no state for healthy steps; the price is this case, which it says."""
    event = _overflowing_update_event(tmp_path, keep_state="auto")
    assert (event["step"], event["trigger"], event["phase"]) == (1, "params", "state")
    assert any("keep_state='every_step' replays it exactly" in note for note in event["notes"])


@pytest.mark.parametrize("options, says", [
    (dict(numerics={"keep_states": "auto"}), "unknown numerics option(s): keep_states"),
    (dict(numerics={"keep_state": "sometimes"}), "numerics keep_state must be one of"),
    (dict(numerics="on"), "numerics must be True, False or a dict of options"),
    (dict(on_nonfinite="explode"), "on_nonfinite must be one of record, raise, skip"),
])
def test_bad_numerics_options_are_one_line_at_the_call_and_nothing_is_written(tmp_path, options, says):
    from gpuprof.errors import GpuprofError

    with pytest.raises(GpuprofError, match=re.escape(says)) as raised:
        gpuprof.profile(tmp_path / "run", model=torch.nn.Linear(2, 2), **options)
    assert "\n" not in str(raised.value) and not (tmp_path / "run").exists()
