"""pytorch/examples' word_language_model/main.py, unmodified: an LSTM whose loop steps no optimizer (it
updates its weights itself, `p.data.add_(p.grad, alpha=-lr)`, after `clip_grad_norm_`), evaluates at each
epoch's end and saves the whole model with `torch.save(model, f)`. Each iteration is a step, from its
training call of the model to the next one's; the first is where such a loop is told apart, and is not
recorded. Faults are patched in at run time."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from script_corpus import WLM_ARGS, assert_recorded, nonfinite_event, run_word_language_model, wikitext_iterations

from gpuprof.report import build_report

pytestmark = pytest.mark.slow  # real scripts in child processes

RNN = "model:RNNModel"  # the example's model class, in its model.py
PRINTED = re.compile(r"\| epoch +(\d+) \| +(\d+)/ *\d+ batches .*\| loss +([-\d.naninf]+) \|")


@pytest.fixture(scope="module")
def unpatched(tmp_path_factory):
    return run_word_language_model(tmp_path_factory.mktemp("wlm"))


def epoch_iterations(result) -> list[int]:
    return wikitext_iterations(result.workdir / "data" / "wikitext-2")


def test_each_iteration_of_a_loop_stepping_no_optimizer_is_a_step(unpatched):
    assert "End of training" in unpatched.stdout  # the script ran as itself, to its end
    per_epoch = epoch_iterations(unpatched)
    tokens = (per_epoch * WLM_ARGS["epochs"])[1:-1]  # the first told apart, the last ended by no next call
    run = assert_recorded(unpatched, steps=len(tokens))  # finite gradient norms: clip_grad_norm_'s
    assert run.steps["tokens"].tolist() == tokens
    assert run.meta["model"]["class"] == "RNNModel"
    assert run.meta["config"]["first_iteration"].startswith("not recorded")


def test_the_loss_of_each_step_is_the_one_the_script_prints(unpatched):
    """The script prints the mean loss of the last 5 batches (from batch 10 on: its first print divides 6 by 5;
    the run's last batch is not a step)."""
    first_step = {1: -1, 2: len(epoch_iterations(unpatched)) - 1}  # step of an epoch's batch 0
    losses = unpatched.run.steps["loss"].to_numpy()
    printed = [(int(epoch), int(batch), float(loss)) for epoch, batch, loss in PRINTED.findall(unpatched.stdout)]
    compared = [(np.mean(losses[first_step[epoch] + batch - 4: first_step[epoch] + batch + 1]), loss)
                for epoch, batch, loss in printed if batch >= 10 and first_step[epoch] + batch < len(losses)]
    assert len(compared) >= 10
    np.testing.assert_allclose(*zip(*compared), atol=0.0051)  # printed to 2 decimals


def test_the_model_it_saves_whole_carries_none_of_gpuprofs_hooks(unpatched):
    """torch.save(model) pickles the module's hooks: gpuprof's must not be among them (before, the save failed
    on a closure and the script with it)."""
    load = ("import sys, torch; sys.path.insert(0, '.'); model = torch.load('model.pt', weights_only=False); "
            "print(len(model._forward_pre_hooks), len(model._forward_hooks), 'gpuprof' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, cwd=unpatched.workdir)
    assert loaded.stdout.split() == ["0", "0", "False"], loaded.stderr[-2000:]


def test_its_epoch_end_evaluation_is_eval_not_the_step(unpatched):
    report = build_report(unpatched.run.path)
    assert {"role": "eval", "function": "evaluate"}.items() <= report.meta["phase_sources"][-1].items()
    evaluating = report.run.steps[report.run.steps["eval_time_s"].notna()]
    assert evaluating["step"].tolist() == [len(epoch_iterations(unpatched)) - 2]  # epoch 1's, before epoch 2's call
    assert report.summary.evaluation["steps_with_eval"] == 1
    assert "Evaluation inside the loop is left out of the step's bound" in report.verdict.why


def test_with_its_optimizer_every_iteration_is_a_step_from_the_first(tmp_path):
    result = run_word_language_model(tmp_path, flags=["--use-optimizer"])
    tokens = epoch_iterations(result) * WLM_ARGS["epochs"]
    run = assert_recorded(result, steps=len(tokens))
    assert run.steps["tokens"].tolist() == tokens


def test_a_bad_embedding_row_is_blamed_at_its_step_without_an_optimizer(tmp_path):
    fault = {"model": RNN, "weight": "encoder.weight", "at_call": 5}  # call 0 is the iteration before step 0
    result = run_word_language_model(tmp_path, patches=[("corpus_patches:bad_embedding_row", fault)])
    event = nonfinite_event(result)
    print(event)
    assert (event["step"], event["phase"], event["module"], event["first"]) == (4, "state", "encoder", "nan")
    assert event["tensor"] == "encoder.weight"
