"""Every injected fault, under each precision where it applies: the recorded event names the
right step, phase, module and op, and `gpuprof replay` on its bundle prints the same blame."""

from __future__ import annotations

import pytest
from numerics_helpers import FAULT_CASES as CASES
from numerics_helpers import events

from gpuprof.cli import main
from gpuprof.workloads.gpt2 import train

pytestmark = pytest.mark.newest_torch  # run again on the newest torch tested (scripts/test.sh)

REPLAYED = {("attn-overflow@1", "fp16"), ("embedding-nan@1", "fp32"), ("lr-spike@1", "fp32"),
            ("sqrt-zero@1", "bf16")}


@pytest.mark.parametrize("fault,precision,step,phase,module,op,first", CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_fault_is_blamed(tiny, capsys, fault, precision, step, phase, module, op, first):
    config = tiny(inject=[fault], precision=precision, steps=step + 1)
    train(config)

    [event] = events(config.run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == \
        (step, phase, module, op, first)
    assert event["severity"] == "critical" and event["rank"] == 0
    if phase == "state":
        assert event["tensor"] == "transformer.wte.weight"
    else:
        assert event["nonfinite_count"] > 0 and event["shape"] is not None and event["source"]
    if fault.startswith("lr-spike"):
        assert event["cause"]["kind"] == "oversized_update" and event["cause"]["step"] == step - 1
    else:
        assert event["cause"] is None

    if (fault, precision) in REPLAYED:
        capsys.readouterr()
        assert main(["replay", event["bundle"]]) == 0
        printed = capsys.readouterr().out
        assert "same blame as recorded during training" in printed
        assert f"phase         {phase}" in printed and (op is None or f"op            {op}" in printed)


def test_attention_overflow_needs_fp16(tiny):
    """In fp32 the scaled scores fit: no event, the fault only applies to fp16."""
    config = tiny(inject=["attn-overflow@1"], precision="fp32", steps=2)
    train(config)
    assert events(config.run_dir, "nonfinite") == []


def test_bad_inject_spec_is_one_line(capsys):
    assert main(["train", "--inject", "nan-everywhere@3", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad --inject" in err[0]
