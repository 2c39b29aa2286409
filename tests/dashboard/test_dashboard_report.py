"""`gpuprof report RUN -o report.html`: one self-contained file with the verdict, the diagnoses and the charts."""

from __future__ import annotations

import html
import re

from dashboard_helpers import unreadable
from processes import gpuprof_cli

from gpuprof.cli.pages import run_page
from gpuprof.dashboard.charts import run_panels
from gpuprof.diagnoses import diagnose
from gpuprof.report import build_report
from gpuprof.report.format import SEVERITY_COLORS
from gpuprof.run.reader import load_run


def test_report_holds_findings_and_every_chart(sample_root, tmp_path):
    output = tmp_path / "report.html"
    result = gpuprof_cli("report", str(sample_root / "slow-data"), "-o", str(output))
    assert result.returncode == 0, result.stderr
    page = output.read_text()
    run = load_run(sample_root / "slow-data")
    text = html.unescape(page)
    for finding in diagnose(run):
        assert finding.title in text
    verdict = build_report(sample_root / "slow-data").verdict
    assert verdict.bound == "input" and text.index(verdict.headline) < text.index("<h2>Diagnoses</h2>")
    charts = [panel for panel in run_panels(run, 0) if panel.figure is not None]
    assert page.count('class="plotly-graph-div"') == len(charts)
    assert page.count("* plotly.js v") == 1  # plotly.js embedded once: the file opens offline


def test_report_shows_a_nan_runs_origin_as_its_fields_under_a_critical_verdict(sample_root):
    report = build_report(sample_root / "nan")
    page = run_page(report, 0)
    assert report.verdict.bound == "numerics" and report.verdict.severity == "critical"
    assert f'class="verdict" style="border-color:{SEVERITY_COLORS["critical"][1]}"' in page
    origin = page[page.index("<td>origin</td>"):].split("</table>")[0]  # its fields, as a table of their own
    assert "<td>phase</td><td>state</td>" in origin and "<td>module</td><td>transformer.wte</td>" in origin
    assert "None" not in origin
    assert report.verdict.headline.endswith(": nan in transformer.wte")  # the verdict names the module
    text = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<script.*?</script>", "", page, flags=re.S)))
    assert not unreadable(text) and "first nonfinite step" in text  # code as code (no backticks), keys as words
    [finding] = [finding for finding in report.findings if finding.rule == "nonfinite-values"]
    assert finding.title.count("step 8") == 1  # not "from step 8: step 8: ..."
    bundle = sample_root / "nan" / "numerics" / "step-8-rank-0.pt"
    # a replay only of a bundle this copy ships (the sample runs leave theirs out: model and optimizer state)
    assert (f"`gpuprof replay {bundle}`" in finding.fix) == bundle.is_file() and "above" not in finding.fix


def test_report_bad_input_is_one_line_and_exit_2(sample_root, tmp_path):
    result = gpuprof_cli("report", str(tmp_path), "-o", str(tmp_path / "r.html"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"gpuprof report: error: {tmp_path} is not a gpuprof run directory (no meta.json)"
    result = gpuprof_cli("report", str(sample_root / "baseline"), "--rank", "5", "-o", str(tmp_path / "r.html"))
    assert result.returncode == 2 and "--rank 5" in result.stderr and len(result.stderr.splitlines()) == 1
