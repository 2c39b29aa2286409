"""What a user reads on the dashboard's pages, in a real browser (one server and one Chromium for the module):
the Compare page's key figures carry their interval and are grey within the noise; an uploaded trace gets its
verdict under its own name, and a file that is not a trace one line in its name; a step's timeline of a trace
recorded with_stack=True draws its ops; one top-kernels bar per kernel; legends off the points and short tick
labels; tokens/s and MFU on axes of their own; a NaN blame said once, its numbers and cause readable; the
Memory page of a CPU run says where a snapshot is recorded."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from urllib.parse import urlencode

import pytest
import torch
from browser import RENDER_TIMEOUT_S, chromium_page, expect, needs_browser, rendered
from dashboard_helpers import SHARED_TRACES
from dashboard_servers import DashboardServer
from gpt2_runs import BATCH, SEQ, VOCAB, record, tiny_gpt2
from torch.profiler import ProfilerActivity, schedule

from gpuprof.analysis.trace.loader import load_trace
from gpuprof.analysis.trace.timeline import step_timeline, trace_steps
from gpuprof.dashboard.views.trace import UPLOAD
from gpuprof.report import build_report, compare
from gpuprof.report.page_views import compare_kpis
from gpuprof.report.trace_report import build_trace_report
from gpuprof.run.schema import bundle_in_run

pytestmark = [pytest.mark.slow, needs_browser]  # a real browser against a real server

REPO_SAMPLE_RUNS = Path(__file__).resolve().parents[2] / "sample_runs"  # the H200 runs are committed, never re-recorded
SHARED_A100 = SHARED_TRACES / "a100_2rank_nccl" / "nccl_data.json.gz"
STACK_TRACE = "tiny_with_stack.pt.trace.json"
OVERFLOW_STEP = 2


def record_with_stack(path: Path) -> Path:
    """Three steps of a tiny GPT-2 under torch.profiler with with_stack=True, the last two recorded."""
    model, optimizer = tiny_gpt2()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU], with_stack=True,
                                schedule=schedule(wait=0, warmup=1, active=2, repeat=1),
                                on_trace_ready=lambda profiler: profiler.export_chrome_trace(str(path))) as profiler:
        for _ in range(3):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.step()
    return path


def overflow_mlp(prof, model, optimizer, tokens) -> None:
    """An MLP weight blown up before OVERFLOW_STEP: its GELU's pow overflows in the forward pass, inside
    transformers' code."""
    if prof.step_index == OVERFLOW_STEP:
        with torch.no_grad():
            model.transformer.h[0].mlp.c_fc.weight.mul_(1e36)


@pytest.fixture(scope="module")
def root(sample_root, tmp_path_factory) -> Path:
    """The sample runs (baseline twice: a comparison within the noise), the H200 sample, a tune result, a
    plain trace recorded with_stack=True, a run whose NaN a transformers op made, and the shared A100 trace
    where there is one."""
    folder = tmp_path_factory.mktemp("what_users_read")
    for name in ("baseline", "optimized", "nan", "tune"):
        shutil.copytree(sample_root / name, folder / name)
    shutil.copytree(sample_root / "baseline", folder / "baseline-again")
    shutil.copytree(REPO_SAMPLE_RUNS / "h200-gpt2-baseline", folder / "h200-gpt2-baseline")
    (folder / "stacked").mkdir()
    record_with_stack(folder / "stacked" / STACK_TRACE)
    record(folder / "overflow", steps=OVERFLOW_STEP + 2, trace_steps=range(0), before_step=overflow_mlp)
    if SHARED_A100.is_file():
        (folder / "a100").mkdir()
        shutil.copy(SHARED_A100, folder / "a100" / "nccl_data.pt.trace.json.gz")  # the name a folder's traces take
    return folder


@pytest.fixture(scope="module")
def page(root):
    server = DashboardServer((str(root),), None)
    try:
        with chromium_page() as browser_page:
            browser_page.dashboard_url = server.url
            yield browser_page
    finally:
        server.kill()


def open_page(page, name: str, runs: tuple[str, ...], charts: int = 0, tables: int = 0, texts: tuple = (),
              critical: bool = False) -> dict:
    """The page rendered; `critical`: it shows a critical verdict, in an error box."""
    page.goto(f"{page.dashboard_url}?{urlencode({'page': name, 'run': runs}, doseq=True)}")
    state = rendered(page, charts, tables, list(texts), errors_shown=critical)
    assert page.get_by_test_id("stException").count() == 0 and (critical or state["failures"] == 0), state["text"][:500]
    return state


# Every Plotly chart on the page as the browser holds it: its traces (decoded) and its laid-out axes.
CHARTS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(chart => ({
  data: chart._fullData.map(trace => ({name: trace.name, type: trace.type, yaxis: trace.yaxis,
    y: Array.from(trace.y || []), customdata: Array.from(trace.customdata || []).map(row => Array.from(row))})),
  yaxes: Object.fromEntries(Object.keys(chart._fullLayout).filter(key => /^yaxis\\d*$/.test(key)).map(key =>
    [key, {domain: chart._fullLayout[key].domain, ticktext: chart._fullLayout[key].ticktext || []}])),
  ticks: Array.from(chart.querySelectorAll('.ytick text')).map(tick => tick.textContent)}))"""
METRICS = """() => Array.from(document.querySelectorAll('[data-testid="stMetric"]')).map(metric => ({
  label: metric.querySelector('[data-testid="stMetricLabel"]').innerText,
  value: metric.querySelector('[data-testid="stMetricValue"]').innerText,
  delta: (metric.querySelector('[data-testid="stMetricDelta"]') || {innerText: ''}).innerText,
  color: getComputedStyle(metric.querySelector('[data-testid="stMetricDelta"]') || metric).color}))"""


def charts(page) -> list[dict]:
    return page.evaluate(CHARTS)


def chart_with(page, trace_name: str) -> dict:
    found = [chart for chart in charts(page) if any(trace["name"] == trace_name for trace in chart["data"])]
    assert found, f"no chart with a trace named {trace_name!r}"
    return found[0]


def is_grey(css_color: str) -> bool:
    red, green, blue = (int(part) for part in re.findall(r"\d+", css_color)[:3])
    return max(red, green, blue) - min(red, green, blue) < 25


def test_compare_kpis_carry_their_interval_and_are_grey_within_the_noise(page, root):
    open_page(page, "Compare", ("baseline", "baseline-again"), charts=3, tables=2, texts=("Speedup", "within the noise"))
    same = {metric["label"]: metric for metric in page.evaluate(METRICS)}
    kpis = {kpi.label: kpi for kpi in compare_kpis(compare(build_report(root / "baseline"),
                                                           build_report(root / "baseline-again")))}
    speedup = same["Speedup (B over A, mean step time)"]
    assert kpis[speedup["label"]].within_the_noise
    assert re.fullmatch(r"95 % CI \d\.\d\d–\d\.\d\d× · within the noise", speedup["delta"]), speedup
    assert speedup["delta"] == kpis[speedup["label"]].note and is_grey(speedup["color"])

    open_page(page, "Compare", ("baseline", "optimized"), charts=3, tables=2, texts=("Speedup", "95 % CI"))
    faster = {metric["label"]: metric for metric in page.evaluate(METRICS)}["Speedup (B over A, mean step time)"]
    assert re.fullmatch(r"95 % CI \d\.\d\d–\d\.\d\d×", faster["delta"]), faster  # B faster: a winner, in colour
    assert not is_grey(faster["color"])


def test_an_uploaded_trace_gets_its_verdict_under_its_own_name_and_a_bad_file_one_line(page, root):
    open_page(page, "Trace", ("baseline",), texts=("Trace",))
    page.get_by_test_id("stSelectbox").first.click()
    page.get_by_role("option", name=UPLOAD).click()
    page.locator("input[type=file]").set_input_files(str(root / "stacked" / STACK_TRACE))
    report = build_trace_report(root / "stacked" / STACK_TRACE, jobs=1)
    state = rendered(page, 1, 1, [f"Trace · uploaded {STACK_TRACE}", report.verdict.headline, "Diagnoses"])
    assert state["failures"] == 0
    # not the run selected in the sidebar (its header stays, faded, until the upload's run ends)
    expect(page.locator("h2", has_text=re.compile(r"^Trace"))).to_have_text(
        [f"Trace · uploaded {STACK_TRACE}"], timeout=RENDER_TIMEOUT_S * 1000)
    assert all(finding.title in state["text"] for finding in report.findings)

    bad = root.parent / "notes.json"
    bad.write_text(json.dumps({"notes": "not a trace"}))
    page.locator("input[type=file]").set_input_files(str(bad))
    page.wait_for_function("() => document.body.innerText.includes('notes.json: not a torch.profiler trace')")
    errors = page.locator('[data-testid="stAlertContentError"]').all_inner_texts()
    assert errors == ["notes.json: not a torch.profiler trace (no 'traceEvents' list)"]
    # the good trace's elements stay, faded, until the run that shows the error ends
    expect(page.get_by_test_id("stDownloadButton")).to_have_count(0, timeout=RENDER_TIMEOUT_S * 1000)
    assert "gpuprof-upload-" not in page.evaluate("() => document.body.innerText")


def test_the_timeline_of_a_trace_recorded_with_stack_draws_its_ops(page, root):
    trace = load_trace([root / "stacked" / STACK_TRACE])
    expected = step_timeline(trace, trace_steps(trace, 0)[0], 0).intervals
    open_page(page, "Timeline", ("stacked",), charts=1, tables=1, texts=("Drew ",))
    bars = {bar["name"]: bar for bar in charts(page)[0]["data"]}
    ops = expected[expected["kind"] == "cpu_op"]
    assert len(ops) > 20 and len(bars["cpu_op"]["y"]) == len(ops)  # every op drawn, beside the Python frames
    assert all(row.endswith(tuple(f"depth {depth}" for depth in range(6))) for row in bars["cpu_op"]["y"])
    assert bars["python_function"]["y"] and all(" · python " in row for row in bars["python_function"]["y"])


@pytest.mark.skipif(not SHARED_A100.is_file(), reason=f"shared traces not found at {SHARED_A100.parent.parent}")
def test_top_kernels_draws_one_bar_per_kernel_even_where_their_short_names_are_alike(page, root):
    top = build_trace_report(root / "a100", jobs=1).tables["top_kernels"]
    open_page(page, "Trace", ("a100",), charts=2, tables=3, texts=("Top kernels by total time",))
    chart = next(chart for chart in charts(page) if chart["data"][0]["customdata"]
                 and len(chart["data"][0]["customdata"][0]) == 3)
    bars = chart["data"][0]
    assert len(bars["y"]) == len(set(bars["y"])) == len(top)
    assert sorted(row[0] for row in bars["customdata"]) == sorted(top["name"])  # each kernel its own bar
    assert len(set(chart["yaxes"]["yaxis"]["ticktext"])) < len(top)  # the short labels alone collide


def test_legends_and_labels_stay_off_the_points_and_ticks_read_short(page):
    open_page(page, "Tune", (), charts=1, tables=1, texts=("Measured speedup against the estimate",))
    overlaps = page.evaluate("""() => {
      const chart = document.querySelector('.js-plotly-plot');
      const labels = Array.from(chart.querySelectorAll('.legend, .annotation')).map(label => label.getBoundingClientRect());
      const points = Array.from(chart.querySelectorAll('.scatterlayer .point')).map(point => point.getBoundingClientRect());
      return points.filter(box => labels.some(label => box.left < label.right && label.left < box.right
                                                       && box.top < label.bottom && label.top < box.bottom)).length}""")
    assert overlaps == 0
    open_page(page, "Run", ("h200-gpt2-baseline",), charts=5, texts=("Throughput and MFU",))
    chart = chart_with(page, "MFU %")
    axes = {trace["name"]: trace["yaxis"] for trace in chart["data"]}
    assert axes["tokens/s"] != axes["MFU %"]  # MFU is tokens/s times a constant: one axis would hide a line
    low, high = (chart["yaxes"][f"yaxis{axes[name][1:]}"]["domain"] for name in ("MFU %", "tokens/s"))
    assert low[1] <= high[0]
    ticks = [tick for chart in charts(page) for tick in chart["ticks"]]
    assert ticks and not [tick for tick in ticks if significant_digits(tick) > 4]
    open_page(page, "Run", ("baseline",), charts=5, texts=("Host CPU and memory",))
    hovered = hover_values(page, next(i for i, chart in enumerate(charts(page))
                                      if any(trace["name"] == "process RSS GiB" for trace in chart["data"])))
    assert hovered and not [value for value in hovered if significant_digits(value) > 4], hovered


def significant_digits(number: str) -> int:
    return len(re.sub(r"\D", "", number).strip("0"))


def hover_values(page, chart: int) -> list[str]:
    """The values the hover label of chart number `chart` shows with the mouse over its middle."""
    x, y = page.evaluate(f"""() => {{
      const box = document.querySelectorAll('.js-plotly-plot')[{chart}].querySelector('.nsewdrag').getBoundingClientRect();
      return [box.left + box.width / 2, box.top + box.height / 2]}}""")
    page.mouse.move(x, y)
    page.wait_for_function(f"() => document.querySelectorAll('.js-plotly-plot')[{chart}].querySelector('.hoverlayer text')")
    labels = page.evaluate(f"""() => Array.from(document.querySelectorAll('.js-plotly-plot')[{chart}]
      .querySelectorAll('.hoverlayer text')).map(text => text.textContent)""")
    return [label.rsplit(" : ", 1)[1] for label in labels if " : " in label]


def test_the_nan_page_says_the_blame_once_in_readable_words(page, root):
    report = build_report(root / "overflow")
    event = report.blames.iloc[0]
    assert event["details"]["op"] == "aten::pow" and "site-packages" in event["details"]["library_source"]
    state = open_page(page, "Numerics", ("overflow",), charts=1, texts=("Where a value first went non-finite",))
    text = state["text"]
    blame = event["message"].removeprefix(f"step {event['step']}: ").split(";")[0]
    assert text.count(blame) == 1, blame
    assert re.search(r"input absmax\s+\d\.\de\d\d\b", text) and not re.search(r"\d{12}", text)
    assert "update grew the largest |weight|" in text and "oversized_update" not in text
    assert "site-packages" not in text and "transformers/activations.py:" in text  # a library's file, by its package


def test_the_nan_page_starts_at_the_users_own_line_with_the_librarys_behind_it(page):
    """The forensic re-run calls the model from inside prof.step(): the line that called it in training is the
    one recorded with the call."""
    text = open_page(page, "Numerics", ("overflow",), charts=1, texts=("Where a value first went non-finite",))["text"]
    assert re.search(r"start at\s+gpt2_runs\.py:\d+ in record: loss = model\(", text)
    assert re.search(r"in the library\s+transformers/activations\.py:\d+ in forward", text)


def test_a_sample_run_never_offers_a_bundle_it_does_not_ship_and_memory_says_where_snapshots_come_from(page, root):
    event = build_report(root / "nan").blames.iloc[0]
    shipped = bundle_in_run(root / "nan", event["details"]["bundle"]).is_file()
    for name in ("Run", "Numerics"):
        text = open_page(page, name, ("nan",), charts=1, texts=("non-finite",), critical=name == "Run")["text"]
        assert ("gpuprof replay" in text) == shipped, name
    text = open_page(page, "Memory", ("baseline",), texts=("CUDA",))["text"]
    assert "A CUDA memory snapshot is recorded only on a CUDA device, and this run ran on the CPU" in text
