"""The registry: ranking, isolation of a failing rule, and every rule documented and tested."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from gpuprof.diagnoses import CATEGORIES, SEVERITIES, Finding, diagnose, rule
from gpuprof.cli import main
from gpuprof.diagnoses.registry import RULES, all_rules
from gpuprof.report import build_report

ROOT = Path(__file__).resolve().parents[2]


def test_findings_are_ranked_by_severity_then_gain(write_gpu_run):
    def troubled(i):
        return {"data_time_s": 0.1, "mem_alloc_retries": i, "mem_reserved_bytes": 78 * 2**30}

    findings = diagnose(write_gpu_run(step=troubled, sample=lambda i: {"gpu_util_pct": 50.0}), strict=True)
    assert len({finding.severity for finding in findings}) >= 2
    keys = [(SEVERITIES.index(f.severity), -(f.est_gain_pct if f.est_gain_pct is not None else -1)) for f in findings]
    assert keys == sorted(keys)


@pytest.fixture
def failing_rule():
    """A registered rule that raises on every run."""
    @rule("test-always-fails", "host")
    def always_fails(ctx):
        raise RuntimeError("boom")

    yield "rule test-always-fails failed: RuntimeError: boom"
    RULES.pop("test-always-fails")


def test_a_failing_rule_is_said_and_the_others_still_run(write_gpu_run, failing_rule, caplog):
    run = write_gpu_run(step=lambda i: {"data_time_s": 0.1})
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match=re.escape(failing_rule)):
        findings = diagnose(run)
    assert "dataloader-bound" in [finding.rule for finding in findings]
    assert "test-always-fails" in caplog.text
    with pytest.raises(RuntimeError):
        diagnose(run, strict=True)


def test_a_failing_rule_shows_in_the_report_notes_verdict_and_cli(write_gpu_run, failing_rule, capsys):
    run = write_gpu_run(step=lambda i: {"data_time_s": 0.1})
    report = build_report(run.path)
    assert failing_rule in report.notes
    assert failing_rule in report.verdict.why and report.verdict.bound == "input"
    assert main(["analyze", str(run.path)]) == 0
    out, err = capsys.readouterr()
    assert failing_rule in err and failing_rule in out  # the notes on stderr, the verdict's why on stdout
    assert main(["analyze", str(run.path), "--json"]) == 0
    assert failing_rule in json.loads(capsys.readouterr().out)["verdict"]["why"]


def test_finding_rejects_unknown_severity_and_category():
    with pytest.raises(ValueError):
        Finding(rule="x", severity="fatal", title="t")
    with pytest.raises(ValueError):
        Finding(rule="x", severity="info", title="t", category="speed")
    with pytest.raises(ValueError):
        rule("test-no-such-category", "speed")


def test_findings_carry_their_rules_category(write_gpu_run):
    findings = diagnose(write_gpu_run(step=lambda i: {"data_time_s": 0.1, "mem_reserved_bytes": 78 * 2**30}), strict=True)
    assert {"dataloader-bound", "memory-near-limit"} <= {finding.rule for finding in findings}
    for finding in findings:
        assert finding.category == RULES[finding.rule].category in CATEGORIES
        assert finding.to_dict()["category"] == finding.category


def test_every_rule_is_documented_and_tested():
    docs = (ROOT / "docs" / "rules.md").read_text()
    tests = "".join(path.read_text() for path in (ROOT / "tests" / "diagnoses").glob("test_*.py"))
    for registered in all_rules():
        assert re.match(r"^[a-z0-9]+(-[a-z0-9]+)*$", registered.id)
        assert f"`{registered.id}`" in docs, f"{registered.id} missing from docs/rules.md"
        category_row = next(line for line in docs.splitlines() if line.startswith(f"| `{registered.category}` |"))
        assert f"`{registered.id}`" in category_row, f"{registered.id} missing from its category in docs/rules.md"
        assert f'"{registered.id}"' in tests.replace(f'@rule("{registered.id}", "{registered.category}")', ""), f"{registered.id} untested"
