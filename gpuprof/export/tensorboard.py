"""A recorded run as TensorBoard event files: every step's figures, the device and host samples, the events and the
verdict, one TensorBoard run (folder) per rank, written with torch's own `SummaryWriter`.

Tags: `steps/<column>` at the optimizer step (every number and flag of the steps stream: step and phase times,
tokens/s, MFU, loss, grad norm, GradScaler, LR, memory); `system/<column>` at the sample's index, its wall time the
sample's; `events` and `verdict` as text. Exporting again replaces the folder's earlier export, so no value is
written twice; a folder gpuprof did not write is refused, never emptied.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd

from gpuprof.errors import GpuprofError
from gpuprof.export.rows import of_rank
from gpuprof.report import build_report
from gpuprof.run import schema

# Written into the export's folder: the sign that gpuprof may replace it.
MARKER = ".gpuprof-export"


def export_tensorboard(run_dir, out_dir) -> Path:
    """Writes the run at `run_dir` under `out_dir` (one folder per rank); returns `out_dir`."""
    writer_class = _summary_writer()
    report = build_report(run_dir)
    out = Path(out_dir)
    _clear_previous_export(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(f"gpuprof export of {report.run.path}\n")
    run = report.run
    for rank in run.ranks or [0]:
        writer = writer_class(log_dir=str(out / schema.rank_dir_name(rank)))
        try:
            steps, system = of_rank(run.steps, rank), of_rank(run.system, rank)
            _write_scalars(writer, "steps", steps, steps["step"])
            _write_scalars(writer, "system", system, range(len(system)))
            _write_events(writer, of_rank(run.events, rank))
            _write_verdict(writer, report, _last_step(run.steps))
        finally:
            writer.close()
    return out


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise GpuprofError("the TensorBoard export needs the tensorboard package: "
                           "pip install 'gpuprof[tensorboard]'") from None
    return SummaryWriter


def _clear_previous_export(out: Path) -> None:
    if not out.exists():
        return
    if not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file()):
        raise GpuprofError(f"{out} exists and was not written by gpuprof export: give another --out")
    shutil.rmtree(out)


def _last_step(steps: pd.DataFrame) -> int:
    return int(steps["step"].max()) if not steps.empty else 0


def _write_scalars(writer, stream: str, rows: pd.DataFrame, positions) -> None:
    """Every measured column of `rows` as `<stream>/<column>` scalars at `positions` (steps, or sample indices),
    each at its row's wall time."""
    for column in schema.measured_columns(stream):
        if column not in rows:
            continue
        values = pd.to_numeric(rows[column], errors="coerce").astype("float64")
        for position, time_unix_s, value in zip(positions, rows["time_unix_s"], values):
            if pd.notna(value):
                writer.add_scalar(f"{stream}/{column}", float(value), int(position), walltime=float(time_unix_s))


def _write_events(writer, events: pd.DataFrame) -> None:
    for row in events.to_dict(orient="records"):
        step = int(row["step"]) if pd.notna(row["step"]) else 0
        writer.add_text("events", f"**{row['severity']}** `{row['kind']}`: {row['message']}", step,
                        walltime=float(row["time_unix_s"]))


def _write_verdict(writer, report, step: int) -> None:
    verdict = report.verdict
    findings = [f"{number}. **{finding.severity}** {finding.rule}: {finding.title}"
                for number, finding in enumerate(report.findings, start=1)]
    text = "\n\n".join([f"**{verdict.headline}**", verdict.why, f"Next: {verdict.next_step}", *findings])
    writer.add_text("verdict", text, step)
