"""The Distributed and Run pages on a 64-rank run: heatmaps downsampled by the run's query
engine, the straggler called out, one rank's detail read when it is picked."""

from __future__ import annotations

import numpy as np
from dashboard_helpers import figures, texts, trace_named, values

from gpuprof.analysis.run.summary import summarize
from gpuprof.dashboard.charts import HEATMAP_MAX_STEPS
from gpuprof.run.reader import load_run

STRAGGLER = 21


def heatmaps(app) -> list[dict]:
    return [trace for figure in figures(app) for trace in figure["data"] if trace["type"] == "heatmap"]


def test_distributed_page_shows_every_rank_and_calls_out_the_straggler(many_ranks_root, open_page):
    app = open_page(many_ranks_root, "Distributed", ("wide",))
    assert not app.error
    slowest = app.dataframe[0].value
    assert slowest["rank"].iloc[0] == STRAGGLER and slowest["vs_median_pct"].iloc[0] > 5
    assert any(f"Rank {STRAGGLER} is a straggler" in label for label in (e.label for e in app.expander))
    [heatmap] = heatmaps(app)
    assert len(heatmap["y"]) == 64 and len(heatmap["x"]) <= HEATMAP_MAX_STEPS
    z = values(heatmap, "z").astype(float)
    assert int(np.nanargmax(np.nanmean(z, axis=1))) == STRAGGLER  # the bright row
    steps = load_run(many_ranks_root / "wide").steps
    np.testing.assert_allclose(np.nanmean(z), steps["step_time_s"].mean() * 1e3, rtol=1e-6)


def test_the_rank_picker_reads_the_picked_rank_and_the_phase_heatmap_is_a_share(many_ranks_root, open_page):
    app = open_page(many_ranks_root, "Distributed", ("wide",))
    assert app.selectbox(key="dist_rank").value == STRAGGLER
    app.selectbox(key="dist_rank").set_value(5)
    app.selectbox(key="rank_heatmap").set_value("forward share")
    app.run()
    assert not app.exception and not app.error
    steps = load_run(many_ranks_root / "wide").steps
    rank5 = steps[steps["rank"] == 5]
    np.testing.assert_allclose(values(trace_named(app, "rank 5"), "y"), rank5["step_time_s"] * 1e3)
    [heatmap] = heatmaps(app)
    z = values(heatmap, "z").astype(float)
    assert 0 < np.nanmin(z) and np.nanmax(z) <= 100
    forward_share = 100 * rank5["forward_time_s"].sum() / rank5["step_time_s"].sum()
    assert abs(np.nanmean(z[5]) - forward_share) < 1  # cells of 1 rank x 1 step: shares of that rank's steps


def test_run_page_of_a_many_rank_run_draws_the_picked_rank(many_ranks_root, open_page):
    app = open_page(many_ranks_root, "Run", ("wide",))
    summary = summarize(load_run(many_ranks_root / "wide"))
    metrics = {metric.label: metric.value for metric in app.metric}
    assert metrics["Step time p50"] == f"{summary.step_time_p50_s * 1e3:,.1f} ms"
    assert "64 ranks" not in " ".join(texts(app.warning))  # nothing missing
    app.selectbox(key="run_rank").set_value(63)
    app.run()
    steps = load_run(many_ranks_root / "wide").steps
    np.testing.assert_allclose(values(trace_named(app, "tokens/s"), "y"), steps[steps["rank"] == 63]["tokens_per_s"])
