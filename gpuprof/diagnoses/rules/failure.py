"""A run that did not finish: a hang the watchdog recorded, ranks that failed or died."""

from __future__ import annotations

from gpuprof.analysis.run.ranks import never_finished, outcome_text, raised_by_itself, raised_where, stopped_after
from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.registry import rule

EVIDENCE_RANKS = 16


@rule("rank-hang", "failure")
def rank_hang(ctx):
    table = ctx.hangs
    open_hangs = table[~table["ended"]] if not table.empty else table
    if open_hangs.empty:
        return None
    # the latest event that names ranks behind: the watchdog of a waiting rank saw the most
    naming = open_hangs[open_hangs["behind_ranks"].map(bool)]
    event = (naming if not naming.empty else open_hangs).iloc[-1]
    behind = [int(rank) for rank in event["behind_ranks"]]
    return Finding(
        rule="rank-hang",
        severity="critical",
        title=f"Hung at step {int(event['step'])}: {event['message']}",
        evidence={
            "step": int(event["step"]), "behind_ranks": behind[:EVIDENCE_RANKS],
            "waiting_ranks": [int(rank) for rank in event["waiting_ranks"]][:EVIDENCE_RANKS],
            "desync": event["desync"], "recorded_by_rank": int(event["rank"]),
            "ranks_that_recorded": sorted({int(rank) for rank in open_hangs["rank"]})[:EVIDENCE_RANKS],
        },
        fix=(f"Read the stack of rank {behind[0] if behind else int(event['rank'])} in its hang event (the Distributed "
             "page, or gpuprof analyze --json): that is where it stopped. For a desync, every rank must make the "
             "same collectives in the same order (no collective under `if rank == 0`)."),
    )


@rule("ranks-never-finished", "failure")
def ranks_never_finished(ctx):
    table = ctx.rank_outcomes
    stopped = never_finished(table)
    if stopped.empty:
        return None
    # A rank that raised stopped by itself; the others it left waiting may have recorded their last step earlier.
    # A rank stopped by torchrun, or raising because a peer's connection broke, stopped because another did.
    raised = stopped["error"].map(raised_by_itself)
    first = stopped.assign(raised=raised).sort_values(["raised", "last_seen_unix_s"], ascending=[False, True],
                                                      na_position="first").iloc[0]
    described = [outcome_text(row) for row in stopped.head(EVIDENCE_RANKS).to_dict(orient="records")]
    alone = len(table) == 1
    if alone and first["raised"]:
        title = f"The script raised {first['error']}{raised_where(first)}, {stopped_after(first)}"
    else:
        title = f"{len(stopped)} of {len(table)} ranks never finished: " + "; ".join(described[:4])
    return Finding(
        rule="ranks-never-finished",
        severity="critical",
        title=title,
        evidence={
            "ranks": [int(rank) for rank in stopped["rank"]][:EVIDENCE_RANKS],
            "status_by_rank": {int(r): s for r, s in zip(stopped["rank"], stopped["status"])},
            "last_step_by_rank": {int(r): s for r, s in zip(stopped["rank"], stopped["last_step"])},
            "first_to_stop": int(first["rank"]),
            "raised": bool(first["raised"]),
            "error": first["error"], "raised_at": first["raised_at"],
        },
        fix=_failure_fix(first, alone),
    )


def _failure_fix(first, alone: bool) -> str:
    """Where to start: the line that raised, when Python saw the failure; else how a process dies unseen."""
    who = "the script" if alone else f"rank {int(first['rank'])} (the first to stop)"
    if first["raised"]:
        return (f"Start from {who} where it raised {first['error']}{raised_where(first)}: its traceback (the "
                "rank_failed event, or the script's own output) shows the call that failed.")
    return (f"Start from {who}: it left no traceback, so the process was killed outside Python (the kernel's OOM "
            "killer: `dmesg`, or a SIGKILL), and the ranks after it were stopped by torchrun.")
