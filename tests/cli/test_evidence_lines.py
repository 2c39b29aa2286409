"""`gpuprof analyze`'s evidence lines on real runs of nanoGPT's train.py (script_corpus.py), slowed down and sent
non-finite on purpose, and on the recorded sample runs (GPT-2 on an H200, DDP over two ranks): each line holds the
few figures that fit a terminal, with their units, in words; `--json` keeps every key the rules measured."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from script_corpus import finished, run_nanogpt

from gpuprof.cli import main
from gpuprof.report import build_report
from gpuprof.report.format import EVIDENCE_WIDTH

SLOW = pytest.mark.slow  # real scripts in child processes
SAMPLE_RUNS = Path(__file__).resolve().parents[2] / "sample_runs"
GPT = "model:GPT"  # nanoGPT's model class, in its model.py
GET_BATCH_DELAY_S = 0.25  # against a tiny model's step of tens of ms: input-bound on a loaded machine too
RAW_EVIDENCE = re.compile(r"\b[a-z]+(?:_[a-z0-9]+)+=")  # the old `key_name=value` form


@pytest.fixture(scope="module")
def data_bound(tmp_path_factory):
    """nanoGPT whose get_batch waits GET_BATCH_DELAY_S on every call (its np.memmap slowed)."""
    return finished(run_nanogpt(tmp_path_factory.mktemp("slow"), max_iters=6,
                                patches=[("phase_patches:slow_memmap", {"delay_s": GET_BATCH_DELAY_S})])).run_dir


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory):
    """nanoGPT whose first update runs at lr 1e30: every later step's loss is NaN."""
    return finished(run_nanogpt(tmp_path_factory.mktemp("nan"), max_iters=4,
                                patches=[("corpus_patches:lr_spike", {"model": GPT, "at_call": 0, "lr": 1e30})])).run_dir


def analyze(run_dir, capsys, *flags: str) -> str:
    """What `gpuprof analyze RUN [flags]` printed on stdout (it succeeded)."""
    code = main(["analyze", str(run_dir), *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def evidence_lines(run_dir, capsys) -> list[str]:
    return [line for line in analyze(run_dir, capsys).splitlines() if line.lstrip().startswith("evidence:")]


@pytest.mark.parametrize("run", [pytest.param("data_bound", marks=SLOW), pytest.param("nonfinite", marks=SLOW),
                                 "h200-gpt2-baseline", "h200-gpt2-optimized", "ddp-2rank"])
def test_every_evidence_line_fits_a_terminal_and_json_keeps_every_key(run, request, capsys):
    run_dir = SAMPLE_RUNS / run if (SAMPLE_RUNS / run).is_dir() else request.getfixturevalue(run)
    findings = build_report(run_dir).findings
    lines = evidence_lines(run_dir, capsys)
    assert len(lines) == len(findings) and lines
    too_long = [line for line in lines if len(line) > EVIDENCE_WIDTH]
    assert not too_long, too_long
    assert not [line for line in lines if RAW_EVIDENCE.search(line)], lines
    document = json.loads(analyze(run_dir, capsys, "--json"))
    assert [finding["evidence"].keys() for finding in document["findings"]] == [
        finding.evidence.keys() for finding in findings]


def evidence_of(category: str, run_dir, capsys):
    """The run's one finding of `category`, and the evidence line `gpuprof analyze` printed for it."""
    report = build_report(run_dir)
    [finding] = report.findings_in(category)
    return finding, evidence_lines(run_dir, capsys)[report.findings.index(finding)]


@SLOW
def test_a_data_bound_line_leads_with_the_data_share_and_times_in_their_units(data_bound, capsys):
    finding, line = evidence_of("input", data_bound, capsys)
    share = finding.evidence["data_share_pct"]
    assert line.lstrip().startswith(f"evidence: data share: {share:.3g} %;"), line
    data_p50_ms = 1000 * finding.evidence["data_time_p50_s"]
    assert data_p50_ms >= 1000 * GET_BATCH_DELAY_S and f"data time p50: {data_p50_ms:.3g} ms" in line, line


@SLOW
def test_the_nonfinite_line_names_the_first_bad_step_and_leaves_the_rest_to_json(nonfinite, capsys):
    finding, line = evidence_of("numerics", nonfinite, capsys)
    first = finding.evidence["first_nonfinite_step"]
    assert first == 1 and f"first nonfinite step: {first}" in line, line
    left = len(finding.evidence) - line.count(";") - 1
    assert left > 0 and line.endswith(f"(+{left} more in --json)"), line
