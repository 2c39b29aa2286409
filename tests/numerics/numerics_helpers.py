"""Helpers for the numerics tests (a module of its own: `conftest` names clash across test folders)."""

from __future__ import annotations

import json

VOCAB = 256
SMALL = {"model_size": "tiny", "vocab_size": VOCAB, "seq_len": 16, "batch_size": 2, "warmup_steps": 1,
         "log_every": 1000}

# fault, precision, expected step, phase, module, op, first
FAULT_CASES = [
    ("attn-overflow@1", "fp16", 1, "forward", "transformer.h.1.attn", "aten::bmm", "inf"),
    ("embedding-nan@1", "fp32", 1, "state", "transformer.wte", None, "nan"),
    ("embedding-nan@1", "bf16", 1, "state", "transformer.wte", None, "nan"),
    ("ignored-labels@1", "fp32", 1, "loss", None, "aten::nll_loss_forward", "nan"),
    ("ignored-labels@1", "bf16", 1, "loss", None, "aten::nll_loss_forward", "nan"),
    ("ignored-labels@1", "fp16", 1, "loss", None, "aten::nll_loss_forward", "nan"),
    ("lr-spike@1", "fp32", 2, "forward", "transformer.h.0.ln_1", "aten::native_layer_norm", "nan"),
    ("lr-spike@1", "bf16", 2, "forward", "transformer.h.0.ln_1", "aten::native_layer_norm", "nan"),
    ("sqrt-zero@1", "fp32", 1, "backward", "transformer.h.1.mlp", "aten::div", "inf"),
    ("sqrt-zero@1", "bf16", 1, "backward", "transformer.h.1.mlp", "aten::div", "inf"),
    # under fp16 GradScaler skips the step; forensics starts once it has skipped 3 in a row
    ("sqrt-zero@1", "fp16", 3, "backward", "transformer.h.1.mlp", "aten::div", "inf"),
]


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


def started_tape(model, optimizer, scaler=None):
    """A numerics Tape of `model`, started under a stand-in profiler whose CollectorSet holds it (its
    model and optimizer hooks are the set's shared ones); `tape.on_close(None)` stops it."""
    from gpuprof.capture.collector import CollectorSet
    from gpuprof.numerics.tape import Tape

    tape, collectors = Tape(model, scaler), CollectorSet(lambda *failed: None)
    collectors.add(tape)
    tape.on_start(type("Prof", (), {"optimizer": optimizer, "collectors": collectors}))
    return tape
