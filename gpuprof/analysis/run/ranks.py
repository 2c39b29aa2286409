"""How each rank's part of a run ended, the hangs the watchdog recorded, and who arrives last under DDP.

A rank's status is what it wrote: `finished`, or `failed` (an exception left its loop, or torchrun
stopped it with SIGTERM; its `rank_failed` event holds the error and the traceback Python saw). A
rank that never closed is `incomplete` once its process is gone (its pid, when the run is read on
the host that recorded it) or its last heartbeat (or record) is older than `STALE_BEATS` beats: it
was killed where Python could not see it (SIGKILL, the OOM killer); `running` while it still beats.
"""

from __future__ import annotations

import socket
import time

import pandas as pd
import psutil

from gpuprof.run import query as q
from gpuprof.run.schema import TERMINATED_ERROR, EventKind

STALE_BEATS = 3
HEARTBEAT_S = 5.0  # when meta.json does not say (a run recorded without the watchdog)
OUTCOME_COLUMNS = ["rank", "status", "last_step", "last_seen_unix_s", "error", "traceback", "raised_at"]
HANG_COLUMNS = ["time_unix_s", "rank", "step", "message", "behind_ranks", "waiting_ranks", "desync", "ended",
                "stacks"]
ARRIVAL_COLUMNS = ["step", "last_rank", "lag_s", "collective", "ranks"]


def rank_outcomes(run, now_unix_s: float | None = None) -> pd.DataFrame:
    """One row per rank folder: its status (its meta.json's, else the run's), last recorded step, when it
    was last seen, and the error, traceback and the loop's line it was raised at of its `rank_failed` event. Ranks
    of the world with no folder are the summary's `missing_ranks`."""
    now_unix_s = time.time() if now_unix_s is None else now_unix_s
    last_step = _per_rank(run, "steps", q.maximum("step"))
    # events too: a rank's rank_failed is when it was last alive, so two ranks that ended the same step
    # (a DDP step ends at once on all) are told apart by which one failed first
    last_seen = pd.concat([_per_rank(run, stream, q.maximum("time_unix_s")) for stream in ("heartbeats", "steps", "events")]
                          ).groupby(level=0).max()
    failures = run.query.frame("events", ["rank", "details"], where=[q.kind_is(EventKind.RANK_FAILED)])
    failed = {int(row["rank"]): row["details"] or {} for row in failures.to_dict(orient="records")}
    stale_s = STALE_BEATS * ((run.meta.get("hang_watchdog") or {}).get("heartbeat_s") or HEARTBEAT_S)
    rows = []
    for rank in run.ranks:
        status = (run.rank_meta.get(rank) or {}).get("status") or run.meta.get("status")
        seen = last_seen.get(rank)
        if status not in ("finished", "failed"):
            beating = seen is not None and now_unix_s - seen <= stale_s
            status = "running" if beating and process_alive(run.rank_meta.get(rank) or {}) else "incomplete"
        failure = failed.get(rank, {})
        rows.append({"rank": rank, "status": status, "last_step": _int_or_none(last_step.get(rank)),
                     "last_seen_unix_s": seen, "error": failure.get("error"), "traceback": failure.get("traceback"),
                     "raised_at": failure.get("raised_at")})
    return pd.DataFrame(rows, columns=OUTCOME_COLUMNS)


# What a collective raises on a rank whose peer died or left (gloo, NCCL, the c10d store): a consequence.
PEER_FAILURE_MARKERS = ("reset by peer", "closed by peer", "Broken pipe", "DistNetworkError", "DistBackendError",
                        "remote process exited", "communicator was aborted", "Connection refused")


def raised_by_itself(error) -> bool:
    """Whether a rank_failed `error` is the rank's own exception: not torchrun's SIGTERM, nor a collective failing
    because a peer died."""
    if not isinstance(error, str) or error == TERMINATED_ERROR:
        return False
    return not any(marker in error for marker in PEER_FAILURE_MARKERS)


def never_finished(outcomes: pd.DataFrame) -> pd.DataFrame:
    return outcomes[outcomes["status"].isin(("failed", "incomplete"))]


def outcome_text(row: dict) -> str:
    """How a rank that never finished ended, for people (a row of `rank_outcomes`)."""
    step = stopped_after(row)
    if row["status"] == "failed":
        return f"rank {row['rank']} failed {step} ({row['error'] or 'no error recorded'}{raised_where(row)})"
    return f"rank {row['rank']} stopped {step} with no traceback (killed outside Python: SIGKILL, the OOM killer)"


def stopped_after(row: dict) -> str:
    """When a rank stopped, by its last recorded step (a row of `rank_outcomes`)."""
    return f"after step {row['last_step']}" if row["last_step"] is not None else "before its first step"


def raised_where(row: dict) -> str:
    """" at train (train.py:91)": the loop's line the rank's exception was raised at, where one was recorded."""
    return f" at {row['raised_at']}" if row.get("raised_at") else ""


def hangs(run) -> pd.DataFrame:
    """The `hang` events, oldest first; `ended`: the rank's step went on afterwards (a `hang_ended`);
    `stacks`: {rank: its main thread's stack as text} of the ranks the event holds stacks of."""
    events = run.query.frame("events", ["time_unix_s", "rank", "step", "kind", "message", "details"],
                             where=[q.kind_is(EventKind.HANG, EventKind.HANG_ENDED)])
    rows = []
    for event in events.to_dict(orient="records"):
        if event["kind"] != EventKind.HANG:
            continue
        later = events[(events["kind"] == EventKind.HANG_ENDED) & (events["rank"] == event["rank"])
                       & (events["time_unix_s"] > event["time_unix_s"])]
        details = event["details"] or {}
        rows.append({"time_unix_s": event["time_unix_s"], "rank": int(event["rank"]), "step": event["step"],
                     "message": event["message"], "behind_ranks": details.get("behind_ranks") or [],
                     "waiting_ranks": details.get("waiting_ranks") or [], "desync": details.get("desync"),
                     "ended": not later.empty, "stacks": {int(rank): stack_text(view["stack"])
                                                          for rank, view in (details.get("ranks") or {}).items()
                                                          if view.get("stack")}})
    return pd.DataFrame(rows, columns=HANG_COLUMNS)


def stack_text(frames: list[dict]) -> str:
    """A stack of a hang event as a Python traceback's lines, outermost first."""
    return "\n".join(f'  File "{f["file"]}", line {f["line"]}, in {f["function"]}' + (f"\n    {f['code']}" if f["code"] else "")
                     for f in frames)


def last_arrivals(run) -> pd.DataFrame:
    """Per step that more than one rank timed: of the step's collectives, the one where a rank arrived the
    furthest after the median rank (`collective`, from 0), that rank and how many seconds after
    (`collective_arrivals_unix_s`, gpuprof.capture.ddp)."""
    table = run.query.per_step_last("collective_arrivals_unix_s").rename(columns={"event": "collective"})
    return table.rename(columns={"rank": "last_rank", "above_median": "lag_s"})[ARRIVAL_COLUMNS]


def process_alive(rank_meta: dict) -> bool:
    """False when the rank's process is known to be gone: recorded on this host, and its pid is no longer
    the process that started before the rank did; True when it cannot be told from here."""
    pid, started = rank_meta.get("pid"), rank_meta.get("start_unix_s")
    if rank_meta.get("host") != socket.gethostname() or not pid:
        return True
    try:
        return psutil.Process(int(pid)).create_time() <= (started or float("inf"))
    except psutil.NoSuchProcess:
        return False


def _per_rank(run, stream: str, aggregate) -> pd.Series:
    table = run.query.aggregate(stream, {"value": aggregate}, by="rank")
    return table.dropna().set_index("rank")["value"] if not table.empty else pd.Series(dtype=float)


def _int_or_none(value) -> int | None:
    return None if value is None or pd.isna(value) else int(value)
