"""What tune concludes from measured trials: the winner, and composites slower than their own knobs."""

from __future__ import annotations

from gpuprof.analysis.run.stats import Interval
from gpuprof.tune.trials import Trial, WorkloadTarget
from gpuprof.tune.tuning import TuneResult, _conclude


def trial(name: str, point: float, low: float, high: float, knobs=None) -> Trial:
    measured = Trial(name, tuple(knobs if knobs is not None else [name]), f"/runs/{name}", status="measured",
                     speedup=Interval(point, low, high, 0.95), parity={"status": "identical"})
    return measured


def test_the_optimized_variant_slower_than_its_own_knob_is_said_and_the_fastest_helper_wins():
    target = WorkloadTarget(("--model", "tiny"))
    result = TuneResult(target.title, "/runs", 20, Trial("baseline", (), "/runs/baseline"), None, [
        trial("fused-optimizer", 1.50, 1.40, 1.60),
        trial("compile", 1.30, 1.20, 1.40),  # not one of the optimized variant's knobs
        trial("tf32", 1.01, 0.95, 1.08),
        trial("optimized", 1.20, 1.10, 1.35, knobs=()),
    ])
    _conclude(target, result)
    assert result.winner.name == "fused-optimizer"
    assert result.diff == "gpuprof train --model tiny --fused-adamw"
    assert result.notes == ["the optimized variant (1.20x) is slower than its own fused-optimizer knob alone (1.50x)"]
    assert result.conclusion == "fused-optimizer: 1.50x faster (95% CI 1.40-1.60x), numerics identical"


def test_a_knob_inside_the_noise_helps_nobody():
    target = WorkloadTarget(())
    result = TuneResult(target.title, "/runs", 20, Trial("baseline", (), "/runs/baseline"), None,
                        [trial("tf32", 1.04, 1.01, 1.08), trial("gc-freeze", 0.99, 0.90, 1.10)])
    _conclude(target, result)
    assert result.winner is None and [t.effect for t in result.trials] == ["within noise", "within noise"]
    assert result.conclusion == "No knob gained outside the noise (2 measured)"
