"""The report of a bare torch.profiler trace (a file, or a folder as tensorboard_trace_handler writes
it), for people who never recorded a gpuprof run: the verdict, the trace-based findings (the rules
registered `on_trace`, the same ones a run's report runs) and the trace analyzer's tables.

    report = build_trace_report("log/run1")     # what `gpuprof trace` prints, and the dashboard shows
    report.verdict, report.findings, report.tables, report.notes

Ranks are analysed apart (gpuprof.analysis.trace.ranks: processes, or a Dask cluster); each rank's
rules run beside its tables in the same worker, and a rule that fires on several ranks is kept once,
at its worst rank. The verdict reads the merged step breakdown, as a run's does its trace windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path

import pandas as pd

from gpuprof.analysis.run.summary import RunSummary, trace_summary
from gpuprof.analysis.trace.loader import trace_files, trace_spans
from gpuprof.analysis.trace.ranks import analyze_ranks
from gpuprof.analysis.trace.tables import TABLE_NAMES, VIEW_NEEDS, missing_note, missing_views
from gpuprof.diagnoses.context import DEVICE_FIGURES, trace_context, trace_meta
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import diagnose_context
from gpuprof.report.build import CACHED_REPORTS, TraceWindow, trace_window
from gpuprof.report.format import rank_list
from gpuprof.report.trace_views import steps_notes
from gpuprof.report.verdict import Verdict, decide, with_failed_rules
from gpuprof.run.jsonable import json_safe
from gpuprof.run.reader import run_signature

SCHEMA = "gpuprof.trace"
SCHEMA_VERSION = 1
TOP_ROWS = 10


@dataclass
class TraceReport:
    """Everything gpuprof presents about a bare trace; `build_trace_report` makes it."""

    path: str
    files: list[Path]
    summary: RunSummary
    verdict: Verdict
    findings: list[Finding]
    tables: dict[str, pd.DataFrame]
    ranks: list[int]
    has_device_activity: bool
    include_last_step: bool
    missing_ranks: list[int] = field(default_factory=list)
    unreadable: list[dict] = field(default_factory=list)
    # The trace windows of the folder (one list of files per span); the report is of `files`, the last.
    spans: list[list[Path]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # What the trace records of its world and devices, in a run meta's keys (diagnoses.context.trace_meta).
    meta: dict = field(default_factory=dict)
    signature: tuple = ()
    # The plugin's views the trace lacks the profiler option of (tables.VIEW_NEEDS), e.g. "Memory".
    missing_views: list[str] = field(default_factory=list)
    # A bare trace, not a gpuprof run: presenters say what only a run records (steps, NVML, numerics).
    bare_trace = True
    run = None
    host_load = None  # a trace records no system samples
    blames = blame_chain = pd.DataFrame()

    @property
    def name(self) -> str:
        return Path(self.path).name

    def findings_in(self, category: str) -> list[Finding]:
        return [finding for finding in self.findings if finding.category == category]

    @cached_property
    def trace_windows(self) -> list[TraceWindow]:
        """One window per span (all its workers as ranks), oldest first; the reported span reuses its tables."""
        return [TraceWindow(span_name(number), files, self.tables) if files == self.files
                else trace_window(span_name(number), files) for number, files in enumerate(self.spans, start=1)]

    def to_dict(self) -> dict:
        """The `gpuprof trace --json` document (docs/json-output.md)."""
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "path": self.path,
            "files": [str(file) for file in self.files],
            "ranks": self.ranks,
            "missing_ranks": self.missing_ranks,
            "unreadable_files": self.unreadable,
            "has_device_activity": self.has_device_activity,
            "include_last_step": self.include_last_step,
            "verdict": self.verdict.to_dict(),
            "findings": [finding.to_dict() for finding in self.findings],
            "notes": self.notes,
            "missing_views": {view: VIEW_NEEDS[view][1] for view in self.missing_views},
            "tables": {key: json_safe(table.to_dict("records")) for key, table in self.tables.items()},
        }


def rank_findings(analysis) -> dict:
    """One rank's trace-based findings and what its trace records of devices and world (the worker's part)."""
    name = str(analysis.trace.ranks[analysis.ranks[0]].path)
    failures: list[str] = []
    findings = diagnose_context(trace_context(analysis, name, name), failures=failures)
    return {"findings": findings, "failures": failures, "meta": trace_meta(analysis)}


def build_trace_report(path, *, include_last_step: bool = False, top: int = TOP_ROWS, jobs: int | None = None,
                       scheduler: str | None = None) -> TraceReport:
    """The report of the trace at `path`: a file, a folder of per-rank files, or a folder of
    tensorboard_trace_handler spans (the latest span is reported)."""
    listed = trace_files(path)
    spans = trace_spans(listed)
    files = spans[-1]
    result = analyze_ranks(files, table_names=TABLE_NAMES,
                           jobs=jobs, scheduler=scheduler, include_last_step=include_last_step, top=top,
                           per_rank=rank_findings)
    per_rank = [result.extras[rank] for rank in result.ranks]
    # The world the traces record (distributedInfo), else one rank per worker file.
    world_size = max(len(result.ranks), *(extra["meta"]["world_size"] for extra in per_rank))
    meta = {**per_rank[0]["meta"], "world_size": world_size}
    steps = result.tables["step_breakdown"]
    summary = trace_summary(Path(path).name, str(path), steps, meta, DEVICE_FIGURES)
    findings = worst_per_rule({rank: extra["findings"] for rank, extra in zip(result.ranks, per_rank)})
    failed_rules = list(dict.fromkeys(failure for extra in per_rank for failure in extra["failures"]))
    verdict = with_failed_rules(decide(summary, findings, steps, result.has_device_activity, meta), failed_rules)
    return TraceReport(
        path=str(path), files=files, summary=summary, verdict=verdict, findings=findings,
        tables=result.tables, ranks=result.ranks, has_device_activity=result.has_device_activity,
        include_last_step=include_last_step, missing_ranks=result.missing_ranks, unreadable=result.unreadable,
        spans=spans, notes=failed_rules + notes(result, spans, include_last_step) + unspanned_note(listed, spans),
        meta=meta,
        missing_views=missing_views(result.tables),
    )


def diff_of(path_a, path_b, *, include_last_step: bool = False) -> pd.DataFrame:
    """Trace B (a file or folder; a plugin folder's latest span) against trace A by op and by kernel
    (gpuprof.analysis.trace.diff, as HTA's trace_diff)."""
    from gpuprof.analysis.trace import TraceAnalysis
    from gpuprof.analysis.trace.diff import trace_diff

    a, b = (TraceAnalysis(trace_spans(trace_files(path))[-1], include_last_step=include_last_step)
            for path in (path_a, path_b))
    return trace_diff(a, b)


def diff_to_dict(path_a, path_b, diff: pd.DataFrame) -> dict:
    """The `diff` entry of `gpuprof trace --diff --json`'s document (docs/json-output.md)."""
    return {"a": str(path_a), "b": str(path_b), "rows": json_safe(diff.to_dict("records"))}


def span_name(number: int) -> str:
    return f"span {number}"


def trace_folder_report(path) -> TraceReport:
    """The report of a folder of plain traces, computed once per state of its files (the dashboard's)."""
    path = Path(path).resolve()
    return _folder_report(str(path), run_signature(path))


@lru_cache(maxsize=CACHED_REPORTS)
def _folder_report(path: str, signature: tuple) -> TraceReport:
    # One process: the dashboard's server analyses a folder's ranks itself.
    return replace(build_trace_report(path, jobs=1), signature=signature)


def worst_per_rule(by_rank: dict[int, list[Finding]]) -> list[Finding]:
    """Each rule's finding at the rank where it is worst, with the ranks it fired on when more than one."""
    fired: dict[str, list[tuple[int, Finding]]] = {}
    for rank, findings in by_rank.items():
        for finding in findings:
            fired.setdefault(finding.rule, []).append((rank, finding))
    kept = []
    for items in fired.values():
        _, worst = min(items, key=lambda item: item[1].sort_key)
        if len(items) > 1:
            worst = replace(worst, evidence={**worst.evidence, "ranks_with_finding": [rank for rank, _ in items]})
        kept.append(worst)
    return sorted(kept, key=lambda finding: finding.sort_key)


def unspanned_note(files: list[Path], spans: list[list[Path]]) -> list[str]:
    """The files of a tensorboard_trace_handler folder that no span holds (named otherwise), in one line."""
    spanned = {file for span in spans for file in span}
    left = [file.name for file in files if file not in spanned]
    if not left:
        return []
    return [f"Left out: {', '.join(left)} (not named WORKER.TIMESTAMP.pt.trace.json[.gz] as tensorboard_trace_handler "
            "named the other files here; gpuprof trace FILE reads one alone)."]


def notes(result, spans: list[list[Path]], include_last_step: bool) -> list[str]:
    """What a reader of the report should know about what it covers."""
    lines = [f"Rank file {item['file']} could not be read and is left out: {item['error']}" for item in result.unreadable]
    if len(spans) > 1:
        lines.append(f"{len(spans)} trace windows (profiler spans) in this folder: the latest is reported; "
                     "the dashboard shows each")
    if result.missing_ranks:
        missing = result.missing_ranks
        lines.append(f"{len(missing)} rank(s) of the recorded world size have no readable trace here: "
                     f"{rank_list(missing)}")
    if not result.has_device_activity:
        lines.append("No device (GPU) activity in this trace: device analyses are empty; CPU side reported.")
    lines += steps_notes(result.tables["overview"]["profiler_steps"], include_last_step)
    return lines + [missing_note(view) for view in missing_views(result.tables)]
