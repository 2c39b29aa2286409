"""Helpers for the numerics tests (a module of its own: `conftest` names clash across test folders)."""

from __future__ import annotations

import json

VOCAB = 256
SMALL = {"model_size": "tiny", "vocab_size": VOCAB, "seq_len": 16, "batch_size": 2, "warmup_steps": 1,
         "log_every": 1000}


def events(run_dir, kind: str) -> list[dict]:
    """The run's events of one kind, each as its details plus step and message."""
    import gpuprof

    table = gpuprof.load_run(run_dir).events
    rows = []
    for _, row in table[table["kind"] == kind].iterrows():
        details = row["details"] if isinstance(row["details"], dict) else json.loads(row["details"])
        rows.append({**details, "step": None if row["step"] != row["step"] else int(row["step"]),
                     "message": row["message"], "severity": row["severity"]})
    return rows
