"""One run's report: summary, verdict, ranked findings, trace tables and numerics blames,
computed once per state of the run's files and shared by every presenter.

    report = build_report("runs/exp1")   # cached by the run's signature (name, size, mtime of its files)
    report.verdict, report.summary, report.findings, report.trace_windows, report.blames
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path

import pandas as pd

from gpuprof.analysis.run.host_load import HostLoad
from gpuprof.analysis.run.hotspots import OUTSIDE_MODEL, top_sites
from gpuprof.analysis.run.ranks import never_finished, outcome_text
from gpuprof.analysis.run.summary import RunSummary, slowest_ranks
from gpuprof.analysis.trace import TraceAnalysis
from gpuprof.analysis.trace.ranks import analysis_tables
from gpuprof.analysis.trace.tables import TABLE_NAMES
from gpuprof.diagnoses.context import RunContext
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import diagnose_context
from gpuprof.errors import GpuprofError
from gpuprof.report.verdict import Verdict, decide, with_failed_rules
from gpuprof.run.jsonable import json_safe
from gpuprof.run.reader import Run, load_run, refuse_without_steps_files, run_signature
from gpuprof.run.schema import EventKind

log = logging.getLogger(__name__)

# Reports kept in memory (the dashboard's runs); a run whose files change gets a new one.
CACHED_REPORTS = 32
# Rows of the top-N trace tables (top kernels, top CPU ops).
TOP_ROWS = 10
# Events this many steps before the first non-finite one are the chain that led to it.
CHAIN_STEPS_BEFORE = 5
CHAIN_COLUMNS = ["time_unix_s", "step", "rank", "kind", "severity", "message"]


@dataclass
class TraceWindow:
    """One trace window of the run (`traces/steps-A-B/`, a file per rank): the trace analyzer's
    tables (`gpuprof.analysis.trace.tables`), or why its files could not be analysed."""

    name: str
    files: list[Path]
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    error: str | None = None

    @property
    def has_device_activity(self) -> bool:
        overview = self.tables.get("overview")
        return overview is not None and bool(overview["has_device_activity"].any())


@dataclass
class Report:
    """Everything gpuprof presents about one run; `build_report` makes it."""

    run: Run
    signature: tuple
    summary: RunSummary
    verdict: Verdict
    findings: list[Finding]
    trace_windows: list[TraceWindow]
    # The `nonfinite` events (where a value first went NaN/Inf, the blame in `details`), and the
    # events of the steps leading to the first of them.
    blames: pd.DataFrame
    blame_chain: pd.DataFrame
    # Each phase's share split among the user's functions, from the stack samples (gpuprof.analysis.run.hotspots).
    hotspots: pd.DataFrame = field(default_factory=pd.DataFrame)
    # Rules that failed ("rule X failed: ..."), then what the reader had to skip (a torn last line, a
    # damaged rank file), for people.
    notes: tuple[str, ...] = ()
    # A gpuprof run (a bare trace's report, trace_report.TraceReport, is the other kind presenters show).
    bare_trace = False
    # How each rank ended, and the watchdog's `hang` events (gpuprof.analysis.run.ranks).
    rank_outcomes: pd.DataFrame = field(default_factory=pd.DataFrame)
    hangs: pd.DataFrame = field(default_factory=pd.DataFrame)
    # What other processes took of the first rank's host while it trained; None where not recorded.
    host_load: HostLoad | None = None

    @property
    def name(self) -> str:
        return self.run.name

    @property
    def meta(self) -> dict:
        return self.run.meta

    @cached_property
    def stopped_ranks(self) -> pd.DataFrame:
        """The rows of `rank_outcomes` whose rank failed or was killed, each described in words (`described`)."""
        stopped = never_finished(self.rank_outcomes) if not self.rank_outcomes.empty else self.rank_outcomes
        return stopped.assign(described=[outcome_text(row) for row in stopped.to_dict(orient="records")])

    @cached_property
    def distinct_hangs(self) -> pd.DataFrame:
        """The watchdog's `hang` events, one per message (every rank writes the same hang)."""
        return self.hangs.drop_duplicates("message") if not self.hangs.empty else self.hangs

    @cached_property
    def ranks_by_slowness(self) -> pd.DataFrame:
        """Every rank, the straggler first, against the median rank (`slowest_ranks`)."""
        return slowest_ranks(self.summary.per_rank, len(self.summary.per_rank))

    @cached_property
    def outside_model_sites(self) -> dict[str, pd.DataFrame]:
        """For the phases outside the model (data, eval, other): the user's functions holding their time."""
        return {phase: top_sites(self.hotspots, phase) for phase in OUTSIDE_MODEL}

    def findings_in(self, category: str) -> list[Finding]:
        return [finding for finding in self.findings if finding.category == category]

    def to_dict(self) -> dict:
        """The body of `gpuprof analyze --json` (docs/json-output.md)."""
        return {"summary": self.summary.to_dict(), "verdict": self.verdict.to_dict(),
                "findings": [finding.to_dict() for finding in self.findings],
                "ranks": json_safe(self.rank_outcomes.to_dict(orient="records")),
                "hangs": json_safe(self.hangs.to_dict(orient="records")),
                "hotspots": json_safe(self.hotspots.to_dict(orient="records")),
                "host_load": json_safe(self.host_load.to_dict()) if self.host_load is not None else None}


def build_report(run_dir) -> Report:
    """The report of the run at `run_dir`, computed once per state of its files."""
    run = load_run(run_dir)
    refuse_without_steps_files(run)
    path = run.path.resolve()
    return _report(str(path), run_signature(path))


@lru_cache(maxsize=CACHED_REPORTS)
def _report(path: str, signature: tuple) -> Report:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = load_run(path)
        context = RunContext.of(run)
        failed_rules: list[str] = []
        findings = diagnose_context(context, failures=failed_rules)
        windows = trace_windows(context)
        events = run.query.frame("events")
    read_notes = [str(w.message) for w in caught if "gpuprof" in str(w.message)]
    notes = tuple(dict.fromkeys([*failed_rules, *read_notes]))
    blames = events[events["kind"] == EventKind.NONFINITE]
    verdict = with_failed_rules(decide(context.summary, findings, *traced_steps(windows), run.meta, context.hotspots),
                                failed_rules)
    return Report(
        run=run, signature=signature, summary=context.summary, verdict=verdict, findings=findings,
        trace_windows=windows, blames=blames, blame_chain=blame_chain(events, blames), notes=notes,
        rank_outcomes=context.rank_outcomes, hangs=context.hangs, hotspots=context.hotspots,
        host_load=context.host_load,
    )


def trace_windows(context) -> list[TraceWindow]:
    """Every trace window analysed; a run's only window reuses the diagnoses' analysis of its files."""
    windows = context.run.trace_windows
    shared = context.trace if len(windows) == 1 else None
    return [trace_window(name, files, shared) for name, files in windows.items()]


def trace_window(name: str, files: list[Path], analysis=None) -> TraceWindow:
    """The trace analyzer's tables of `files` (one window, all its ranks), or its one-line error."""
    try:
        analysis = analysis or TraceAnalysis(files)
        return TraceWindow(name, files, analysis_tables(analysis, TABLE_NAMES, TOP_ROWS))
    except GpuprofError as error:
        return TraceWindow(name, files, error=str(error))
    except Exception as error:  # noqa: BLE001 - a trace the analyzer trips on must not hide the rest of the report
        log.warning("trace window %s not analysed", name, exc_info=True)
        return TraceWindow(name, files, error=f"could not be analysed ({type(error).__name__}: {error})")


def traced_steps(windows: list[TraceWindow]) -> tuple[pd.DataFrame, bool]:
    """The step breakdown of every readable window, and whether any of them saw device activity."""
    readable = [window for window in windows if window.error is None]
    frames = [window.tables["step_breakdown"] for window in readable if not window.tables["step_breakdown"].empty]
    steps = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return steps, any(window.has_device_activity for window in readable)


def blame_chain(events: pd.DataFrame, blames: pd.DataFrame) -> pd.DataFrame:
    """The events from `CHAIN_STEPS_BEFORE` steps before the first blamed step to the step after it,
    and those tied to no step, in time order."""
    first_step = pd.to_numeric(blames["step"], errors="coerce").min()
    if pd.isna(first_step):
        return events.iloc[:0][CHAIN_COLUMNS]
    steps = pd.to_numeric(events["step"], errors="coerce")
    near = (steps >= first_step - CHAIN_STEPS_BEFORE) & (steps <= first_step + 1) | steps.isna()
    return events[near].sort_values("time_unix_s")[CHAIN_COLUMNS]
