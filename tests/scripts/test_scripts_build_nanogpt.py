"""karpathy/build-nanogpt's train_gpt2.py, unmodified (corpus_build_nanogpt.py): the GPT-2 reproduction's loop at
its top level, gradient accumulation over 4 micro-batches a step (DDP's `require_backward_grad_sync` on the last),
bf16 autocast, its own DataLoaderLite over .npy shards, and at its evaluation steps the validation loss, HellaSwag
and 4 samples. Steps are its optimizer steps, each one's loss the `loss_accum` it prints; its evaluation is
evaluation, slow shard reads are input and name its own function, an overflow is blamed where it happens; under
torchrun on two gloo ranks every rank's steps are recorded, and a rank stuck reading a shard is named in a hang."""

from __future__ import annotations

import contextlib
import re
import subprocess

import numpy as np
import pytest
from corpus_build_nanogpt import (EVAL_EVERY, HELLASWAG_EXAMPLES, SHRINK, grad_accum_steps, printed_losses,
                                  run_build_nanogpt, slow_disk_library)
from numerics.numerics_helpers import events
from processes import events_on_disk, stop, wait_for
from script_corpus import assert_recorded, finished, script_launch

from gpuprof.report import build_report

pytestmark = pytest.mark.slow  # real scripts in child processes

STEPS = SHRINK["max_steps"]
EVALUATING_STEPS = [4, 8]  # every EVAL_EVERY steps and the last (step 0's comes before recording starts)
BATCH_TOKENS = SHRINK["B"] * SHRINK["T"]
HELLASWAG_DELAY_S = 0.15
RANKS = 2
HANG_TIMEOUT_S = 10


@pytest.fixture(scope="module")
def evaluating(tmp_path_factory):
    """The script as it is, each HellaSwag example 0.15 s slower to render (a larger HellaSwag set)."""
    return run_build_nanogpt(tmp_path_factory.mktemp("build-nanogpt"),
                             patches=[("build_nanogpt_patches:slow_hellaswag", {"delay_s": HELLASWAG_DELAY_S})])


def test_each_optimizer_step_of_4_micro_batches_is_one_step(evaluating):
    run = assert_recorded(evaluating, steps=STEPS)
    assert f"step {STEPS - 1:5d} | loss:" in evaluating.stdout  # the script ran as itself to its last step
    assert run.meta["model"]["class"] == "GPT" and run.meta["model"]["n_layers"] == 2
    steps = run.steps
    assert steps["step"].tolist() == list(range(STEPS))  # from the first, joined at its first backward()
    assert (steps["micro_batches"] == grad_accum_steps()).all()
    assert (steps["tokens"] == BATCH_TOKENS * grad_accum_steps()).all()


def test_each_steps_loss_is_the_loss_accum_it_prints(evaluating):
    """It prints the sum of its micro-batches' `loss / grad_accum_steps`: what gpuprof sums from backward()."""
    assert evaluating.returncode == 0, evaluating.stderr[-3000:]
    printed = printed_losses(evaluating.stdout)
    assert len(printed) == STEPS
    np.testing.assert_allclose(evaluating.run.steps["loss"], printed, atol=1e-6)  # printed to 6 decimals


def test_validation_hellaswag_and_samples_are_evaluation_never_the_steps_bound(evaluating):
    """At steps 4 and 8 it computes the validation loss, saves a checkpoint (as at a last step), renders and scores
    HellaSwag (4 examples, 0.6 s) and samples: all of it between its first and last model call in evaluation, eval;
    none of it data, forward or other, and the verdict's bound is the training step's."""
    assert evaluating.stdout.count("HellaSwag accuracy:") == 1 + len(EVALUATING_STEPS)
    assert "rank 0 sample 3: Hello, I'm a language model," in evaluating.stdout
    assert sorted(path.name for path in (evaluating.workdir / "log").glob("*.pt")) == [
        f"model_{step:05d}.pt" for step in EVALUATING_STEPS]
    report = build_report(evaluating.run.path)
    steps = report.run.steps.set_index("step")
    assert steps.index[steps["eval_time_s"].notna()].tolist() == EVALUATING_STEPS
    rendering_s = HELLASWAG_EXAMPLES * HELLASWAG_DELAY_S
    assert (steps.loc[EVALUATING_STEPS, "eval_time_s"] >= rendering_s).all()
    for phase in ("data", "forward", "backward", "optimizer", "other"):
        assert (steps.loc[EVALUATING_STEPS, f"{phase}_time_s"] < rendering_s / 2).all(), phase
    verdict = report.verdict
    assert verdict.bound not in ("eval", "input", "failure"), verdict.why
    left_out = f"Evaluation inside the loop is left out of the step's bound: 2 time(s), every {EVAL_EVERY} steps"
    assert left_out in verdict.why
    assert report.summary.evaluation["steps_with_eval"] == len(EVALUATING_STEPS)


def test_slow_shard_reads_are_input_in_its_own_next_batch(tmp_path, monkeypatch):
    """Train shards of one batch each (DataLoaderLite moves to the next at every batch) on a disk that reads a shard
    in 0.15 s (its load_tokens' np.load): its 4 batches a step are 0.6 s of data, and the verdict says input, in its
    DataLoaderLite.next_batch, whose calls feed the model."""
    delay_s = 0.15
    monkeypatch.setenv("PYTHONPATH", str(slow_disk_library(tmp_path / "lib")))
    result = finished(run_build_nanogpt(
        tmp_path, train_shard_tokens=BATCH_TOKENS + 1,
        patches=[("slow_disk:slow_numpy_load", {"delay_s": delay_s, "files": "train"})]))
    report = build_report(result.run.path)
    script = str(result.workdir / "train_gpt2.py")
    assert report.meta["phase_sources"] == [{"role": "data", "function": "DataLoaderLite.next_batch", "file": script,
                                             "line": 240}]
    measured = report.run.steps[report.run.steps["step"] >= 1]  # step 0 is joined at its first backward()
    assert (measured["data_time_s"] >= grad_accum_steps() * delay_s).all()
    verdict = report.verdict
    assert verdict.bound == "input" and verdict.share_pct >= 60, verdict.why
    assert "in DataLoaderLite.next_batch (train_gpt2.py:240) of the step" in verdict.why
    assert verdict.next_step.startswith("DataLoaderLite.next_batch (train_gpt2.py:240) takes the time")


def test_an_attention_overflow_is_blamed_at_its_step_and_the_sample_it_breaks_ends_the_run(tmp_path):
    """The first block's query/key/value projection scaled by 1e25 before the first micro-batch of step 3 (training
    call 12): its attention overflows in that forward, under bf16 autocast. The script goes on with NaN weights
    until it samples at step 4, where torch.multinomial refuses NaN probabilities: rank 0 failed after step 3."""
    at_call = 3 * grad_accum_steps()
    fault = {"model": "__main__:GPT", "weight": "transformer.h.0.attn.c_attn.weight", "at_call": at_call}
    result = run_build_nanogpt(tmp_path, patches=[("corpus_patches:attention_overflow", fault)])
    assert result.returncode == 1 and "probability tensor contains either `inf`, `nan`" in result.stderr
    assert result.run.steps["loss_finite"].tolist() == [True, True, True, False]
    [event] = events(result.run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["micro_batch"], event["dtype"]) == (
        3, "forward", "transformer.h.0.attn", 0, "bfloat16")
    assert "scaled_dot_product" in event["op"] and event["input_absmax"] > 1e20
    assert event["source"].startswith(f"{result.workdir / 'train_gpt2.py'}:36 in forward: y = F.scaled_dot_product")
    # the numerics explain the stop, so the verdict leads with them, then says the script raised, where and what
    verdict = build_report(result.run.path).verdict
    assert (verdict.bound, verdict.subject) == ("numerics", "nan in transformer.h.0.attn"), verdict.why
    assert "Then the run stopped: The script raised RuntimeError: probability tensor contains" in verdict.why
    assert re.search(r"at \S+ \(train_gpt2\.py:\d+\), after step 3\.", verdict.why), verdict.why
    assert "hang" not in verdict.headline.lower() and "dead rank" not in verdict.why


def test_under_torchrun_every_rank_records_each_step_and_its_own_loss(tmp_path):
    """Two gloo ranks: 2 micro-batches a step each, the gradients all-reduced at the second; it prints the ranks'
    mean loss (`dist.all_reduce(loss_accum, op=AVG)`), gpuprof records each rank's own. Its evaluations, on both
    ranks, are counted once each."""
    result = finished(run_build_nanogpt(tmp_path, ranks=RANKS))
    run = result.run
    assert run.meta["world_size"] == RANKS and run.meta["model"]["wrapper"] == "DistributedDataParallel"
    steps = run.steps
    assert steps.groupby("rank")["step"].apply(list).to_dict() == {rank: list(range(STEPS)) for rank in range(RANKS)}
    assert (steps["micro_batches"] == grad_accum_steps(RANKS)).all() and steps["grad_norm"].notna().all()
    losses = steps.pivot(index="step", columns="rank", values="loss")
    np.testing.assert_allclose(losses.mean(axis=1), printed_losses(result.stdout), atol=1e-6)
    assert not np.allclose(losses[0], losses[1])  # each rank's own batches
    report = build_report(run.path)
    assert report.summary.evaluation["steps_with_eval"] == len(EVALUATING_STEPS)


@contextlib.contextmanager
def started(launch):
    """The job in a session of its own, its output in a log beside its run directory; stopped when done."""
    log = open(launch.run_dir.with_suffix(".log"), "w")  # noqa: SIM115 - closed below
    # a rank waiting inside gloo does not handle torchrun's SIGTERM: torchrun kills it after 5 s, not its 30
    env = {**launch.env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
    job = subprocess.Popen(launch.command, cwd=launch.workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        yield job
    finally:
        stop(job)
        log.close()


def test_a_rank_stuck_reading_its_next_shard_is_named_with_its_stack_and_step_while_the_job_hangs(
        tmp_path, monkeypatch):
    """Each rank's first train shard holds 3 steps of batches and a little more: both move on to the second in the
    first micro-batch of step 3, where rank 1's read of it never returns. Rank 0 goes on to its second micro-batch and
    waits in DDP's all-reduce; the hang event names rank 1, in data at step 3, in the script's load_tokens."""
    stuck_step = 3
    monkeypatch.setenv("PYTHONPATH", str(slow_disk_library(tmp_path / "lib")))
    never_read = {"delay_s": 3600, "files": "train_000002", "on_rank": 1}
    launch = run_build_nanogpt(tmp_path, ranks=RANKS, patches=[("slow_disk:slow_numpy_load", never_read)],
                               train_shard_tokens=SHRINK["total_batch_size"] * (stuck_step + 1),
                               gpuprof_args=("--hang-timeout-s", HANG_TIMEOUT_S), how=script_launch)
    with started(launch) as job:
        events = wait_for(lambda: [event for event in events_on_disk(launch.run_dir, "hang") if event["rank"] == 1],
                          job)
        assert job.poll() is None, "the job should still be hung"
    log = launch.run_dir.with_suffix(".log").read_text()
    assert events, f"no hang event from rank 1: {log[-3000:]}"
    [event] = events
    details = event["details"]
    assert (event["step"], details["behind_ranks"], details["waiting_ranks"]) == (stuck_step, [1], [0])
    assert event["message"].startswith(f"rank 1 is at step {stuck_step} (data) in load_tokens (train_gpt2.py:209): ")
    stuck, waiting = details["ranks"]["1"], details["ranks"]["0"]
    assert (stuck["step"], stuck["phase"]) == (stuck_step, "data")
    script = str(launch.workdir / "train_gpt2.py")
    lines = [(frame["function"], frame["code"]) for frame in stuck["stack"] if frame["file"] == script]
    assert lines == [("<module>", "x, y = train_loader.next_batch()"),
                     ("next_batch", "self.tokens = load_tokens(self.shards[self.current_shard])"),
                     ("load_tokens", "npt = np.load(filename)")]
    assert stuck["stack"][-1]["code"] == "time.sleep(delay_s)"
    assert waiting["phase"] == "backward" and waiting["collective"]["kind"] == "all_reduce"
    assert f"step {stuck_step - 1:5d} | loss:" in log and f"step {stuck_step:5d} | loss:" not in log
