"""pytorch/examples' FSDP2 example and DDP tutorial, unmodified, under torchrun on two gloo ranks of this machine's CPU
(corpus_torch_examples.py): every rank's steps, the loss the script backpropagates, the verdict, a rank slow in its
data, a NaN, and a rank that hangs in its data, named while the job still hangs."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import numpy as np
import psutil
import pytest
from corpus_torch_examples import (DDP_BATCH, DDP_EPOCHS, FSDP2_ITERATIONS, FSDP2_MODEL, FSDP2_TOKENS, RANKS,
                                   ddp_tutorial_steps_per_epoch, run_ddp_tutorial, run_fsdp2_example)
from processes import hang_events_of_every_rank, stop, wait_for
from script_corpus import finished, script_launch

from gpuprof.report import build_report

pytestmark = pytest.mark.slow  # real scripts in torchrun jobs

PATCHES = "torch_examples_patches"
DDP_STEPS = DDP_EPOCHS * ddp_tutorial_steps_per_epoch()
# The watchdog beats every timeout / 4 (tests/capture/test_capture_hangs.py): 10 s leaves a loaded machine room
HANG_TIMEOUT_S = 10
HANG_EVENT_BOUND_S = 240  # start-up of both ranks, the steps before the stuck one, then the timeout and a beat or two


def recorded_losses(result, kind: str = "rank") -> dict[int, list[float]]:
    """What record_losses / record_clip_norms wrote, per rank."""
    folder = result.workdir.parent / "losses"
    return {rank: [json.loads(line) for line in (folder / f"{kind}-{rank}.jsonl").read_text().splitlines()]
            for rank in range(RANKS)}


def by_rank(steps, column: str) -> dict[int, list]:
    return {rank: group.sort_values("step")[column].tolist() for rank, group in steps.groupby("rank")}


def recording(tmp_path: Path) -> list:
    folder = str(tmp_path / "losses")
    return [(f"{PATCHES}:record_losses", {"folder": folder}), (f"{PATCHES}:record_clip_norms", {"folder": folder})]


# ---------------------------------------------------------------------------------------------- FSDP2
@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("fsdp2")
    return finished(run_fsdp2_example(tmp_path, patches=recording(tmp_path)))


def test_fsdp2_every_rank_records_its_ten_iterations_with_the_loss_it_backpropagates(fsdp2):
    run = fsdp2.run
    assert run.meta["world_size"] == RANKS and run.meta["model"]["class"] == "FSDPTransformer"
    steps = run.steps
    assert by_rank(steps, "step") == {rank: list(range(FSDP2_ITERATIONS)) for rank in range(RANKS)}
    assert (steps["tokens"] == FSDP2_TOKENS).all()
    assert list((fsdp2.workdir / "checkpoints" / "dtensor_api").glob("*/model_state_dict.pt"))  # it ran to its end
    # `model(x).sum()`, each rank's, from the first iteration on
    losses = by_rank(steps, "loss")
    for rank, script_losses in recorded_losses(fsdp2).items():
        np.testing.assert_allclose(losses[rank], script_losses, rtol=1e-6)


def test_fsdp2_gradient_norm_is_the_one_its_clip_returns_over_every_rank_s_shards(fsdp2):
    """gpuprof reads the sharded parameters (DTensors), not the gathered copies FSDP2 registers on the root while
    its backward runs (where recording starts), whose memory it frees after: those made the norm's read crash."""
    grad_norms = by_rank(fsdp2.run.steps, "grad_norm")
    for rank, clip_norms in recorded_losses(fsdp2, "clip-rank").items():
        np.testing.assert_allclose(grad_norms[rank], clip_norms, rtol=1e-4)
    rules = {finding.rule for finding in build_report(fsdp2.run.path).findings}
    assert "params-without-optimizer" not in rules  # the gathered copies are in no optimizer: they were named


def test_fsdp2_verdict_for_a_tiny_cpu_job_asks_for_a_trace_and_says_sharding_is_not_needed(fsdp2):
    report = build_report(fsdp2.run.path)
    verdict = report.verdict
    assert (verdict.bound, verdict.missing) == (None, "trace window"), verdict.why  # gloo hides in its phases
    [memory] = [finding for finding in report.findings if finding.rule == "fsdp-memory-vs-ddp"]
    assert memory.title.startswith("The model would fit without sharding")


def test_fsdp2_rank_slow_drawing_its_batch_is_named_and_the_others_wait_in_their_forward(tmp_path):
    """Rank 1's torch.randint (the example's data) takes 0.3 s longer: its data phase holds it, rank 0 waits for it
    in the root's all-gather, which FSDP2 makes in a forward pre-hook: forward, not data."""
    delay_s = 0.3
    result = finished(run_fsdp2_example(
        tmp_path, patches=[(f"{PATCHES}:slow_random_batch", {"delay_s": delay_s, "on_rank": 1})]))
    steps = result.run.steps[result.run.steps["step"] > 0]  # step 0's data is not seen
    slow, waiting = steps[steps["rank"] == 1], steps[steps["rank"] == 0]
    assert (slow["data_time_s"] >= delay_s).all() and (waiting["data_time_s"] < delay_s / 3).all()
    assert waiting["forward_time_s"].median() >= 0.8 * delay_s
    report = build_report(result.run.path)
    [data] = [finding for finding in report.findings if finding.rule == "dataloader-bound"]
    assert "most of it on rank 1" in data.title and data.evidence["data_share_pct_by_rank"][1] > 40
    assert report.verdict.bound == "input", report.verdict.why


@pytest.fixture(scope="module")
def fsdp2_lr_spike(tmp_path_factory):
    """Adam's lr set to 1e30 before iteration 3's forward: that update throws the weights out, and from iteration 4
    on the loss is not finite, on both ranks (the same batch: both seed 0)."""
    spike = ("corpus_patches:lr_spike", {"model": FSDP2_MODEL, "at_call": 3, "lr": 1e30})
    return finished(run_fsdp2_example(tmp_path_factory.mktemp("fsdp2-lr-spike"), patches=[spike]))


def test_fsdp2_lr_spike_is_blamed_at_the_next_step_on_every_rank(fsdp2_lr_spike):
    """The re-run needs every rank's shards in one process: the flags answer, and say so."""
    assert by_rank(fsdp2_lr_spike.run.steps, "loss_finite") == {rank: [True] * 4 + [False] * 6 for rank in range(RANKS)}
    events = _parquet_events(fsdp2_lr_spike, "nonfinite")
    assert sorted(event["rank"] for event in events) == list(range(RANKS))
    for event in events:
        assert event["step"] == 4 and "non-finite loss" in event["message"]
        assert "the model is sharded" in event["message"]


def test_fsdp2_lr_spike_names_the_update_that_caused_it(fsdp2_lr_spike):
    """Read from each rank's shards: the update grew them all (before, a sharded model's event named no cause)."""
    for event in _parquet_events(fsdp2_lr_spike, "nonfinite"):
        cause = event["cause"]
        assert (cause["step"], cause["lr"]) == (3, 1e30) and cause["median_lr"] == pytest.approx(1e-2)


def test_fsdp2_lr_spike_verdict_counts_each_non_finite_step_once(fsdp2_lr_spike):
    """Both ranks record each step: 12 rows, 6 steps (before, the share read 120 %)."""
    verdict = build_report(fsdp2_lr_spike.run.path).verdict
    assert verdict.bound == "numerics" and verdict.share_pct == pytest.approx(60), verdict.why  # steps 4..9 of 10


def test_fsdp2_rank_stuck_drawing_its_batch_is_named_with_its_stack_and_step_while_the_job_hangs(tmp_path):
    stuck_at = 4
    launch = run_fsdp2_example(tmp_path, how=script_launch, gpuprof_args=["--hang-timeout-s", HANG_TIMEOUT_S],
                               patches=[(f"{PATCHES}:random_batch_never_comes", {"on_rank": 1, "at_call": stuck_at})])
    for event in hang_events_while_it_hangs(launch, stuck_at):
        assert_names_rank_1_stuck(event, stuck_at, "blocking_randint",
                                  "x = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)")
        assert event["details"]["ranks"]["0"]["phase"] == "forward"  # in the root's all-gather


# ---------------------------------------------------------------------------------------------- DDP tutorial
@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("ddp-tutorial")
    return finished(run_ddp_tutorial(tmp_path, patches=recording(tmp_path)))


def test_ddp_tutorial_every_rank_records_each_batch_of_each_epoch_with_its_loss(ddp):
    assert f"Epoch {DDP_EPOCHS - 1} | Training snapshot saved at snapshot.pt" in ddp.stdout
    run = ddp.run
    assert run.meta["world_size"] == RANKS and run.meta["model"]["wrapper"] == "DistributedDataParallel"
    steps = run.steps
    assert by_rank(steps, "step") == {rank: list(range(DDP_STEPS)) for rank in range(RANKS)}
    losses = by_rank(steps, "loss")
    for rank, script_losses in recorded_losses(ddp).items():
        np.testing.assert_allclose(losses[rank], script_losses, atol=1e-7)
    # its loss, F.cross_entropy of one output column against float targets, is 0 whatever the weights: no gradient
    assert (steps["loss"] == 0).all() and (steps["grad_norm"] == 0).all()


def test_ddp_tutorial_verdict_for_a_tiny_cpu_job_is_its_loop_s_own_work_or_asks_for_a_trace(ddp):
    """A Linear(20, 1) on 128 rows is a step of milliseconds: the loop's own Python around it (`.to()`, zero_grad,
    DDP's bookkeeping) is 8-17 % of it, by the host's load, so the verdict is that host work or, below its 15 %, a
    call for a trace window to tell gloo's all-reduce apart; nothing slows its data, and no rank waits for another."""
    verdict = build_report(ddp.run.path).verdict
    assert verdict.bound in (None, "host") and verdict.subject is None, verdict.why
    assert verdict.missing == ("trace window" if verdict.bound is None else None), verdict.why


def test_ddp_tutorial_rank_slow_in_its_loader_is_the_one_the_verdict_says_the_others_wait_for(tmp_path):
    """Rank 1's batches take 0.3 s longer (one epoch of 4 batches of 256): rank 0 waits for it in DDP's all-reduce,
    inside its backward, and the verdict names rank 1 as the one every rank waits for."""
    delay_s = 0.3
    result = finished(run_ddp_tutorial(
        tmp_path, epochs=1, batch_size=256,
        patches=[("phase_patches:slow_dataloader_fetch", {"delay_s": delay_s, "on_rank": 1})]))
    steps = result.run.steps[result.run.steps["step"] > 0]
    slow, waiting = steps[steps["rank"] == 1], steps[steps["rank"] == 0]
    assert (slow["data_time_s"] >= delay_s).all() and (waiting["data_time_s"] < delay_s / 3).all()
    assert waiting["backward_time_s"].median() >= 0.8 * delay_s
    report = build_report(result.run.path)
    [data] = [finding for finding in report.findings if finding.rule == "dataloader-bound"]
    assert "most of it on rank 1" in data.title and data.evidence["data_share_pct_by_rank"][1] > 50
    verdict = report.verdict
    assert (verdict.bound, verdict.subject) == ("communication", "waiting for rank 1"), verdict.why


@pytest.fixture(scope="module")
def ddp_nan(tmp_path_factory):
    """Rank 1's loader fetches a batch-size probe at each epoch's start, then one batch a step: its fetch 4 is step 3's
    batch, with a NaN in its first input. DDP averages rank 1's NaN gradients into rank 0's: both go bad."""
    result = finished(run_ddp_tutorial(tmp_path_factory.mktemp("ddp-nan"),
                                       patches=[(f"{PATCHES}:nan_in_batch", {"at_fetch": 4, "on_rank": 1})]))
    return result


def test_ddp_tutorial_nan_in_a_batch_of_rank_1_is_blamed_at_its_step_pass_and_op(ddp_nan):
    finite = by_rank(ddp_nan.run.steps, "loss_finite")
    assert finite[1] == [True] * 3 + [False] * (DDP_STEPS - 3) and finite[0][:4] == [True] * 4
    [event] = [event for event in _parquet_events(ddp_nan, "nonfinite") if event["rank"] == 1]
    # the Linear is the whole model: its addmm runs in the model's own forward, before the loss (before, `loss`)
    assert (event["step"], event["phase"], event["op"], event["first"], event["shape"]) == (
        3, "forward", "aten::addmm", "nan", [DDP_BATCH, 1])
    verdict = build_report(ddp_nan.run.path).verdict
    steps_bad = DDP_STEPS - 3  # steps 3.. on rank 1, each counted once
    assert verdict.bound == "numerics" and verdict.share_pct == pytest.approx(100 * steps_bad / DDP_STEPS), verdict.why


def test_ddp_tutorial_nan_blame_names_the_script_s_line_of_the_model_call(ddp_nan):
    """A model that is all torch code (an nn.Linear) puts no frame of the script on the re-run's stack: the line
    recorded with the model call in training is the one to start at."""
    [event] = [event for event in _parquet_events(ddp_nan, "nonfinite") if event["rank"] == 1]
    assert "output = self.model(source)" in event["source"]


def test_ddp_tutorial_rank_stuck_in_its_loader_is_named_with_its_stack_and_step_while_the_job_hangs(tmp_path):
    """Rank 1's loader fetches a probe, then step 0's batch...: its fetch 4 is step 3's batch, which never comes."""
    stuck_at = 3
    launch = run_ddp_tutorial(tmp_path, how=script_launch, gpuprof_args=["--hang-timeout-s", HANG_TIMEOUT_S],
                              patches=[(f"{PATCHES}:stuck_in_data", {"on_rank": 1, "at_fetch": stuck_at + 1})])
    for event in hang_events_while_it_hangs(launch, stuck_at):
        assert_names_rank_1_stuck(event, stuck_at, "blocking_fetch", "for source, targets in self.train_data:")
        assert event["details"]["ranks"]["0"]["phase"] == "backward"  # in DDP's all-reduce


# ---------------------------------------------------------------------------------------------- helpers
def assert_names_rank_1_stuck(event: dict, step: int, function: str, script_line: str) -> None:
    """A `hang` event naming rank 1, behind at `step` in its data, in `function` under the script's `script_line`,
    rank 0 waiting for it at the same step, after the timeout `gpuprof run --hang-timeout-s` set."""
    details = event["details"]
    stuck, waiting = details["ranks"]["1"], details["ranks"]["0"]
    assert (details["behind_ranks"], details["waiting_ranks"]) == ([1], [0])
    assert (stuck["step"], stuck["phase"], waiting["step"]) == (step, "data", step) and function in stuck["where"]
    assert any(frame["code"] == script_line for frame in stuck["stack"])
    assert event["message"].startswith(f"rank 1 is at step {step} (data) in {function}")
    assert details["timeout_s"] == HANG_TIMEOUT_S and details["stalled_s"] >= HANG_TIMEOUT_S


def _parquet_events(result, kind: str) -> list[dict]:
    events = result.run.events
    rows = events[events["kind"] == kind]
    return [{**row["details"], "rank": row["rank"], "step": row["step"], "message": row["message"]}
            for row in rows.to_dict(orient="records")]


def hang_events_while_it_hangs(launch, step: int) -> list[dict]:
    """Both ranks' `hang` events at `step`, read while the job still hangs; then the job is stopped, and none of
    its processes is left."""
    log = launch.run_dir.with_suffix(".log")
    with log.open("w") as output:
        # torchrun's SIGTERM is not handled by a rank waiting inside gloo: it kills them after 5 s, not its 30
        env = {**launch.env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}
        job = subprocess.Popen(launch.command, cwd=launch.workdir, env=env, stdout=output,
                               stderr=subprocess.STDOUT, start_new_session=True)
        processes = []
        try:
            events = wait_for(lambda: hang_events_of_every_rank(launch.run_dir, step), job, bound_s=HANG_EVENT_BOUND_S)
            assert job.poll() is None, "the job should still hang"
            with contextlib.suppress(psutil.NoSuchProcess):
                processes = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
        finally:
            stop(job)
    assert events, log.read_text()[-3000:]
    assert processes and not [process for process in processes if _alive(process)]
    return events


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
