"""`gpuprof replay BUNDLE` rebuilds any user's model from the command line (issue 54, point 5): under `gpuprof run`
the bundle holds how the script built its model (numerics.construction), and the replay, run where a user runs it
(the script's folder), builds it again and names the same step, module and op as the run's blame. A model gpuprof
never saw built (one profiled from Python) gets the Python that replays it instead, which works as printed. The
verdict's "Re-run the first bad step ..." gives whichever of the two works for that bundle. An evaluation's bundle
(a blow-up only an evaluation after the update saw, issue 54 point 4) replays its forward the same way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from corpus_build_nanogpt import OFFLINE, grad_accum_steps, run_build_nanogpt
from numerics_helpers import events
from script_corpus import nonfinite_event, run_nanogpt
from test_numerics_any_loop import plain_loop, zero_weight_loss

import gpuprof
from gpuprof.report import build_report

SAME_BLAME = "same blame as recorded during training"
SCRIPTS = Path(__file__).parents[1] / "scripts"  # corpus_runner and the offline stand-ins


def replayed_on_the_command_line(bundle: str, cwd, patches=()) -> subprocess.CompletedProcess:
    """`gpuprof replay BUNDLE` in `cwd`, in a process given the training run's offline stand-ins (`patches`, as
    corpus_runner applies them: a module the script imports that this machine lacks)."""
    command = [sys.executable, "-m", "gpuprof", "replay", bundle] if not patches else [
        sys.executable, "-c", "import sys, corpus_runner; corpus_runner.apply(" + repr([[p, {}] for p in patches])
        + "); sys.exit(corpus_runner.main(sys.argv[1:]))", "replay", bundle]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def assert_same_blame_replayed(event: dict, cwd, patches=()) -> None:
    assert event["replay_with"] == f"gpuprof replay {event['bundle']}"
    replayed = replayed_on_the_command_line(event["bundle"], cwd, patches)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert SAME_BLAME in replayed.stdout
    for row in (f"step          {event['step']}", f"module        {event['module']}", f"op            {event['op']}"):
        assert row in replayed.stdout, replayed.stdout


@pytest.mark.slow
def test_nanogpt_model_from_its_model_py_is_rebuilt_with_its_config(tmp_path):
    """nanoGPT builds `GPT(GPTConfig(**model_args))` from model.py beside train.py: the recipe names both classes
    and the dataclass's fields. An lr of 1e30 at iteration 3 makes step 4's forward overflow."""
    spike = ("corpus_patches:lr_spike", {"model": "model:GPT", "at_call": 3, "lr": 1e30})
    event = nonfinite_event(run_nanogpt(tmp_path, patches=[spike], max_iters=5))
    assert (event["step"], event["phase"]) == (4, "forward")
    assert_same_blame_replayed(event, tmp_path / "work")


@pytest.mark.slow
def test_a_model_class_the_script_defines_itself_is_rebuilt_from_its_definitions(tmp_path):
    """build-nanogpt's train_gpt2.py defines GPT and GPTConfig at its top level and trains there too (importing it
    would train): the replay runs only its imports and definitions. Its step-3 attention overflow, under bf16
    autocast, replays the same from the command line."""
    fault = {"model": "__main__:GPT", "weight": "transformer.h.0.attn.c_attn.weight", "at_call": 3 * grad_accum_steps()}
    result = run_build_nanogpt(tmp_path, patches=[("corpus_patches:attention_overflow", fault)])
    [event] = events(result.run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"]) == (3, "forward", "transformer.h.0.attn")
    assert_same_blame_replayed(event, result.workdir, patches=OFFLINE)


def test_a_model_built_before_gpuprof_ran_replays_with_the_python_it_prints(tmp_path):
    """Profiled from Python, the model was built before gpuprof started: no recipe. The command line refuses with
    the Python that replays it (the model pickled beside the bundle, the real paths filled in); the verdict gives
    the same; run as printed, it names the same blame."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))

    run_dir = tmp_path / "run"
    plain_loop(run_dir, model, 3, zero_weight_loss(model, bad_step=2))
    [event] = events(run_dir, "nonfinite")
    snippet = event["replay_with"]
    assert snippet.startswith(f"{sys.executable} - <<'EOF'\n")  # the Python that trained
    assert f"replay({event['bundle']!r}, model=model)" in snippet

    refused = replayed_on_the_command_line(event["bundle"], tmp_path)
    assert refused.returncode == 2 and "cannot be rebuilt from the command line" in refused.stderr
    assert snippet in refused.stderr
    assert snippet in build_report(run_dir).verdict.next_step

    ran = subprocess.run(["bash", "-c", snippet], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    for row in (f"step          {event['step']}", f"phase         {event['phase']}", f"op            {event['op']}"):
        assert row in ran.stdout, ran.stdout


def test_an_evaluation_under_inference_mode_right_after_the_bad_update_is_named_and_replays(tmp_path):
    """The last update of a plain loop is made with an lr of 1e30, then the loop samples from the model under
    torch.inference_mode() and dies on the NaN probabilities: no training step follows. The evaluation's output
    names it (its forward re-run on copies of its inference tensors), and its bundle replays the same blame."""
    from gpuprof.numerics.replay import replay, same_blame

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))

    model, inputs, last_step = mlp(), torch.randn(4, 8), 2
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="probability tensor contains"), \
            gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(last_step + 1):
            loss = model(inputs).square().mean()
            loss.backward()
            optimizer.param_groups[0]["lr"] = 1e30 if step == last_step else 1e-3
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss.detach())
        with torch.inference_mode():
            torch.multinomial(torch.softmax(model(inputs), -1), 1)

    [event] = events(tmp_path / "run", "nonfinite")
    assert (event["step"], event["trigger"], event["phase"]) == (last_step, "evaluation", "forward")
    assert (event["module"], event["op"], event["first"]) == ("1", "aten::native_layer_norm", "nan")
    assert (event["cause"]["step"], event["cause"]["lr"]) == (last_step, 1e30)
    replayed, recorded = replay(event["bundle"], model=mlp())
    assert same_blame(replayed, recorded)


def test_a_non_finite_evaluation_that_training_goes_on_from_is_named_at_the_next_steps_record(tmp_path):
    """A validation batch holding a NaN makes the evaluation's output non-finite while training stays finite: the
    evaluation is blamed (its batch, phase `state`) once the step after it shows its own flags finite."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    bad_validation = torch.randn(4, 8).index_fill_(1, torch.tensor([3]), float("nan"))
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(4):
            loss = model(torch.randn(4, 8)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss.detach())
            if step == 1:
                with torch.no_grad():
                    model(bad_validation)

    [event] = events(tmp_path / "run", "nonfinite")
    assert (event["step"], event["trigger"], event["phase"], event["tensor"]) == (1, "evaluation", "state", "batch")
