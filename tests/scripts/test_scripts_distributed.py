"""The Accelerate CLM example, unmodified, under torchrun on two ranks (Accelerate's multi-CPU DDP over gloo),
`python -m torch.distributed.run ... -m gpuprof run` as a user would launch it: one run directory, every
rank's steps, and the run's figures counted per step, not per rank."""

from __future__ import annotations

import re

import pytest
from script_corpus import CLM_LINES, finished, run_accelerate_clm, run_lightning_transformer

from gpuprof.report import build_report

pytestmark = pytest.mark.slow  # real scripts in child processes

RANKS = 2
STEPS = 3 * CLM_LINES // 2 // RANKS  # 3 epochs, 2 lines a batch, the lines split between the ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return finished(run_accelerate_clm(tmp_path_factory.mktemp("accelerate-ddp"), ranks=RANKS))


def test_every_rank_records_each_step_under_ddp(two_ranks):
    run = two_ranks.run
    assert run.meta["world_size"] == RANKS and run.meta["model"]["wrapper"] == "DistributedDataParallel"
    steps = run.steps
    assert steps.groupby("rank")["step"].apply(list).to_dict() == {rank: list(range(STEPS)) for rank in range(RANKS)}
    assert steps["loss_finite"].all() and steps["grad_norm"].notna().all()


def test_its_epoch_end_evaluations_are_counted_once_each_not_once_per_rank(two_ranks):
    report = build_report(two_ranks.run.path)
    assert report.summary.evaluation["steps_with_eval"] == 2  # after epochs 1 and 2 (the 3rd ends the run)
    assert "Evaluation inside the loop is left out of the step's bound: 2 time(s)" in report.verdict.why
    assert sorted(report.summary.per_rank["rank"]) == list(range(RANKS))


def test_a_rank_whose_loader_is_slower_is_the_one_the_verdict_says_the_others_wait_for(tmp_path):
    """Rank 1's batches take 0.15 s longer. The example gathers the batch's token count before its forward, so
    rank 0 waits for rank 1 there, at its second collective of the step (the first: the loss gathered for
    logging after the update), in `other`, not in DDP's all-reduce: rank 1 is named by its arrivals, with its
    data phase, and bounds the verdict (before, the verdict was host work, 49 %)."""
    delay_s = 0.15
    result = finished(run_accelerate_clm(
        tmp_path, ranks=RANKS, patches=[("phase_patches:slow_dataloader_fetch", {"delay_s": delay_s, "on_rank": 1})]))
    report = build_report(result.run.path)
    [late] = [finding for finding in report.findings if finding.rule == "late-arrival"]
    evidence = late.evidence
    assert (late.severity, evidence["last_rank"], evidence["collective"], evidence["slower_phase"]) == ("warning", 1, 1, "data")
    assert evidence["slower_phase_excess_s"] >= delay_s * 0.9 and evidence["last_share_pct"] > 50
    [data] = [finding for finding in report.findings if finding.rule == "dataloader-bound"]
    assert "most of it on rank 1" in data.title and data.evidence["data_share_pct_by_rank"][1] > 50
    verdict = report.verdict
    assert (verdict.bound, verdict.subject) == ("communication", "waiting for rank 1"), verdict.why
    # led by the host's load where this loaded machine gave the ranks too little of their cores
    assert re.match(r"(These timings measure the host's other jobs too: .*?\. )?Rank 1 arrives last at the step's "
                    r"collective 2 in ", verdict.why), verdict.why
    # rank 0's samples in its `other`, where it waits: the gather before the forward
    assert evidence["others_wait_at"][0] == "training_function (gradient_accumulation_for_autoregressive_models.py:231)"
    assert "; the others wait for it at training_function (gradient_accumulation_for_autoregressive_models.py:231)" in verdict.why


def test_under_lightnings_ddp_strategy_a_rank_whose_loader_is_slower_is_named(tmp_path):
    """Lightning's example under torchrun with its DDP strategy on two processes: the DDP module the strategy
    wraps gets gpuprof's arrivals through the callback, so rank 1, whose batches take 0.3 s longer, is the one
    the verdict says the others wait for (at DDP's all-reduce, inside their backward)."""
    delay_s = 0.3
    result = finished(run_lightning_transformer(
        tmp_path, max_steps=8, ranks=RANKS, devices=RANKS,
        patches=[("phase_patches:slow_dataloader_fetch", {"delay_s": delay_s, "on_rank": 1}),
                 ("corpus_patches:loader_batch_size", {"batch_size": 2})]))
    report = build_report(result.run.path)
    assert report.meta["process_group"] and report.meta["distributed"]["arrivals"]
    [late] = [finding for finding in report.findings if finding.rule == "late-arrival"]
    assert (late.evidence["last_rank"], late.evidence["slower_phase"]) == (1, "data")
    assert (report.verdict.bound, report.verdict.subject) == ("communication", "waiting for rank 1"), report.verdict.why


def test_lightning_under_torchrun_without_devices_trains_each_rank_alone_and_says_so(tmp_path):
    """Without `devices=2` Lightning runs each torchrun process on its own: no process group, so no rank waits
    for another. gpuprof says so, names no straggler, and asks for no trace window to measure communication."""
    result = finished(run_lightning_transformer(
        tmp_path, max_steps=6, ranks=RANKS,
        patches=[("phase_patches:slow_dataloader_fetch", {"delay_s": 0.3, "on_rank": 1})]))
    report = build_report(result.run.path)
    assert report.meta["process_group"] is False and sorted(report.run.steps["rank"].unique()) == [0, 1]
    rules = {finding.rule for finding in report.findings}
    assert "independent-ranks" in rules and not rules & {"rank-straggler", "late-arrival"}
    assert report.verdict.missing is None and report.verdict.subject != "waiting for rank 1"
