"""What the dashboard's pages say that no other presenter does: the Compare page's key figures with their
intervals, a NaN blame as rows a person reads (magnitudes, the source's file by its name, the cause in
words), the events around it, whether a replay bundle can be offered, what the Memory page says of a run without a snapshot, and an uploaded file's error in its own name.
Computed here; the pages only render it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from gpuprof.analysis.run.stats import Interval
from gpuprof.report.comparison import call_of
from gpuprof.report.format import MISSING, ci_text, field_text, figure_text, known, present, value_text
from gpuprof.run.schema import bundle_in_run, in_installed_package, source_text

WITHIN_THE_NOISE = "within the noise"


@dataclass(frozen=True)
class Kpi:
    """One key figure of a comparison: its value, its interval ("95 % CI 1.31–1.55×", None when not resampled)
    and the call its interval makes ("B better", "within the noise", ...)."""

    label: str
    value: str
    interval: str | None
    call: str

    @property
    def within_the_noise(self) -> bool:
        return self.call == WITHIN_THE_NOISE

    @property
    def note(self) -> str:
        """What the figure's small print says: its interval and, where it names no winner, why."""
        return " · ".join(part for part in (self.interval, self.call if self.within_the_noise else None) if part)


def compare_kpis(comparison) -> list[Kpi]:
    """The Compare page's key figures: the speedup (B over A by mean step time), throughput and peak memory."""
    by_name = {figure.name: figure for figure in comparison.figures}
    slowdown = comparison.slowdown
    speedup = slowdown.inverted() if isinstance(slowdown, Interval) else None
    kpis = [_kpi("Speedup (B over A, mean step time)", speedup, call_of(speedup, 1.0, "higher")[0])]
    for name, label in (("Throughput", "Throughput (B/A)"), ("Peak memory", "Peak memory (B/A)")):
        figure = by_name.get(name)
        kpis.append(_kpi(label, figure.change if figure else None, figure.call if figure else "unknown"))
    return kpis


def _kpi(label: str, ratio, call: str) -> Kpi:
    interval = isinstance(ratio, Interval)
    return Kpi(label, figure_text(ratio.point if interval else ratio, "×"), ci_text(ratio, "×") if interval else None,
               call)


# ------------------------------------------------------------------------------------------------ NaN blames
# A blame's fields in reading order: where, what, the tensor; the source and cause have rows of their own.
BLAME_FIELDS = ("step", "rank", "phase", "module", "op", "first", "tensor", "dtype", "shape", "nonfinite_count",
                "input_absmax", "micro_batch", "trigger")
LARGE, SMALL = 1e6, 1e-3  # past these a magnitude reads in scientific notation (4.6e24)


def magnitude_text(value) -> str:
    """A magnitude as people read it: "4.6e24", "3.2e-07", "1,234.5", "0.25"."""
    if not known(value):
        return MISSING
    value = float(value)
    if value and not SMALL <= abs(value) < LARGE:
        mantissa, exponent = f"{value:.2g}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.1f}"


def source_rows(details: dict) -> list[tuple[str, str]]:
    """The line to start at, the user's own, with the installed library's line that ran the op behind it; a
    library's alone, labelled so, where that is all the blame recorded (a run recorded before model calls kept
    their caller's line)."""
    source, behind = details.get("source"), details.get("library_source")
    if not source:
        return []
    rows = [("source (a library's)" if in_installed_package(source) else "start at", source_text(source))]
    return rows + ([("in the library", source_text(behind))] if behind else [])


def blame_rows(step, rank, details: dict) -> list[tuple[str, str]]:
    """(field, value) rows of one non-finite event: where it happened, the tensor, the line to start at, the
    cause found in words."""
    fields = {"step": step, "rank": rank, **{name: details.get(name) for name in BLAME_FIELDS[2:]}}
    rows = [(field_text(name), _blame_value(name, value)) for name, value in fields.items() if known(value)]
    rows += source_rows(details)
    cause = details.get("cause")
    if isinstance(cause, dict) and cause.get("summary"):
        rows.append(("cause", cause["summary"]))
    return rows


def _blame_value(name: str, value) -> str:
    if name == "shape" and isinstance(value, (list, tuple)):
        return " × ".join(map(str, value))
    if name == "input_absmax":
        return magnitude_text(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return value_text(value)


def replay_bundle(run_path, details: dict) -> Path | None:
    """The blame's replay bundle where this copy of the run holds it; None when it holds none (a shared copy
    leaves bundles out: they hold the model and optimizer state)."""
    recorded = details.get("bundle")
    bundle = bundle_in_run(run_path, recorded) if recorded else None
    return bundle if bundle is not None and bundle.is_file() else None


# ------------------------------------------------------------------------------------------------ memory
def snapshot_hint(meta: dict) -> str:
    """The Memory page's one line for a run without a CUDA memory snapshot."""
    on_cuda = any((device or {}).get("kind") == "cuda" for device in meta.get("devices") or [])
    how = ("call `prof.memory_snapshot()` in the loop (`memory_history=True` in `gpuprof.profile(...)` adds the "
           "allocation timeline); an out-of-memory error writes one too")
    if on_cuda:
        return f"This run has no CUDA memory snapshot: {how}."
    return f"A CUDA memory snapshot is recorded only on a CUDA device, and this run ran on the CPU: there, {how}."


# ------------------------------------------------------------------------------------------------ uploads
def upload_error(error: Exception, saved: Path, name: str) -> str:
    """An uploaded file's error in the file's own name, never the private folder it was saved in."""
    return str(error).replace(str(saved), name).replace(str(saved.parent), "")


# ------------------------------------------------------------------------------------------------ findings
BLAME_EVIDENCE = "origin"  # the evidence of the nonfinite-values finding that holds the blame's details


def evidence_rows(key: str, value: dict) -> list[tuple[str, str]]:
    """A finding's nested evidence as (field, value) rows: a blame as the Numerics page reads it, any other
    as its entries that hold something."""
    if key == BLAME_EVIDENCE:
        return blame_rows(value.get("step"), value.get("rank"), value)
    return [(field_text(name), value_text(item)) for name, item in present(value).items()]


def events_around(chain: pd.DataFrame, blames: pd.DataFrame) -> pd.DataFrame:
    """The events around a blame (Report.blame_chain) without the blames themselves, which the page shows above."""
    shown = set(zip(blames["rank"], blames["step"], blames["message"]))
    return chain[[key not in shown for key in zip(chain["rank"], chain["step"], chain["message"])]]
