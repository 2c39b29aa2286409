"""Two runs side by side (e.g. baseline vs optimized), from their reports: headline figures
with ratios, and which findings appeared or disappeared. Nothing is computed again."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from gpuprof.analysis.run.jsonable import json_safe
from gpuprof.analysis.run.summary import RunSummary
from gpuprof.report.build import Report

# (metric, which direction is better); phase shares are compared as points of step time.
HEADLINE_METRICS = (
    ("step_time_p50_s", "lower"),
    ("step_time_p90_s", "lower"),
    ("step_time_p99_s", "lower"),
    ("tokens_per_s", "higher"),
    ("mfu", "higher"),
    ("flops_per_s", "higher"),
    ("gpu_util_mean_pct", "higher"),
    ("peak_mem_allocated_bytes", "lower"),
    ("peak_mem_reserved_bytes", "lower"),
    ("peak_rss_bytes", "lower"),
    ("data_share_pct", "lower"),
    ("optimizer_share_pct", "lower"),
    ("other_share_pct", "lower"),
)
# Differences smaller than this (relative) are noise between two runs.
SAME_WITHIN = 0.02


@dataclass
class Comparison:
    a: Report
    b: Report
    metrics: pd.DataFrame
    appeared: list = field(default_factory=list)
    disappeared: list = field(default_factory=list)
    persisted: list = field(default_factory=list)

    def to_dict(self) -> dict:
        """The body of `gpuprof compare --json` (docs/json-output.md)."""
        return json_safe(
            {
                "a": run_ref(self.a),
                "b": run_ref(self.b),
                "metrics": self.metrics.to_dict(orient="records"),
                "findings": {
                    "appeared": [finding.to_dict() for finding in self.appeared],
                    "disappeared": [finding.to_dict() for finding in self.disappeared],
                    "persisted": self.persisted,
                },
            }
        )


def run_ref(report: Report) -> dict:
    return {"name": report.summary.name, "path": report.summary.path, "verdict": report.verdict.to_dict()}


def metric_value(summary: RunSummary, metric: str):
    if metric.endswith("_share_pct"):
        return summary.phase_split_pct.get(metric.removesuffix("_share_pct"))
    return getattr(summary, metric)


def better(a, b, direction: str) -> str | None:
    """Which run is better on this metric: 'a', 'b', 'same', or None when either is unknown."""
    if a is None or b is None:
        return None
    if abs(b - a) <= SAME_WITHIN * max(abs(a), abs(b)):
        return "same"
    b_lower = b < a
    return "b" if b_lower == (direction == "lower") else "a"


def metrics_table(a: RunSummary, b: RunSummary) -> pd.DataFrame:
    rows = []
    for metric, direction in HEADLINE_METRICS:
        value_a, value_b = metric_value(a, metric), metric_value(b, metric)
        ratio = value_b / value_a if value_a and value_b is not None else None
        rows.append(
            {"metric": metric, "a": value_a, "b": value_b, "ratio_b_over_a": ratio,
             "better": better(value_a, value_b, direction)}
        )
    # object dtype keeps unknown figures as None rather than NaN
    return pd.DataFrame(rows, dtype=object)


def compare(report_a: Report, report_b: Report) -> Comparison:
    """Run B against run A: metric ratios are B/A; findings appear when B has a rule A had not."""
    rules_a = {finding.rule for finding in report_a.findings}
    rules_b = {finding.rule for finding in report_b.findings}
    return Comparison(
        a=report_a,
        b=report_b,
        metrics=metrics_table(report_a.summary, report_b.summary),
        appeared=[finding for finding in report_b.findings if finding.rule not in rules_a],
        disappeared=[finding for finding in report_a.findings if finding.rule not in rules_b],
        persisted=sorted(rules_a & rules_b),
    )
