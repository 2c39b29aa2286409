"""`gpuprof dashboard DIR` on folders of plain torch.profiler traces (tensorboard_trace_handler's
layout), beside a gpuprof run: each listed with its verdict; every page works from the trace alone
and says what is missing and how to record it. Through Streamlit's AppTest; the browser test is in
test_dashboard_browser.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from dashboard_helpers import texts

from gpuprof.report.trace_report import build_trace_report


@pytest.fixture(scope="session")
def traces_root(plugin_traces, sample_root, views_trace, tmp_path_factory) -> Path:
    """A gpuprof run and folders of plain traces side by side: input-bound, fed by workers, two spans
    of one worker, two workers of one span (ranks), and one recorded with every option of the plugin's views."""
    root = tmp_path_factory.mktemp("traces_root")
    shutil.copytree(sample_root / "baseline", root / "baseline")
    shutil.copytree(views_trace, root / "views")
    for name in ("no_workers", "workers", "two_spans"):
        shutil.copytree(plugin_traces[name], root / name)
    (root / "two_workers").mkdir()
    source = next(plugin_traces["workers"].iterdir())
    for worker in ("host_1", "host_2"):
        shutil.copy(source, root / "two_workers" / f"{worker}.{source.name.split('.')[1]}.pt.trace.json")
    return root


def test_runs_page_lists_trace_folders_with_their_verdicts_beside_runs(traces_root, open_page):
    table = open_page(traces_root, "Runs").dataframe[0].value.set_index("run")
    assert table.loc["baseline", "recorded"] == "cpu · tiny baseline"
    for name in ("no_workers", "workers", "two_spans", "two_workers"):
        assert table.loc[name, "recorded"].startswith("plain trace, ")
        assert table.loc[name, "verdict"] == build_trace_report(traces_root / name, jobs=1).verdict.headline
    assert table.loc["no_workers", "verdict"].startswith("Bound by input")
    assert "2 span(s) of 1 worker(s)" in table.loc["two_spans", "recorded"]
    assert "1 span(s) of 2 worker(s)" in table.loc["two_workers", "recorded"]


def test_run_page_of_a_trace_shows_verdict_findings_and_what_is_missing(traces_root, open_page):
    app = open_page(traces_root, "Run", ("no_workers",))
    shown = " ".join(texts(app.info) + texts(app.expander.label if hasattr(app.expander, "label") else []))
    assert "Bound by input" in shown
    assert any("waiting for the next batch" in expander.label for expander in app.expander)
    assert any("only a gpuprof run records" in text and "prof.step()" in text and "NVML" in text
               for text in texts(app.info))
    assert not app.error


def test_spans_are_trace_windows_on_the_trace_and_timeline_pages(traces_root, open_page):
    app = open_page(traces_root, "Trace", ("two_spans",))
    assert app.selectbox[0].options[:2] == ["span 1 (1 file(s))", "span 2 (1 file(s))"]
    assert not app.error
    timeline = open_page(traces_root, "Timeline", ("two_spans",))
    assert timeline.selectbox[0].options == ["span 1", "span 2"] and not timeline.error
    assert any("Drew " in text for text in texts(timeline.caption))


def test_workers_are_ranks_on_the_distributed_page(traces_root, open_page):
    app = open_page(traces_root, "Distributed", ("two_workers",))
    assert any("2 of 2 ranks traced" in text for text in texts(app.caption))
    assert any("only a gpuprof run records" in text for text in texts(app.info)) and not app.error
    assert len(app.dataframe) == 2  # step spread and stragglers per rank; overlap needs device kernels:
    assert any(text.startswith("Computation/communication overlap: empty") for text in texts(app.info))


@pytest.mark.parametrize("page", ["Numerics", "Memory"])
def test_pages_a_trace_cannot_fill_say_how_to_record_it(traces_root, open_page, page):
    app = open_page(traces_root, page, ("workers",))
    assert any("only a gpuprof run records" in text for text in texts(app.info)) and not app.error


def test_compare_a_trace_with_a_run_and_with_another_trace(traces_root, open_page):
    for runs in (("no_workers", "workers"), ("baseline", "no_workers")):
        app = open_page(traces_root, "Compare", runs)
        assert not app.error, texts(app.error)
        assert sum("Bound by" in text for text in texts(app.info)) == 2
        if runs == ("no_workers", "workers"):  # two traces: B against A by kernel and op
            diff = app.dataframe[-1].value.set_index(["kind", "name"])
            assert diff.loc[("cpu_op", "aten::mm"), "count_diff"] == 0


def test_the_plugins_views_of_a_trace_recorded_with_their_options(traces_root, open_page):
    memory = open_page(traces_root, "Memory", ("views",))
    assert not memory.error, texts(memory.error)
    assert len(memory.get("plotly_chart")) == 1  # memory over time
    by_op = memory.dataframe[-1].value.set_index("op")
    assert by_op.loc["aten::addmm", "allocations"] > 0
    trace = open_page(traces_root, "Trace", ("views",))
    assert not trace.error and not any("not in this trace" in text for text in texts(trace.info))
    shown = [frame.value for frame in trace.dataframe]
    modules = next(frame for frame in shown if "module" in frame.columns)
    assert "ViewsModel_0.Linear_0" in modules["module"].tolist()
    assert any("input_dims" in frame.columns and len(frame) for frame in shown)
    assert any("stack" in frame.columns and len(frame) for frame in shown)


def test_views_a_trace_lacks_say_which_option_records_them(traces_root, open_page):
    trace = open_page(traces_root, "Trace", ("no_workers",))
    notes = " ".join(texts(trace.info))
    for option in ("record_shapes=True", "with_stack=True", "profile_memory=True"):
        assert f"record it by passing {option} to torch.profiler.profile(...)" in notes
    memory = open_page(traces_root, "Memory", ("no_workers",))
    assert any("profile_memory=True" in text for text in texts(memory.info)) and not memory.error
