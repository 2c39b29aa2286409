"""Run B against run A (or against a baseline of several runs), with the noise measured: every
figure from the measured steps with a block-bootstrap interval (gpuprof.analysis.run.stats),
the comparability contract both runs are checked against (gpuprof.report.contract), numerics
parity, one conclusion line, and the CI gate's decision. Method: docs/compare.md."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from gpuprof.analysis.run import stats
from gpuprof.analysis.run.summary import measured_step_table
from gpuprof.errors import GpuprofError
from gpuprof.report import gate
from gpuprof.report.build import Report
from gpuprof.report.contract import (HOST_LOAD, TERMS, Difference, busier, differences, host_load_caution,
                                     host_load_difference)
from gpuprof.report.format import MISSING, figure_text, fmt_interval
from gpuprof.report.gate import DEFAULT_MAX_REGRESSION_PCT, POOLINGS, Gate, speed_text
from gpuprof.run.jsonable import json_safe
from gpuprof.run.schema import SPLIT_PHASES

# The columns of a step table that are resampled (each only where every measured step has it).
RESAMPLED = ("step_time_s", "rank_time_s", "tokens", "mfu_time_s", *(f"{phase}_time_s" for phase in SPLIT_PHASES))


@dataclass
class Side:
    """One side of a comparison: its run, or the runs of a baseline, and their measured steps."""

    reports: list[Report]
    steps: pd.DataFrame  # one row per measured step of every run (`measured_step_table`), runs one after another
    pooling: str
    resampled: stats.Resampled | None  # None: too few measured steps to resample

    @property
    def report(self) -> Report:
        """The run that stands for this side (the median run of a median baseline)."""
        return self.reports[0]

    @property
    def label(self) -> str:
        if len(self.reports) == 1:
            return self.report.name
        names = ", ".join(report.name for report in self.reports)
        return f"{len(self.reports)} runs, {self.pooling} ({names})"

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def tokens_per_step(self) -> float | None:
        tokens = self.steps["tokens"].dropna() if "tokens" in self.steps else ()
        return float(tokens.median()) if len(tokens) else None

    @property
    def nonfinite_steps(self) -> int:
        """Steps whose loss went non-finite, or whose gradients did without a GradScaler to skip them
        (the worst run of a baseline)."""
        return max(_nonfinite(report.summary.health) for report in self.reports)

    def mean(self, column: str) -> stats.Estimate | None:
        if self.resampled is not None and column in self.resampled.observed:
            return self.resampled.mean(column)
        values = self.steps[column] if column in self.steps else pd.Series(dtype=float)
        return stats.Estimate(float(values.mean()), None) if len(values) and values.notna().all() else None

    def loss_by_step(self) -> pd.Series:
        if "loss" not in self.steps:
            return pd.Series(dtype=float)
        return self.steps.groupby("step")["loss"].mean().dropna()


def _nonfinite(health: dict) -> int:
    grads = health["nonfinite_grad_steps"] if health.get("scaler_scale_last") is None else 0
    return int((health["nonfinite_loss_steps"] or 0) + (grads or 0))  # None: not recorded (a plain trace)


def side(reports: list[Report], pooling: str = "pooled", seed: int = 0) -> Side:
    """A side of `reports`: their steps pooled, or only the run of median mean step time."""
    if pooling not in POOLINGS:
        raise GpuprofError(f"unknown baseline pooling {pooling!r}; choose from {', '.join(POOLINGS)}")
    tables = [step_table(report) for report in reports]
    if pooling == "median" and len(reports) > 1:
        order = np.argsort([table["step_time_s"].mean() for table in tables])
        middle = int(order[(len(order) - 1) // 2])
        reports, tables = [reports[middle]], [tables[middle]]
    steps = pd.concat(tables, ignore_index=True)
    return Side(reports, steps, pooling, _resample(steps, seed))


def step_table(report: Report) -> pd.DataFrame:
    """The measured steps of a run; of a plain torch.profiler trace (no run), its profiler steps' times."""
    if report.run is None:
        times = report.summary.measured_step_times
        return pd.DataFrame({"step": times.index.to_numpy(), "step_time_s": times.to_numpy(dtype=float)})
    table = measured_step_table(report.run.query, report.summary.warmup)
    return table.assign(mfu_time_s=table["mfu"] * table["rank_time_s"])


def _resample(steps: pd.DataFrame, seed: int) -> stats.Resampled | None:
    columns = {name: steps[name].to_numpy(dtype=float) for name in RESAMPLED
               if name in steps and len(steps) and np.isfinite(steps[name].to_numpy(dtype=float)).all()}
    if "step_time_s" not in columns or len(steps) < stats.MIN_STEPS:
        return None
    return stats.resample_means(columns, seed=seed)


@dataclass(frozen=True)
class Figure:
    """One compared figure: each run's value (with its interval where it is a mean over steps),
    and B against A: a ratio (unit "×"), a difference in percentage points ("pp"), or None."""

    name: str
    unit: str
    a: stats.Interval | float | None
    b: stats.Interval | float | None
    change: stats.Interval | float | None
    change_unit: str
    call: str
    better: str | None  # "a", "b", "same" (within the noise), None (no winner to name)

    def to_dict(self) -> dict:
        def plain(value):
            return value.to_dict() if isinstance(value, stats.Interval) else value
        return {"name": self.name, "unit": self.unit, "a": plain(self.a), "b": plain(self.b),
                "change": plain(self.change), "change_unit": self.change_unit, "call": self.call,
                "better": self.better}


def _interval(estimate: stats.Estimate | None, confidence: float):
    if estimate is None:
        return None
    return estimate.interval(confidence) if estimate.replicates is not None else estimate.point


def _pair(a: stats.Estimate | None, b: stats.Estimate | None, how: str) -> stats.Estimate | None:
    if a is None or b is None or (how == "ratio" and a.point == 0):
        return None
    if a.replicates is None or b.replicates is None:
        return stats.Estimate(b.point / a.point if how == "ratio" else b.point - a.point, None)
    return b / a if how == "ratio" else b - a


def call_of(change, neutral: float, direction: str | None) -> tuple[str, str | None]:
    """What an interval of B against A says: a winner when it excludes `neutral`, else the noise."""
    if not isinstance(change, stats.Interval):
        return ("not resampled", None) if change is not None else ("unknown", None)
    if change.contains(neutral):
        return "within the noise", "same"
    b_higher = change.low > neutral
    if direction is None:
        return ("higher in B" if b_higher else "lower in B"), None
    b_better = b_higher == (direction == "higher")
    return ("B better" if b_better else "A better"), ("b" if b_better else "a")


def mean_figure(name: str, unit: str, a, b, direction: str, confidence: float, how: str = "ratio") -> Figure:
    change = _interval(_pair(a, b, how), confidence)
    call, better = call_of(change, 1.0 if how == "ratio" else 0.0, direction)
    return Figure(name, unit, _interval(a, confidence), _interval(b, confidence), change,
                  "×" if how == "ratio" else "pp", call, better)


def _over(numerator, denominator, scale: float = 1.0):
    if numerator is None or denominator is None or denominator.point == 0:
        return None
    return (numerator / denominator) * scale


def mfu_bases(a: Report, b: Report) -> str | None:
    """Why the two runs' MFU are against different peaks, or None when they share one."""
    basis_a, basis_b = (report.meta.get("compute_dtype") for report in (a, b))
    peaks = [report.meta.get("peak_flops_per_s") for report in (a, b)]
    if basis_a == basis_b and peaks[0] == peaks[1]:
        return None
    return f"on different bases (A against the {basis_a or 'unknown'} peak, B against the {basis_b or 'unknown'} peak)"


def figures(a: Side, b: Side, confidence: float) -> list[Figure]:
    rows = [
        mean_figure("Step time, mean", "s", a.mean("step_time_s"), b.mean("step_time_s"), "lower", confidence),
        mean_figure("Throughput", "tokens/s", _over(a.mean("tokens"), a.mean("step_time_s")),
                    _over(b.mean("tokens"), b.mean("step_time_s")), "higher", confidence),
        mfu_figure(a, b, confidence),
    ]
    for phase in SPLIT_PHASES:
        rows.append(mean_figure(f"{phase.capitalize()} share of step time", "%",
                                _over(a.mean(f"{phase}_time_s"), a.mean("rank_time_s"), 100.0),
                                _over(b.mean(f"{phase}_time_s"), b.mean("rank_time_s"), 100.0),
                                None, confidence, how="points"))
    rows.append(peak_memory_figure(a, b))
    return [row for row in rows if row.a is not None or row.b is not None]


def mfu_figure(a: Side, b: Side, confidence: float) -> Figure:
    figure = mean_figure("MFU", "fraction", _over(a.mean("mfu_time_s"), a.mean("rank_time_s")),
                         _over(b.mean("mfu_time_s"), b.mean("rank_time_s")), "higher", confidence)
    bases = mfu_bases(a.report, b.report)
    if bases and figure.a is not None and figure.b is not None:
        return Figure(figure.name, figure.unit, figure.a, figure.b, None, "×", bases, None)
    return figure


def peak_memory_figure(a: Side, b: Side) -> Figure:
    """A peak is one maximum per run, not a mean over steps: no interval, and no winner either."""
    def peak(side_: Side):
        peaks = [report.summary.peak_memory_bytes for report in side_.reports]
        known = [value for value in peaks if value is not None]
        return float(np.median(known)) if known else None
    peak_a, peak_b = peak(a), peak(b)
    ratio = peak_b / peak_a if peak_a and peak_b is not None else None
    return Figure("Peak memory", "bytes", peak_a, peak_b, ratio, "×", "not resampled (a peak)" if ratio else "unknown", None)


@dataclass(frozen=True)
class Numerics:
    """Whether B's numerics regressed against A's: its loss curve above A's beyond the noise
    (`stats.loss_diverges`), or non-finite steps A did not have."""

    loss_shift: stats.Interval | None  # B's loss over A's over the later half of common steps, relative
    diverges: bool
    nonfinite_a: int
    nonfinite_b: int

    @property
    def new_nonfinite(self) -> bool:
        return self.nonfinite_b > self.nonfinite_a

    @property
    def regressed(self) -> bool:
        return self.diverges or self.new_nonfinite

    @property
    def text(self) -> str:
        problems = []
        if self.new_nonfinite:
            problems.append(f"{self.nonfinite_b} non-finite steps in B, {self.nonfinite_a} in A")
        if self.diverges:
            problems.append(f"B's loss {fmt_interval(self.loss_shift, 'rel')} above A's over the later steps")
        if problems:
            return "numerics regressed: " + "; ".join(problems)
        return "numerics unchanged" if self.loss_shift is not None else "loss not compared (too few common steps with a loss)"

    def to_dict(self) -> dict:
        return {"loss_shift": self.loss_shift.to_dict() if self.loss_shift else None, "diverges": self.diverges,
                "nonfinite_steps_a": self.nonfinite_a, "nonfinite_steps_b": self.nonfinite_b,
                "regressed": self.regressed, "text": self.text}


def numerics(a: Side, b: Side, confidence: float) -> Numerics:
    losses = pd.concat([a.loss_by_step(), b.loss_by_step()], axis=1, join="inner").dropna()
    shift = None
    if len(losses) >= 2 * stats.MIN_STEPS:
        shift = stats.loss_shift_interval(losses.iloc[:, 0].to_numpy(), losses.iloc[:, 1].to_numpy(),
                                          confidence=confidence)
    diverges = shift is not None and shift.low > stats.LOSS_TOLERANCE_REL
    return Numerics(shift, diverges, a.nonfinite_steps, b.nonfinite_steps)


@dataclass
class Comparison:
    a_side: Side
    b_side: Side
    confidence: float
    figures: list[Figure]
    differences: list[Difference]
    numerics: Numerics
    appeared: list = field(default_factory=list)
    disappeared: list = field(default_factory=list)
    persisted: list = field(default_factory=list)

    @property
    def a(self) -> Report:
        return self.a_side.report

    @property
    def b(self) -> Report:
        return self.b_side.report

    @property
    def blocking(self) -> list[Difference]:
        return [difference for difference in self.differences if difference.blocks]

    @property
    def host_load(self) -> Difference | None:
        """The contract's host-load term, where one side competed for its cores more than the other."""
        return next((difference for difference in self.differences if difference.term == HOST_LOAD), None)

    @property
    def b_host_no_busier(self) -> bool:
        """Whether B's host took no more from its loop than every run of A's did: load slows a run, it never
        speeds one, so B measured slower there is slower for its own reasons."""
        loads = [report.host_load for report in (*self.a_side.reports, self.b)]
        if any(load is None for load in loads):
            return False
        *a_loads, b_load = loads
        return not any(busier(a_load, b_load) for a_load in a_loads)

    @property
    def slowdown(self) -> stats.Interval | float | None:
        """B's mean step time over A's (above 1: B is slower)."""
        return self.figures[0].change if self.figures and self.figures[0].name == "Step time, mean" else None

    @property
    def conclusion(self) -> str:
        """The one line a comparison leads with."""
        if self.blocking:
            return "A and B are not comparable: " + "; ".join(d.text for d in self.blocking)
        load = f"; {host_load_caution(self.host_load)}" if self.host_load else ""
        return f"{speed_text(self.slowdown)}, {self.numerics.text}{load}"

    def gate(self, max_regression_pct: float = DEFAULT_MAX_REGRESSION_PCT) -> Gate:
        return gate.decide(self, max_regression_pct)

    def to_dict(self, max_regression_pct: float | None = None) -> dict:
        """The body of `gpuprof compare --json` (docs/json-output.md)."""
        body = {
            "conclusion": self.conclusion,
            "confidence": self.confidence,
            "a": side_ref(self.a_side),
            "b": side_ref(self.b_side),
            "figures": [figure.to_dict() for figure in self.figures],
            "contract": {"comparable": not self.blocking,
                         "differences": [difference.to_dict() for difference in self.differences]},
            "numerics": self.numerics.to_dict(),
            "findings": {
                "appeared": [finding.to_dict() for finding in self.appeared],
                "disappeared": [finding.to_dict() for finding in self.disappeared],
                "persisted": self.persisted,
            },
        }
        if max_regression_pct is not None:
            body["gate"] = self.gate(max_regression_pct).to_dict()
        return json_safe(body)


def side_ref(side_: Side) -> dict:
    report = side_.report
    return {"name": report.summary.name, "path": report.summary.path, "verdict": report.verdict.to_dict(),
            "runs": [r.summary.path for r in side_.reports], "pooling": side_.pooling,
            "measured_steps": side_.n_steps,
            "block_steps": side_.resampled.block_steps if side_.resampled else None}


def compare(report_a: Report | list[Report], report_b: Report, *, pooling: str = "pooled",
            confidence: float = stats.DEFAULT_CONFIDENCE) -> Comparison:
    """Run B against run A, or against a baseline of several runs (`pooling`: their steps
    pooled, or the median run); ratios are B over A; findings appear when B has a rule A had not."""
    a_side = side(report_a if isinstance(report_a, list) else [report_a], pooling, seed=0)
    b_side = side([report_b], seed=1)
    rules_a = {finding.rule for report in a_side.reports for finding in report.findings}
    rules_b = {finding.rule for finding in report_b.findings}
    found = list(dict.fromkeys(
        difference for report in a_side.reports
        for difference in (*differences(report.meta, a_side.tokens_per_step, report_b.meta, b_side.tokens_per_step),
                           host_load_difference(report.host_load, report_b.host_load))
        if difference is not None))
    return Comparison(
        a_side=a_side, b_side=b_side, confidence=confidence,
        figures=figures(a_side, b_side, confidence), differences=found,
        numerics=numerics(a_side, b_side, confidence),
        appeared=[finding for finding in report_b.findings if finding.rule not in rules_a],
        disappeared=[finding for report in a_side.reports[:1] for finding in report.findings
                     if finding.rule not in rules_b],
        persisted=sorted(rules_a & rules_b),
    )


# ------------------------------------------------------------------ as people read it (CLI, Markdown, HTML, dashboard)
DISTRIBUTION_QUANTILES = (("p10", 10), ("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))
FIGURE_COLUMNS = ("Figure", "A", "B", "B vs A", "Call")


def figure_rows(comparison: Comparison) -> list[dict[str, str]]:
    """Every figure with its interval and unit; the table says its confidence once."""
    return [dict(zip(FIGURE_COLUMNS, (figure.name, fmt_interval(figure.a, figure.unit, brief=True),
                                      fmt_interval(figure.b, figure.unit, brief=True),
                                      fmt_interval(figure.change, figure.change_unit, brief=True), figure.call)))
            for figure in comparison.figures]


def distribution_rows(comparison: Comparison) -> list[dict[str, str]]:
    """The two runs' measured step times side by side, quantile by quantile."""
    times = [side_.steps["step_time_s"].dropna().to_numpy() for side_ in (comparison.a_side, comparison.b_side)]
    return [{"Step time": label, **{name: figure_text(float(np.percentile(values, q)), "s") if len(values) else MISSING
                                    for name, values in zip("AB", times)}}
            for label, q in DISTRIBUTION_QUANTILES]


def figures_caption(comparison: Comparison) -> str:
    blocks = [side_.resampled.block_steps for side_ in (comparison.a_side, comparison.b_side) if side_.resampled]
    block = f", blocks of {'/'.join(map(str, blocks))} steps" if blocks else ""
    return (f"Means over {comparison.a_side.n_steps} (A) and {comparison.b_side.n_steps} (B) measured steps, "
            f"{100 * comparison.confidence:.0f} % CI in brackets (moving-block bootstrap{block}); "
            f"shares compare in percentage points.")


def contract_lines(comparison: Comparison) -> list[str]:
    """The contract's differences, those that block first; or that the runs agree on all of it."""
    if not comparison.differences:
        return [f"A and B agree on every term of the contract ({', '.join(term.name for term in TERMS)})."]
    ordered = sorted(comparison.differences, key=lambda difference: not difference.blocks)
    return [f"{difference.text}{' (blocks the comparison)' if difference.blocks else ''}" for difference in ordered]
