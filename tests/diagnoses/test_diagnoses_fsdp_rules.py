"""The FSDP rules on real FSDP2 runs of the reference workload (2 gloo ranks), a DDP run, and a GPU trace."""

from __future__ import annotations

import gzip
import json

import pytest

from gpuprof.diagnoses import diagnose
from gpuprof.diagnoses.rules import fsdp

FSDP_RULES = ("fsdp-exposed-collectives", "fsdp-prefetch-not-overlapped", "fsdp-memory-vs-ddp",
              "fsdp-reshard-after-forward")


def fired(run, rule_id):
    return [finding for finding in diagnose(run, strict=True) if finding.rule == rule_id]


@pytest.mark.slow
def test_exposed_collectives_and_memory_on_a_recorded_fsdp_run(recorded_runs):
    run = recorded_runs["fsdp"]
    table = fsdp.collective_table(_ctx(run))
    # both kinds seen every step: forward and backward all-gathers, the gradient reduce-scatters
    assert (table["all_gather_count"] > table["reduce_scatter_count"]).all() and (table["reduce_scatter_count"] > 0).all()
    findings = fired(run, "fsdp-exposed-collectives")
    worst_pct = table["exposed_pct"].max()
    assert len(findings) == (worst_pct >= fsdp.EXPOSED_WARNING_PCT)  # two gloo ranks on 2 cores: usually fires
    for exposed in findings:
        evidence = exposed.evidence
        assert evidence["exposed_pct"] == pytest.approx(worst_pct) and exposed.est_gain_pct == evidence["exposed_pct"]
        exposed_us = evidence["all_gather_exposed_us_per_step"] + evidence["reduce_scatter_exposed_us_per_step"]
        assert evidence["exposed_pct"] == pytest.approx(100 * exposed_us / evidence["step_time_us"])
    (memory,) = fired(run, "fsdp-memory-vs-ddp")  # a tiny model: DDP fits easily
    sharding = run.meta["distributed"]["sharding"]
    assert memory.evidence["ddp_peak_bytes_per_rank_est"] == pytest.approx(
        memory.evidence["peak_bytes_per_rank"] - sharding["model_state_bytes_per_rank"] + sharding["model_state_bytes"])
    assert memory.severity == ("warning" if findings else "info")  # warning: the collectives it pays are exposed
    assert not fired(run, "fsdp-prefetch-not-overlapped")  # GPU streams only


@pytest.mark.slow
def test_reshard_after_forward_trade_off(recorded_runs):
    resharded, kept = recorded_runs["fsdp"], recorded_runs["fsdp_no_reshard"]
    # read by capture from the FSDP2 units themselves, not from the workload's config
    assert [fsdp.sharding(_ctx(run))["reshard_after_forward"] for run in (resharded, kept)] == [True, False]
    table = fsdp.collective_table(_ctx(resharded))
    worst = table.loc[table["exposed_pct"].idxmax()]
    gather_pct = 100 * worst["all_gather_exposed_us"] / worst["step_time_us"]
    findings = fired(resharded, "fsdp-reshard-after-forward")
    assert len(findings) == (gather_pct >= fsdp.RESHARD_EXPOSED_PCT)
    for finding in findings:
        assert finding.evidence["peak_pct_of_memory"] < fsdp.RESHARD_HEADROOM_PCT
        assert finding.evidence["all_gather_exposed_pct"] == pytest.approx(gather_pct)
    assert not fired(kept, "fsdp-reshard-after-forward")  # memory is plentiful: keeping them gathered is right
    kept_table = fsdp.collective_table(_ctx(kept))
    assert kept_table["all_gather_count"].max() < table["all_gather_count"].min()  # no re-gathering in backward


def test_fsdp_rules_stay_silent_on_ddp(recorded_runs):
    run = recorded_runs["ddp"]
    assert not [f for f in diagnose(run, strict=True) if f.rule in FSDP_RULES]


def test_prefetch_not_overlapped_on_a_gpu_trace(write_gpu_run, tmp_path):
    def trace(overlapped: bool):
        """One step: compute kernels on stream 7; all-gathers on stream 20 behind them or between them."""
        events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 10_000}]
        for unit in range(4):
            start = unit * 2_500
            compute_start = start if overlapped else start + 1_000
            gather_start = start + 200 if overlapped else start
            events.append({"ph": "X", "cat": "kernel", "name": "ampere_bf16_s16816gemm", "pid": 0, "tid": 7,
                           "ts": compute_start, "dur": 1_400, "args": {"stream": 7, "device": 0, "correlation": unit}})
            events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "pid": 0, "tid": 20,
                           "ts": gather_start, "dur": 900, "args": {"stream": 20, "device": 0, "correlation": 100 + unit}})
        path = tmp_path / f"rank-0-{overlapped}.pt.trace.json.gz"
        with gzip.open(path, "wt") as handle:
            json.dump({"traceEvents": events, "distributedInfo": {"rank": 0, "world_size": 1}}, handle)
        return path

    sharded = {"distributed": {"backend": "nccl", "world_size": 1, "sharding": {"parallel": "fsdp"}}}
    serial = write_gpu_run(meta=sharded, traces=[trace(overlapped=False)])
    (finding,) = fired(serial, "fsdp-prefetch-not-overlapped")
    assert finding.evidence["all_gather_overlap_pct"] < fsdp.PREFETCH_OVERLAP_PCT
    assert not fired(write_gpu_run(meta=sharded, traces=[trace(overlapped=True)]), "fsdp-prefetch-not-overlapped")


def _ctx(run):
    from gpuprof.diagnoses.context import RunContext

    return RunContext.of(run)
