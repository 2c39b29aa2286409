"""Two runs side by side (e.g. baseline vs optimized): headline figures with ratios, and
which diagnoses appeared or disappeared."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from gpuprof.analysis.run.jsonable import json_safe
from gpuprof.analysis.run.summary import RunSummary

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
    a: RunSummary
    b: RunSummary
    metrics: pd.DataFrame
    appeared: list = field(default_factory=list)
    disappeared: list = field(default_factory=list)
    persisted: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return json_safe(
            {
                "a": {"name": self.a.name, "path": self.a.path},
                "b": {"name": self.b.name, "path": self.b.path},
                "metrics": self.metrics.to_dict(orient="records"),
                "findings": {
                    "appeared": [finding.to_dict() for finding in self.appeared],
                    "disappeared": [finding.to_dict() for finding in self.disappeared],
                    "persisted": self.persisted,
                },
            }
        )


def metric_value(summary: RunSummary, metric: str):
    if metric.endswith("_share_pct"):
        return summary.phase_split_pct.get(metric.removesuffix("_share_pct"))
    return getattr(summary, metric)


def verdict(a, b, direction: str) -> str | None:
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
             "better": verdict(value_a, value_b, direction)}
        )
    # object dtype keeps unknown figures as None rather than NaN
    return pd.DataFrame(rows, dtype=object)


def compare(run_a, run_b) -> Comparison:
    """Run B against run A: metric ratios are B/A; findings appear when B has a rule A had not."""
    from gpuprof.diagnoses.context import RunContext
    from gpuprof.diagnoses.registry import diagnose_context

    ctx_a, ctx_b = RunContext.of(run_a), RunContext.of(run_b)
    findings_a, findings_b = diagnose_context(ctx_a), diagnose_context(ctx_b)
    rules_a = {finding.rule for finding in findings_a}
    rules_b = {finding.rule for finding in findings_b}
    return Comparison(
        a=ctx_a.summary,
        b=ctx_b.summary,
        metrics=metrics_table(ctx_a.summary, ctx_b.summary),
        appeared=[finding for finding in findings_b if finding.rule not in rules_a],
        disappeared=[finding for finding in findings_a if finding.rule not in rules_b],
        persisted=sorted(rules_a & rules_b),
    )
