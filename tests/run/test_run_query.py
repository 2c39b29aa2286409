"""The run layer's out-of-core engine (gpuprof/run/query.py) against pandas over the same rows:
every aggregate the summary, the rules and the dashboard take from it, on many-rank runs,
mixed Parquet / JSON lines ranks, and damaged or missing rank folders."""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest

from gpuprof.analysis.run.summary import OWN_WORK_PHASES, detect_warmup, slowest_ranks, step_times, summarize
from gpuprof.diagnoses import diagnose
from gpuprof.diagnoses.context import DEVICE_FIGURES, THERMAL_OR_POWER
from gpuprof.run import query as q
from gpuprof.run import schema
from gpuprof.run.reader import load_run
from gpuprof.run.writer import RunWriter


def test_summary_from_the_engine_equals_pandas_over_every_row(many_ranks):
    run = load_run(many_ranks)
    summary = summarize(run, DEVICE_FIGURES)
    steps = load_run(many_ranks).steps  # the pandas reader: every row of every rank
    times = step_times(steps)
    pd.testing.assert_series_equal(summary.step_times, times, check_names=False, check_index_type=False)
    warmup = detect_warmup(times)
    measured = steps[steps["step"] >= warmup.first_measured_step]
    assert summary.tokens_per_s == pytest.approx(measured["tokens"].sum() / times[times.index >= warmup.first_measured_step].sum())
    total_s = measured["step_time_s"].sum()
    for phase in schema.SPLIT_PHASES:
        assert summary.phase_split_pct[phase] == pytest.approx(100 * measured[f"{phase}_time_s"].sum() / total_s)
    grouped = measured.groupby("rank")
    per_rank = summary.per_rank.set_index("rank")
    np.testing.assert_allclose(per_rank["step_time_p90_s"], grouped["step_time_s"].quantile(0.9))
    np.testing.assert_allclose(per_rank["forward_time_p50_s"], grouped["forward_time_s"].median())
    own_work = measured[[f"{p}_time_s" for p in OWN_WORK_PHASES]].sum(axis=1).groupby(measured["rank"]).median()
    np.testing.assert_allclose(per_rank["own_work_p50_s"], own_work)
    np.testing.assert_allclose(per_rank["tokens_per_s"], grouped["tokens"].sum() / grouped["step_time_s"].sum())
    assert summary.health["loss_first"] == steps["loss"].iloc[0] and summary.health["loss_last"] == steps["loss"].iloc[-1]
    assert summary.health["grad_norm_p50"] == pytest.approx(steps["grad_norm"].median())
    samples = run.system
    start_s = steps.loc[steps["step"] == warmup.first_measured_step - 1, "time_unix_s"].max()
    assert summary.gpu_util_mean_pct == pytest.approx(samples.loc[samples["time_unix_s"] >= start_s, "gpu_util_pct"].mean())
    device = samples[samples["device_index"].notna() & (samples["time_unix_s"] >= start_s)]
    throttled = device["throttle_reasons"].map(
        lambda reasons: any(r in str(e).lower() for e in reasons for r in THERMAL_OR_POWER))
    assert 0 < throttled.sum() < len(device), "the synthetic run has throttled and unthrottled samples"
    assert summary.device_figures == pytest.approx({
        "samples": len(device), "throttled_samples": throttled.sum(), "gpu_util_mean_pct": device["gpu_util_pct"].mean(),
        "gpu_util_samples": device["gpu_util_pct"].count()})
    assert summary.missing_ranks == []


def test_the_straggler_is_found_and_ranked_first(many_ranks):
    summary = summarize(load_run(many_ranks))
    assert slowest_ranks(summary.per_rank)["rank"].iloc[0] == 4
    straggler = [f for f in diagnose(load_run(many_ranks)) if f.rule == "rank-straggler"]
    assert straggler and straggler[0].evidence["slow_rank"] == 4


def test_per_rank_quantiles_in_small_rank_batches_and_estimates_match_exact(many_ranks, monkeypatch):
    exact = summarize(load_run(many_ranks)).per_rank
    monkeypatch.setattr(q, "RANK_BATCH_VALUES", 1000)  # 9 quantiles of 60 rows: about two ranks per batch
    pd.testing.assert_frame_equal(summarize(load_run(many_ranks)).per_rank, exact)
    monkeypatch.setattr(q, "EXACT_QUANTILE_MAX_ROWS", 0)  # every quantile an estimate from a sample
    monkeypatch.setattr(q, "ESTIMATE_SAMPLE_ROWS", 300)  # of 300 of the 720 rows
    query = load_run(many_ranks).query
    estimate = query.aggregate("steps", {"p50": q.quantile("step_time_s", 0.5)})["p50"].iloc[0]
    assert estimate == pytest.approx(load_run(many_ranks).steps["step_time_s"].median(), rel=0.01)


def test_rank_x_step_grid_is_downsampled_and_keeps_the_totals(many_ranks):
    query = load_run(many_ranks).query
    steps = load_run(many_ranks).steps
    grid = query.grid("steps", {"t": ("step_time_s", None), "fwd": ("forward_time_s", "step_time_s")},
                      max_ranks=5, max_steps=7)
    assert grid.groupby(["rank_first"]).ngroups <= 5 and grid.groupby("step_first").ngroups <= 7
    first = grid.iloc[0]
    cell = steps[steps["rank"].between(first["rank_first"], first["rank_last"])
                 & steps["step"].between(first["step_first"], first["step_last"])]
    assert first["t"] == pytest.approx(cell["step_time_s"].mean())
    assert first["fwd"] == pytest.approx(cell["forward_time_s"].sum() / cell["step_time_s"].sum())


def test_a_live_rank_in_json_lines_joins_the_compacted_ones(many_ranks, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(many_ranks, run_dir)
    shutil.rmtree(run_dir / "rank-11")
    writer = RunWriter(run_dir, rank=11)  # still running: JSON lines, flags never written (all null)
    writer.write("steps", [{"step": s, "rank": 11, "step_time_s": 9.0, "loss": float("nan")} for s in range(60)])
    writer.flush()  # what a live run has handed to the OS
    query = load_run(run_dir).query
    per_rank = query.aggregate("steps", {"n": q.count(), "max_s": q.maximum("step_time_s"),
                                         "bad_loss": q.count_where(q.is_false("loss_finite"))}, by="rank")
    assert per_rank["rank"].tolist() == list(range(12)) and per_rank["n"].tolist() == [60] * 12
    assert per_rank.set_index("rank").loc[11, "max_s"] == 9.0 and per_rank["bad_loss"].sum() == 0
    assert query.rank_frame("steps", 11)["loss"].isna().all()  # NaN reads as null
    writer.close()


def test_a_torn_or_missing_rank_is_reported_and_the_rest_analysed(many_ranks, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(many_ranks, run_dir)
    torn = run_dir / "rank-3" / "steps.parquet"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    shutil.rmtree(run_dir / "rank-7")
    with pytest.warns(UserWarning, match="rank-3/steps.parquet: unreadable"):
        summary = summarize(load_run(run_dir))
    assert summary.missing_ranks == [3, 7]
    assert sorted(summary.per_rank["rank"]) == [r for r in range(12) if r not in (3, 7)]
    assert summary.n_steps == 60


def test_events_and_one_rank_read_as_the_reader_gives_them(many_ranks):
    run = load_run(many_ranks)
    events = run.query.frame("events")
    reader = load_run(many_ranks).events
    assert len(events) == len(reader) and isinstance(events["details"].iloc[0], dict)
    assert events["details"].tolist() == reader["details"].tolist()
    system = run.query.rank_frame("system", 2)
    assert (system["rank"] == 2).all() and isinstance(system["throttle_reasons"].iloc[0], list)
    counts = run.query.list_value_counts("system", "throttle_reasons")
    expected = load_run(many_ranks).system["throttle_reasons"].explode().dropna().value_counts()
    assert counts.to_dict() == expected.to_dict()


def test_aggregates_within_their_own_rows_share_one_query(tmp_path):
    writer = RunWriter(tmp_path / "run", rank=0)
    writer.write_run_meta({"format": schema.FORMAT, "format_version": schema.FORMAT_VERSION, "name": "run",
                           "world_size": 1})
    for i in range(40):  # every third sample a host-only row (no device), every fourth one power-capped
        writer.write("system", [{"time_unix_s": 1000.0 + i, "rank": 0, "device_index": None if i % 3 == 0 else 0,
                                 "gpu_util_pct": float(i), "throttle_reasons": ["sw_power_cap"] if i % 4 == 0 else []}])
    writer.close()
    samples = load_run(tmp_path / "run").system
    capped = q.list_contains_any("throttle_reasons", ("power",))
    answer = load_run(tmp_path / "run").query.aggregate("system", {
        "all_mean": q.mean("gpu_util_pct"),
        "device_rows": q.within(q.count(), q.device_rows()),
        "device_capped": q.within(q.count_where(capped), q.device_rows()),
        "device_capped_p50": q.within(q.quantile("gpu_util_pct", 0.5, where=capped), q.device_rows()),
    }).iloc[0]
    device = samples[samples["device_index"].notna()]
    device_capped = device[device["throttle_reasons"].map(len) > 0]
    assert answer["all_mean"] == pytest.approx(samples["gpu_util_pct"].mean())
    assert answer["device_rows"] == len(device) and answer["device_capped"] == len(device_capped)
    assert answer["device_capped_p50"] == pytest.approx(device_capped["gpu_util_pct"].median())
    with pytest.raises(ValueError, match="not one aggregate call"):
        q.within(q.weighted_mean("gpu_util_pct", "gpu_util_pct"), q.device_rows())
