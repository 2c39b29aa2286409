"""Plain-text rendering of reports and comparisons for `analyze` and `compare`.

Only rendering lives here: every figure comes from the run's report (gpuprof.report).
"""

from __future__ import annotations

import json
import sys

from gpuprof.report.format import EVIDENCE_WIDTH, evidence_line, figure, gain_text, rank_list

JSON_SCHEMA_VERSION = 1
# Past this many ranks the text report lists the slowest ones only (--json has every rank).
PER_RANK_LINES_MAX = 16
EVIDENCE_PREFIX = "       evidence: "


def verdict_lines(verdict) -> list[str]:
    return [f"Verdict: {verdict.headline}", f"  why         {verdict.why}", f"  next        {verdict.next_step}"]


def stopped_lines(report) -> list[str]:
    """The ranks that never finished and the hangs the watchdog recorded (none for a run that finished)."""
    lines = []
    stopped = report.stopped_ranks
    if not stopped.empty:
        lines.append(f"  ranks       {len(stopped)} of {len(report.rank_outcomes)} never finished:")
        lines += [f"              {described}" for described in stopped["described"].head(PER_RANK_LINES_MAX)]
    hangs = report.distinct_hangs
    for row in hangs[~hangs["ended"]].head(PER_RANK_LINES_MAX).to_dict(orient="records") if not hangs.empty else []:
        lines.append(f"  hang        step {row['step']:.0f}, seen by rank {row['rank']}: {row['message']}")
    return lines


def print_notes(report) -> None:
    """What the reader had to skip in the run's files, on stderr (stdout stays the report)."""
    for note in report.notes:
        print(note, file=sys.stderr)


def summary_lines(summary) -> list[str]:
    from gpuprof.run.schema import SPLIT_PHASES  # lazily: the CLI parser imports this module

    health = summary.health
    phases = "  ".join(f"{phase} {figure(summary.phase_split_pct.get(phase), '%')}" for phase in SPLIT_PHASES)
    gpu_note = "" if summary.device_kind == "cuda" else " (CPU run)"
    return [
        f"Run {summary.name}  ({summary.status}, {summary.world_size} rank(s), {summary.device_name or summary.device_kind})",
        f"  path        {summary.path}",
        f"  steps       {summary.n_steps} recorded; warm-up excluded from step times: {summary.warmup.n_steps}"
        f" ({summary.warmup.reason})",
        f"  step time   p50 {figure(summary.step_time_p50_s, 's')}   p90 {figure(summary.step_time_p90_s, 's')}"
        f"   p99 {figure(summary.step_time_p99_s, 's')}   cv {figure(summary.step_time_cv)}"
        f"{'   (evaluation left out)' if summary.evaluation else ''}",
        f"  throughput  {figure(summary.tokens_per_s, 'tokens/s')}   MFU {figure(None if summary.mfu is None else 100 * summary.mfu, '%')}"
        f"   achieved {figure(None if summary.flops_per_s is None else summary.flops_per_s / 1e9, 'GFLOP/s')}",
        f"  memory      peak allocated {figure(summary.peak_mem_allocated_bytes, 'bytes')}"
        f"   device total {figure(summary.device_mem_total_bytes, 'bytes')}"
        f"   peak process RSS {figure(summary.peak_rss_bytes, 'bytes')}"
        f"   GPU utilization {figure(summary.gpu_util_mean_pct, '%')}{gpu_note}",
        f"  phases      {phases}  (of the training step)",
        *_evaluation_lines(summary.evaluation),
        f"  health      loss {figure(health['loss_first'])} -> {figure(health['loss_last'])}"
        f"   non-finite loss/grad steps {figure(health['nonfinite_loss_steps'])}/{health['nonfinite_grad_steps']}"
        f"   skipped steps {health['skipped_steps']}   grad norm p50 {figure(health['grad_norm_p50'])}"
        f" max {figure(health['grad_norm_max'])}",
    ] + _missing_lines(summary.missing_ranks)


def _evaluation_lines(evaluation: dict) -> list[str]:
    if not evaluation:
        return []
    every = f"every {figure(evaluation['every_steps'])} steps, " if evaluation["every_steps"] is not None else ""
    return [f"  evaluation  {evaluation['steps_with_eval']} step(s) evaluated, {every}"
            f"{figure(evaluation['mean_s'], 's')} each, "
            f"{figure(evaluation['share_pct'], '%')} of the run's time (not in the phases above)"]


def hotspot_lines(report) -> list[str]:
    """The user's functions holding the time outside the model, per phase (from the stack samples)."""
    lines = []
    for phase, rows in report.outside_model_sites.items():
        named = ", ".join(f"{figure(share, '%')} in {label}" for share, label in zip(rows["share_pct"], rows["label"]))
        if named:
            lines.append(f"  {phase + ' in':<11} {named}")
    return lines


def _missing_lines(missing: list[int]) -> list[str]:
    if not missing:
        return []
    return [f"  missing     {len(missing)} rank(s) left no readable steps and are not in these figures: "
            f"{rank_list(missing)}"]


def per_rank_lines(report) -> list[str]:
    summary = report.summary
    table = summary.per_rank
    if table.empty or len(table) < 2:
        return []
    if len(table) > PER_RANK_LINES_MAX:  # the slowest first
        order = report.ranks_by_slowness["rank"].head(PER_RANK_LINES_MAX)
        table = summary.per_rank.set_index("rank").loc[order].reset_index()
    lines = ["  per rank    rank  step p50   data p50   forward p50  backward p50  tokens/s"]
    for row in table.to_dict(orient="records"):
        lines.append(
            f"              {row['rank']:>4}  {figure(row['step_time_p50_s'], 's'):>9}  {figure(row['data_time_p50_s'], 's'):>9}"
            f"  {figure(row['forward_time_p50_s'], 's'):>11}  {figure(row['backward_time_p50_s'], 's'):>12}  {figure(row['tokens_per_s']):>8}"
        )
    if len(table) < len(summary.per_rank):
        lines.append(f"              ... {len(summary.per_rank) - len(table)} more ranks (the slowest are shown; --json has all)")
    return lines


def finding_lines(findings, *, marker: str = "") -> list[str]:
    lines = []
    for number, finding in enumerate(findings, start=1):
        gain = f"   [{gain_text(finding.est_gain_pct)}]" if gain_text(finding.est_gain_pct) else ""
        lines += [
            f"  {marker}{number}. {finding.severity.upper():8} {finding.rule}: {finding.title}{gain}",
            EVIDENCE_PREFIX + evidence_line(finding.to_dict()["evidence"], EVIDENCE_WIDTH - len(EVIDENCE_PREFIX)),
            f"       fix: {finding.fix}",
        ]
    return lines


def add_json_flag(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the stable JSON form (docs/json-output.md)")


def print_json(command: str, payload: dict, version: int = JSON_SCHEMA_VERSION) -> None:
    """The --json document of `command`, in the envelope docs/json-output.md specifies."""
    document = {"schema": f"gpuprof.{command}", "schema_version": version, **payload}
    print(json.dumps(document, indent=2, sort_keys=True, allow_nan=False))
