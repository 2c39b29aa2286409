"""The phases and the verdict on real public scripts (script_corpus.py), slowed down and evaluating on
purpose: data time is data wherever the script fetches, evaluation is its own phase and never host.
The Accelerate and Lightning examples' runs are also where each is checked to be recorded at all (a slowed
loader or an extra validation changes no step: recording one run more of each would only repeat them)."""

from __future__ import annotations

import pytest
from script_corpus import CLM_LINES, assert_recorded, run_accelerate_clm, run_lightning_transformer, run_nanogpt

from gpuprof.report import build_report

pytestmark = pytest.mark.slow  # real scripts in child processes

SLOW_GET_BATCH = "phase_patches:slow_memmap"
SLOW_DATALOADER = "phase_patches:slow_dataloader_fetch"
ACCELERATE_DELAY_S = 0.2
LIGHTNING_DELAY_S = 0.5


@pytest.fixture(scope="module")
def accelerate_slow_loader(tmp_path_factory):
    """The Accelerate example, every DataLoader batch 0.2 s slower."""
    return run_accelerate_clm(tmp_path_factory.mktemp("accelerate"),
                              patches=[(SLOW_DATALOADER, {"delay_s": ACCELERATE_DELAY_S})])


@pytest.fixture(scope="module")
def lightning_validating(tmp_path_factory):
    """The Lightning example, 6 steps, validating every 2 (2 batches), every batch 0.5 s slower to fetch; 2 items
    a batch, so that its step (about 0.8 s on this loaded machine at the example's 20) is a tiny model's."""
    return run_lightning_transformer(tmp_path_factory.mktemp("lightning"), max_steps=6, patches=[
        ("phase_patches:validate_every", {"steps": 2}), (SLOW_DATALOADER, {"delay_s": LIGHTNING_DELAY_S}),
        ("corpus_patches:loader_batch_size", {"batch_size": 2})])


def recorded(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return build_report(result.run.path)


def measured(report):
    steps = report.run.steps
    return steps[steps["step"] >= report.summary.warmup.first_measured_step]


def test_nanogpt_fetching_between_forward_and_backward_is_input_bound(tmp_path):
    """nanoGPT fetches the next batch after the model call, before backward(): with its get_batch slow,
    that time is data, not forward, the verdict says input and names get_batch, and the fix speaks of
    what the loop does (it has no DataLoader)."""
    delay_s = 0.5
    report = recorded(run_nanogpt(tmp_path, patches=[(SLOW_GET_BATCH, {"delay_s": delay_s})], max_iters=8))
    steps = measured(report)
    assert (steps["data_time_s"] >= delay_s).all() and (steps["forward_time_s"] < delay_s).all()
    verdict = report.verdict
    assert verdict.bound == "input" and verdict.share_pct >= 60, verdict.why
    assert "in get_batch (train.py:116) of the step" in verdict.why
    assert report.meta["phase_sources"] == [{"role": "data", "function": "get_batch",
                                             "file": str(tmp_path / "work" / "train.py"), "line": 116}]
    [finding] = report.findings_in("input")
    assert finding.rule == "dataloader-bound" and verdict.next_step.startswith(finding.fix)
    assert finding.fix.startswith("get_batch (train.py:116) takes the time: prepare the next batches")
    assert "queue.Queue" in finding.fix and "gpuprof train" not in verdict.next_step


def test_nanogpt_periodic_evaluation_is_its_own_phase(tmp_path):
    """estimate_loss() every 3 iterations (4 slow batches each) is eval: apart from the training step's
    phases, named in the verdict with how often and how long, never host."""
    delay_s = 0.3
    report = recorded(run_nanogpt(tmp_path, patches=[(SLOW_GET_BATCH, {"delay_s": delay_s})], max_iters=9,
                                  eval_interval=3, eval_iters=2))
    steps = report.run.steps
    evaluating = steps[steps["eval_time_s"].notna()]
    assert len(evaluating) >= 2
    # the first evaluation seen is timed from the fetch of its first batch; once estimate_loss is found, all of it
    assert (evaluating["eval_time_s"] >= 4 * delay_s).all()
    assert {"role": "eval", "function": "estimate_loss"}.items() <= report.meta["phase_sources"][-1].items()
    other = report.hotspots[report.hotspots["phase"] == "other"]
    assert not other["function"].eq("estimate_loss").any()  # other is the loop's own lines (and its checkpoint)
    verdict = report.verdict
    assert verdict.bound == "input", verdict.why
    assert "Evaluation inside the loop is left out of the step's bound" in verdict.why
    assert report.summary.evaluation["steps_with_eval"] == verdict.evaluation["steps_with_eval"] >= 1


def test_accelerate_clm_example_is_recorded(accelerate_slow_loader):
    result = accelerate_slow_loader
    assert "eval perplexity" in result.stdout
    run = assert_recorded(result, steps=3 * CLM_LINES // 2)  # 3 epochs, 2 lines a batch, the first included
    assert run.steps["loss_finite"].all()  # what accelerator.backward() was given
    assert run.meta["model"]["class"] == "GPT2LMHeadModel"


def test_accelerate_example_slow_dataloader_and_epoch_end_evaluation(accelerate_slow_loader):
    """The Accelerate example fetches from its DataLoader before the forward and evaluates inline at each
    epoch's end: the loader's time is input, the evaluation its own phase, and the fix is the DataLoader's."""
    report = recorded(accelerate_slow_loader)
    steps = report.run.steps
    evaluating = steps[steps["eval_time_s"].notna()]
    assert len(evaluating) == 2  # after epochs 1 and 2, in the next epoch's first step (the 3rd ends the run)
    # its one evaluation batch is fetched (through Accelerate's prefetching wrapper) before the first evaluation
    # call, so that fetch is data; the evaluation call itself is eval
    assert (evaluating["eval_time_s"] > 0).all()
    # one slow batch a step; Accelerate fetches one ahead, so at an epoch's edges a step may hold none or two
    assert measured(report)["data_time_s"].median() >= ACCELERATE_DELAY_S
    verdict = report.verdict
    assert verdict.bound == "input" and verdict.share_pct >= 50, verdict.why
    assert "Evaluation inside the loop is left out of the step's bound: 2 time(s)" in verdict.why
    # a CPU run: no pin_memory, workers as many as its cores allow (gpuprof.diagnoses.fits)
    assert "DataLoader(num_workers=" in verdict.next_step and "pin_memory" not in verdict.next_step
    assert "gpuprof train" not in verdict.next_step


def test_lightning_transformer_example_is_recorded(lightning_validating):
    run = assert_recorded(lightning_validating, steps=6)
    assert run.meta["model"]["class"] == "LanguageModel"


def test_lightning_slow_loader_is_input_and_its_validation_eval_not_host(lightning_validating):
    """The Trainer fetches each batch before the training step: that time is input, with the share of the step
    it takes; its validation batches, as slow, are the eval phase's, not data and not host."""
    report = recorded(lightning_validating)
    steps = measured(report)
    assert (steps["data_time_s"] >= LIGHTNING_DELAY_S).all() and (steps["data_time_s"] < 2 * LIGHTNING_DELAY_S).all()
    evaluating = report.run.steps["eval_time_s"].notna()
    assert evaluating.sum() >= 2 and (report.run.steps["eval_time_s"][evaluating] >= 2 * LIGHTNING_DELAY_S).all()
    verdict = report.verdict
    training_s = (steps["step_time_s"] - steps["eval_time_s"].fillna(0)).sum()  # the bound is the training step's
    assert verdict.bound == "input" and verdict.share_pct >= 60, verdict.why
    assert verdict.share_pct >= 100 * LIGHTNING_DELAY_S * len(steps) / training_s - 0.5, verdict.why  # the delay's
    assert "Evaluation inside the loop is left out of the step's bound" in verdict.why
    # a CPU run: no pin_memory, workers as many as its cores allow (gpuprof.diagnoses.fits)
    assert "DataLoader(num_workers=" in verdict.next_step and "pin_memory" not in verdict.next_step
    assert "gpuprof train" not in verdict.next_step


SLOW_DISK = '''"""torch.save on a slow disk: a library's delay, not the loop's (this file sits in a site-packages folder)."""
import functools
import time

import torch


def slow_torch_save(delay_s):
    save = torch.save

    @functools.wraps(save)
    def slow_save(*args, **kwargs):
        time.sleep(delay_s)
        return save(*args, **kwargs)

    torch.save = slow_save
'''
NANOGPT_SAVE_LINE = "<module> (train.py:286)"  # torch.save(checkpoint, os.path.join(out_dir, 'ckpt.pt'))


def test_nanogpt_checkpoint_after_evaluation_is_named_in_the_slow_steps(tmp_path, monkeypatch):
    """nanoGPT saves a checkpoint right after it evaluates: on a slow disk those steps are the erratic ones, their
    extra time is other (the save is no evaluation, also in the first evaluation, which gpuprof times from its
    model calls before it has found estimate_loss), and the finding names the loop's line that saves."""
    library = tmp_path / "lib" / "site-packages"
    library.mkdir(parents=True)
    (library / "slow_disk.py").write_text(SLOW_DISK)
    monkeypatch.setenv("PYTHONPATH", str(library))
    delay_s = 0.3
    report = recorded(run_nanogpt(tmp_path, patches=[("slow_disk:slow_torch_save", {"delay_s": delay_s})],
                                  max_iters=12, eval_interval=4, eval_iters=1, always_save_checkpoint=True))
    saving = report.run.stacks[report.run.stacks["loop_line"] == 286]
    assert len(saving) >= 3 and saving["phase"].eq("other").all(), saving[["step", "phase"]]
    assert (report.run.steps["eval_time_s"].dropna() < delay_s).all()
    [finding] = [f for f in report.findings if f.rule == "step-time-variance"]
    evidence = finding.evidence
    assert evidence["slow_steps_phase"] == "other" and evidence["slow_steps_excess_s"] >= delay_s
    assert evidence["slow_steps_evaluating"] == len(evidence["slowest_steps"]) >= 1
    assert list(evidence["slow_steps_sites"]) == [NANOGPT_SAVE_LINE]
    assert "all of them steps that evaluate" in finding.title
    assert finding.fix.startswith(f"In the slowest steps' other time the loop was at {NANOGPT_SAVE_LINE}")
