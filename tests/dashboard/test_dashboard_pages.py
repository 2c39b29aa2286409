"""Every dashboard page on the sample runs, through Streamlit's AppTest: the findings, the numbers
and the chart data must be those of the analysis layer for the same run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from dashboard_helpers import SHARED_TRACES, column_config, empty_cells, texts, trace_named, values

from gpuprof.analysis.run import summarize
from gpuprof.analysis.trace import TraceAnalysis
from gpuprof.dashboard.views.common import escape_markdown
from gpuprof.diagnoses import diagnose
from gpuprof.report import build_report, compare
from gpuprof.report.comparison import figure_rows
from gpuprof.run.reader import load_run
from gpuprof.report.tuning import TRIAL_HEADERS, trial_label
from gpuprof.run.schema import NUMERICS_DIR, EventKind
from gpuprof.units import bytes_text
from gpuprof.run.tune_result import read_result


def test_runs_page_lists_every_run_with_its_figures(sample_root, open_page):
    app = open_page(sample_root, "Runs")
    table = app.dataframe[0].value.set_index("run")
    for name in ("baseline", "optimized", "nan", "slow-data", "ddp-2rank"):
        run = load_run(sample_root / name)
        summary = summarize(run)
        row = table.loc[name]
        assert "cpu · tiny" in row["recorded"] and "finished" not in row["recorded"]  # it goes without saying
        assert row["tokens/s"] == pytest.approx(summary.tokens_per_s)
        assert row["critical"] == sum(f.severity == "critical" for f in diagnose(run))
        assert row["verdict"] == build_report(sample_root / name).verdict.headline
    assert "2 × cpu" in table.loc["ddp-2rank", "recorded"]  # two ranks
    assert table.loc["baseline", "MFU %"] == "n/a" and not empty_cells(app)  # a CPU run has no MFU
    assert "Recorded on: " in " ".join(texts(app.caption))


def test_run_page_shows_diagnoses_first_then_the_timelines(sample_root, open_page):
    app = open_page(sample_root, "Run", ("slow-data",))
    run = load_run(sample_root / "slow-data")
    findings = diagnose(run)
    labels = [expander.label for expander in app.expander]
    assert any(f.rule.startswith("dataloader") for f in findings), [f.rule for f in findings]
    assert [next(i for i, label in enumerate(labels) if escape_markdown(f.title) in label) for f in findings] == list(
        range(len(findings))
    )
    summary = summarize(run)
    metrics = {metric.label: metric.value for metric in app.metric}
    assert metrics["Tokens/s"] == f"{summary.tokens_per_s:,.0f}"
    assert metrics["Step time p50"] == f"{summary.step_time_p50_s * 1e3:,.1f} ms"
    # a CPU run has no allocator peak: the headline is the process's peak RSS
    peak_rss_bytes = run.steps["mem_rss_bytes"].max()
    assert metrics["Peak memory"] == bytes_text(peak_rss_bytes) and peak_rss_bytes > 0
    steps = run.steps[run.steps["rank"] == 0]
    throughput = trace_named(app, "tokens/s")
    np.testing.assert_allclose(values(throughput, "y"), steps["tokens_per_s"].dropna())
    data_phase = trace_named(app, "data")
    np.testing.assert_allclose(values(data_phase, "y"), steps["data_time_s"] * 1e3)
    loss = trace_named(app, "loss")
    np.testing.assert_allclose(values(loss, "y"), steps["loss"])
    subheaders = texts(app.subheader)
    assert subheaders.index("Diagnoses") < subheaders.index("Throughput and MFU")
    verdict = build_report(sample_root / "slow-data").verdict
    assert verdict.bound == "input" and escape_markdown(verdict.headline) in texts(app.info)[0]
    assert not app.error


def test_numerics_page_names_where_the_nan_appeared(sample_root, open_page):
    app = open_page(sample_root, "Numerics", ("nan",))
    run = load_run(sample_root / "nan")
    findings = [f for f in diagnose(run) if f.rule == "nonfinite-values"]
    assert findings and any(escape_markdown(findings[0].title) in expander.label for expander in app.expander)
    event = run.events[run.events["kind"] == EventKind.NONFINITE].iloc[0]
    shown = next(table.value["value"].to_dict() for table in app.table if "phase" in table.value.index)
    first_bad_step = int(run.steps.loc[~run.steps["loss_finite"].astype(bool), "step"].min())
    assert int(shown["step"]) == int(event["step"]) == first_bad_step
    for field in ("phase", "module", "first", "dtype"):
        assert shown[field] == str(event["details"][field])
    commands = [code.value for code in app.code if code.value.startswith("gpuprof replay ")]
    bundle = sample_root / "nan" / NUMERICS_DIR / Path(event["details"]["bundle"]).name
    assert commands == ([f"gpuprof replay {bundle}"] if bundle.is_file() else [])  # no command for a bundle not shipped
    assert f"Phase {event['details']['phase']}: " in " ".join(texts(app.caption))  # the phase explained
    chain = app.dataframe[0].value
    assert str(chain["time"].dtype).startswith("datetime64") and not empty_cells(app)
    assert set(chain["step"]) == {"n/a"}  # an event of the run, not of a step: n/a
    assert not chain["message"].str.contains(event["message"], regex=False).any()  # the blame is said once, above
    assert not app.error


def test_trace_page_analyses_the_runs_trace_window(traced_root, open_page):
    app = open_page(traced_root, "Trace", ("traced",))
    run = load_run(traced_root / "traced")
    assert len(run.trace_files) == 1  # one window, one rank
    overview, columns = app.dataframe[0].value, column_config(app.dataframe[0])
    assert overview["file"].tolist() == [run.trace_files[0].name]
    assert columns["file"]["help"] == f"Full path: {run.trace_files[0]}"
    analysis = TraceAnalysis(run.trace_files)
    assert overview["span_ms"].tolist() == (analysis.overview()["span_us"] / 1000).tolist()
    assert columns["span_ms"] == {"label": "span ms", "type_config": {"type": "number", "format": "%.2f"}}
    # A CPU-only run: one line names the empty device tables, and no table is drawn empty.
    assert all(len(frame.value) for frame in app.dataframe)
    [empty] = [text for text in texts(app.info) if "no device activity" in text]
    assert "no GPU kernels, so the" in empty and "tensor-core" in empty and "launch" in empty
    assert "Computation/communication overlap" not in texts(app.subheader)
    # The window's two steps (2-3): the last is left out, and the page says so.
    assert overview["profiler_steps"].tolist() == [1]
    assert any("last profiler step is left out" in text and "rank 0: 1" in text for text in texts(app.caption))
    spread = next(frame for frame in app.dataframe if "step_time_p50_ms" in frame.value.columns)
    assert "step_time_std_us" not in spread.value.columns  # a one-step window has no spread (was "None")
    assert column_config(spread)["step_time_p50_ms"]["label"] == "p50 ms"
    steps = analysis.step_breakdown()
    assert len(steps) >= 1
    np.testing.assert_allclose(values(trace_named(app, "cpu_exec"), "y"), steps["cpu_exec_us"] / 1e3)
    assert [d.proto.label for d in app.get("download_button")] == [
        f"Download {run.trace_files[0].name} (open in ui.perfetto.dev)"]
    assert not app.error


def test_sample_runs_have_a_trace_window_per_rank(sample_root):
    train_help = subprocess.run([sys.executable, "-m", "gpuprof", "train", "--help"], capture_output=True,
                                text=True, timeout=300).stdout
    if "--trace-steps" not in train_help:
        pytest.skip("gpuprof train has no --trace-steps yet, so scripts/make_sample_runs.py records no trace window")
    for name in ("baseline", "optimized", "nan", "slow-data", "ddp-2rank"):
        run = load_run(sample_root / name)
        assert len(run.trace_files) == run.meta["world_size"], name


def test_distributed_page_compares_the_ranks(sample_root, open_page):
    app = open_page(sample_root, "Distributed", ("ddp-2rank",))
    slowest, per_rank = (frame.value for frame in app.dataframe[:2])
    summary = summarize(load_run(sample_root / "ddp-2rank"))
    assert per_rank["rank"].tolist() == [0, 1]
    np.testing.assert_allclose(per_rank["step_time_p50_ms"], summary.per_rank["step_time_p50_s"] * 1e3)
    assert column_config(app.dataframe[1])["step_time_p50_ms"] == {
        "label": "step time p50 ms", "type_config": {"type": "number", "format": "%.2f"}}
    assert column_config(app.dataframe[0])["vs_median_pct"]["type_config"]["format"] == "%.1f"  # not 75.5147
    assert per_rank["mfu"].tolist() == ["n/a", "n/a"]  # a CPU run has no peak FLOP/s
    # the sample's rank 1 was slowed down: it heads the slowest ranks and is the rank shown first
    assert slowest["rank"].tolist() == [1, 0] and app.selectbox(key="dist_rank").value == 1
    # DDP makes every rank's step time alike: the heatmap says so, and where a straggler shows instead
    assert any("a step takes about as long on every rank" in text for text in texts(app.caption))
    # a gloo run has no device kernels: the overlap table says why it is empty instead of showing headers
    assert any(text.startswith("Computation/communication overlap: empty, as the trace has no device activity")
               for text in texts(app.info))
    assert not any("comm_comp_overlap_pct" in frame.value.columns for frame in app.dataframe)
    steps = load_run(sample_root / "ddp-2rank").steps
    np.testing.assert_allclose(values(trace_named(app, "rank 1"), "y"), steps[steps["rank"] == 1]["step_time_s"] * 1e3)
    assert not app.error


def test_compare_page_shows_speedup_and_findings_delta(sample_root, open_page):
    app = open_page(sample_root, "Compare", ("baseline", "optimized"))
    comparison = compare(build_report(sample_root / "baseline"), build_report(sample_root / "optimized"))
    metrics = {metric.label: metric.value for metric in app.metric}
    speedup = comparison.a.summary.step_time_mean_s / comparison.b.summary.step_time_mean_s
    assert metrics["Speedup (B over A, mean step time)"] == f"{speedup:.2f}×"
    assert comparison.conclusion in " ".join(texts(app.success))
    # every figure as people read it: intervals and units, no raw column names, no None
    table = app.dataframe[0].value
    assert list(table.columns) == ["Figure", "A", "B", "B vs A", "Call"]
    assert table["Figure"].tolist() == [figure.name for figure in comparison.figures]
    shown = " ".join(table.astype(str).to_numpy().ravel())
    assert "None" not in shown and "nan" not in shown and "_" not in shown
    assert "ms [" in table.set_index("Figure").loc["Step time, mean", "A"]
    assert "precision: A fp32, B bf16" in " ".join(texts(app.markdown))
    assert len(values(trace_named(app, "A: baseline"), "x")) == comparison.a_side.n_steps  # the step-time histogram
    labels = " ".join(expander.label for expander in app.expander)
    for finding in comparison.appeared + comparison.disappeared:
        assert escape_markdown(finding.title) in labels
    assert len(trace_named(app, "A baseline")["y"]) > 0 and trace_named(app, "B optimized")
    assert not app.error


def test_gradient_heatmap_marks_the_nan_steps_layers_and_labels_every_layer(sample_root):
    from gpuprof.dashboard.charts import run_panels

    run = load_run(sample_root / "nan")
    [heatmap] = [panel.figure for panel in run_panels(run, 0) if panel.title.startswith("Gradient norm per layer")]
    layers = run.query.rank_frame("layers", 0)
    assert len(heatmap.layout.yaxis.tickvals) == layers["layer"].nunique()  # a label on every layer
    [marked] = [trace for trace in heatmap.data if trace.name == "non-finite"]
    bad_steps = set(run.steps.loc[run.steps["grad_norm_finite"].eq(False), "step"].astype(str))
    assert set(marked.x) and set(marked.x) <= bad_steps and heatmap.layout.xaxis.type == "category"


def test_compare_page_holds_the_last_of_several_runs_against_a_baseline_of_the_others(sample_root, open_page):
    app = open_page(sample_root, "Compare", ("baseline", "slow-data", "optimized"))
    reports = [build_report(sample_root / name) for name in ("baseline", "slow-data", "optimized")]
    pooled = compare(reports[:2], reports[2])
    assert pooled.conclusion in " ".join(texts(app.success) + texts(app.warning))
    assert f"A: {escape_markdown(pooled.a_side.label)}" in texts(app.caption)
    assert app.dataframe[0].value["A"].tolist() == [row["A"] for row in figure_rows(pooled)]
    median = compare(reports[:2], reports[2], pooling="median")
    app.radio(key="compare_pooling").set_value("median").run()
    assert median.conclusion in " ".join(texts(app.success) + texts(app.warning))
    assert app.dataframe[0].value["A"].tolist() == [row["A"] for row in figure_rows(median)]
    assert not app.error


def test_tune_page_shows_each_trial_measured_beside_its_estimate_and_links_its_run(sample_root, open_page):
    app = open_page(sample_root, "Tune")
    result = read_result(sample_root / "tune" / "tune.json")
    table = app.dataframe[0].value
    assert list(table.columns) == list(TRIAL_HEADERS)
    assert table["trial"].tolist() == [trial_label(trial) for trial in result["trials"]]
    assert not " ".join(table.astype(str).to_numpy().ravel()).count("None")
    measured = [trial for trial in result["trials"] if trial["speedup"]]
    np.testing.assert_allclose(values(trace_named(app, "measured (95 % CI)"), "x"),
                               [trial["speedup"]["point"] for trial in measured])
    assert result["conclusion"] in " ".join(texts(app.success) + texts(app.info))
    if result["diff"]:
        assert app.code[0].value == result["diff"]
    links = " ".join(texts(app.markdown))
    for trial in (result["baseline"], *result["trials"]):
        assert f"run=tune%2F{Path(trial['run_dir']).name})" in links  # its run, on the Run page
    assert not app.error


def test_tune_page_says_how_to_make_a_result_and_names_one_it_cannot_read(tmp_path, open_page):
    assert "gpuprof tune SCRIPT" in " ".join(texts(open_page(tmp_path, "Tune").info))
    (tmp_path / "tune-x").mkdir()
    (tmp_path / "tune-x" / "tune.json").write_text('{"target": 3}')
    errors = texts(open_page(tmp_path, "Tune").error)
    assert len(errors) == 1 and "is not a tune result: target" in errors[0]


@pytest.mark.parametrize("page", ["Run", "Numerics", "Trace", "Distributed", "Compare"])
def test_pages_say_what_to_select(tmp_path, open_page, page):
    app = open_page(tmp_path, page)
    if page == "Trace":
        assert app.selectbox[0].options == ["A trace file I upload"]
    else:
        assert any("Select" in text for text in texts(app.info))


@pytest.mark.parametrize(("trace", "device_activity"), [
    ("cpu_only/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz", False),
    ("a100_2rank_nccl/nccl_data.json.gz", True),
])
def test_trace_page_analyses_an_uploaded_trace(tmp_path, open_page, trace, device_activity):
    if not (SHARED_TRACES / trace).is_file():
        pytest.skip(f"shared traces not found at {SHARED_TRACES}")
    app = open_page(tmp_path, "Trace")
    app.file_uploader[0].upload(Path(trace).name, (SHARED_TRACES / trace).read_bytes()).run()
    overview = app.dataframe[0].value
    expected = TraceAnalysis(SHARED_TRACES / trace).overview()
    assert overview[["rank", "events", "device_events"]].values.tolist() == \
        expected[["rank", "events", "device_events"]].values.tolist()
    no_device = [text for text in texts(app.info) if "no device activity" in text]
    assert bool(no_device) != device_activity
    temporal = [d.value for d in app.dataframe if "idle_time_pct" in d.value.columns]
    if device_activity:
        assert temporal[0]["kernel_time_ms"].tolist() == (TraceAnalysis(SHARED_TRACES / trace).temporal_breakdown()[
            "kernel_time_us"] / 1000).tolist()
    else:
        assert temporal == []  # the device tables are named empty, not drawn
    assert not app.error
