"""x-transformers' train_enwik8.py, unmodified (corpus_x_transformers.py), with its update at iteration 4 made with
an lr of 1e30: the weights stay finite (about 1e30), no training step follows, and the script validates (a loss of
NaN) and samples right after that update, where torch.multinomial refuses the NaN probabilities and the script dies.
No training step's flags ever see the blow-up: the evaluation's output is what names it (issue 54, point 4), and
the bundle it leaves replays from the command line, the model rebuilt from how the script built it (point 5)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from corpus_x_transformers import SHRINK, run_x_transformers
from numerics.numerics_helpers import events

from gpuprof.report import build_report

pytestmark = pytest.mark.slow  # a real script in a child process

MODEL = "x_transformers.autoregressive_wrapper:AutoregressiveWrapper"  # the class the script trains
SPIKED = SHRINK["GENERATE_EVERY"]  # the iteration whose update spikes: it validates and samples right after it
SPIKE_LR = 1e30


@pytest.fixture(scope="module")
def spiked(tmp_path_factory):
    at_call = SPIKED * SHRINK["GRADIENT_ACCUMULATE_EVERY"]  # that iteration's first training forward
    spike = ("corpus_patches:lr_spike", {"model": MODEL, "at_call": at_call, "lr": SPIKE_LR})
    return run_x_transformers(tmp_path_factory.mktemp("x-transformers-nan"), patches=[spike])


def test_the_script_dies_in_its_own_sampling_with_no_training_step_after_the_update(spiked):
    assert spiked.returncode == 1
    assert "RuntimeError: probability tensor contains either `inf`, `nan` or element < 0" in spiked.stderr
    assert "validation loss: nan" in spiked.stdout
    steps = spiked.run.steps
    assert steps["step"].tolist() == list(range(SPIKED + 1))  # the spiked iteration is the last step
    assert steps["loss_finite"].all() and steps["grad_norm_finite"].all()  # no step's own flags saw it


def test_the_evaluation_after_the_update_names_its_step_module_op_and_the_update(spiked):
    [event] = events(spiked.run_dir, "nonfinite")
    assert (event["step"], event["trigger"], event["phase"], event["first"]) == (SPIKED, "evaluation", "forward", "nan")
    # the first op the ~1e30 weights overflow: the first block's pre-norm, in x_transformers' own source
    assert (event["module"], event["op"]) == ("net.attn_layers.layers.0.0.0.ln", "aten::native_layer_norm")
    assert event["source"].startswith(f"{spiked.workdir / 'x_transformers' / 'x_transformers.py'}:")
    assert event["input_absmax"] > SPIKE_LR / 100
    cause = event["cause"]
    assert (cause["kind"], cause["step"], cause["lr"]) == ("oversized_update", SPIKED, SPIKE_LR)
    # before, weights of a few units (LayerNorm's start at 1 and a few steps move them); after, of the spike's size
    assert cause["param_absmax_after"] > SPIKE_LR / 100 > 1e3 > cause["param_absmax_before"]


def test_analyze_leads_with_the_numerics_then_says_the_script_raised(spiked):
    verdict = build_report(spiked.run.path).verdict
    assert (verdict.bound, verdict.subject) == ("numerics", "nan in net.attn_layers.layers.0.0.0.ln"), verdict.why
    assert f"Non-finite evaluation output after step {SPIKED}'s update" in verdict.why
    assert verdict.share_pct is None and "of steps non-finite" not in verdict.why  # no training step went non-finite
    assert f"step {SPIKED}'s update grew the largest |weight|" in verdict.why
    assert "Then the run stopped: The script raised RuntimeError: probability tensor contains" in verdict.why
    bundle = spiked.run_dir / "numerics" / f"step-{SPIKED}-rank-0.pt"
    assert verdict.next_step.startswith(f"Re-run the first bad step with `gpuprof replay {bundle}`.")


def test_the_command_the_verdict_gives_replays_the_same_blame(spiked):
    """Run where a user would run it, in the script's folder: the model is rebuilt as the script built it
    (AutoregressiveWrapper(TransformerWrapper(..., attn_layers=Decoder(...))), the shrunk Decoder's own sizes)."""
    [event] = events(spiked.run_dir, "nonfinite")
    assert event["replay_with"] == f"gpuprof replay {event['bundle']}"
    replayed = subprocess.run([sys.executable, "-m", "gpuprof", "replay", event["bundle"]], cwd=spiked.workdir,
                              capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 0, replayed.stderr
    assert "same blame as recorded during training" in replayed.stdout
    assert f"module        {event['module']}" in replayed.stdout and f"op            {event['op']}" in replayed.stdout
