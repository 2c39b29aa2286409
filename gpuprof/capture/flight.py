"""PyTorch's Flight Recorder: the last collectives of each process group, with their sequence numbers.

gpuprof turns it on (TORCH_FR_BUFFER_SIZE, and TORCH_NCCL_TRACE_BUFFER_SIZE for NCCL) unless the
user chose a size; torch reads the size when it records, so this works after init_process_group.
The hang watchdog reads each process group's last enqueued and completed sequence numbers every beat
(`progress`: no entries, a fraction of a millisecond) and the entries themselves only on a hang (`read`:
2000 entries take tens to hundreds of milliseconds), to name the collective in flight (`in_flight`) and
compare the ranks' entries by sequence number (`first_mismatch`). Read through `_dump_fr_trace_json` (gloo, tested) or `_dump_nccl_trace_json`
(NCCL: the same JSON layout, untested here for want of a GPU).
"""

from __future__ import annotations

import json
import os

from gpuprof.torch_compat import private

BUFFER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
BUFFER_ENTRIES = 2000  # PyTorch's own suggestion for the NCCL trace buffer
RECENT_ENTRIES = 50  # a rank's last collectives it shares with the others on a hang


def enable() -> None:
    if not any(os.environ.get(name) for name in BUFFER_ENV):
        for name in BUFFER_ENV:
            os.environ[name] = str(BUFFER_ENTRIES)


def _dump(backend: str, entries: bool) -> dict | None:
    dump = private("torch._C._distributed_c10d._dump_nccl_trace_json") if "nccl" in backend else None
    dump = dump or private("torch._C._distributed_c10d._dump_fr_trace_json")
    if dump is None:
        return None
    return json.loads(dump(entries, False))


def _completed(trace: dict) -> dict[str, int]:
    return {str(group): int(status.get("last_completed_collective", -1))
            for group, status in (trace.get("pg_status") or {}).items()}


def waiting_on(backend: str) -> dict | None | bool:
    """The first collective enqueued and not completed, {"group", "seq"}, from each process group's last
    enqueued and completed sequence numbers (no entries read); None when none is; False when the recorder
    is missing or off (it then keeps no status)."""
    trace = _dump(backend, entries=False)
    if not (trace or {}).get("pg_status"):  # no recorder, or one switched off (TORCH_FR_BUFFER_SIZE=0)
        return False
    for group, status in sorted((trace.get("pg_status") or {}).items()):
        enqueued, completed = int(status.get("last_enqueued_collective", -1)), int(status.get("last_completed_collective", -1))
        if enqueued > completed:
            return {"group": str(group), "seq": completed + 1}
    return None


def _entry(raw: dict) -> dict:
    kind = str(raw.get("profiling_name") or "").split(":")[-1] or None
    created_ns = raw.get("time_created_ns")
    return {"group": str((raw.get("process_group") or ["?"])[0]), "seq": raw.get("collective_seq_id"),
            "kind": kind, "sizes": raw.get("input_sizes"),
            "since_unix_s": created_ns / 1e9 if created_ns else None}


def read(backend: str) -> tuple[list[dict], dict[str, int]]:
    """Every recorded collective entry (oldest first) and, per process group, its last completed sequence number."""
    trace = _dump(backend, entries=True)
    if not trace:
        return [], {}
    return [_entry(raw) for raw in trace.get("entries") or () if not raw.get("is_p2p")], _completed(trace)


def in_flight(entries: list[dict], completed: dict[str, int]) -> list[dict]:
    """The entries whose collective had not completed when the trace was read."""
    return [entry for entry in entries if entry["seq"] is not None and entry["seq"] > completed.get(entry["group"], -1)]


def recent(entries: list[dict]) -> list[dict]:
    return [{key: entry[key] for key in ("group", "seq", "kind", "sizes")} for entry in entries[-RECENT_ENTRIES:]]


def first_mismatch(by_rank: dict[int, list[dict]]) -> dict | None:
    """The first (group, sequence number) at which two ranks' recorded collectives differ in kind or sizes:
    {"group", "seq", "by_rank": {rank: "all_reduce [[4]]"}}, or None when every shared entry agrees."""
    keyed = {rank: {(entry["group"], entry["seq"]): entry for entry in entries} for rank, entries in by_rank.items()}
    shared = set.intersection(*(set(entries) for entries in keyed.values())) if len(keyed) > 1 else set()
    for group, seq in sorted(shared, key=lambda key: (key[0], key[1])):
        described = {rank: f"{entries[(group, seq)]['kind']} {entries[(group, seq)]['sizes']}" for rank, entries in keyed.items()}
        if len(set(described.values())) > 1:
            return {"group": group, "seq": seq, "by_rank": described}
    return None
