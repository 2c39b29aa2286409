"""`gpuprof tune` on unmodified scripts: real child processes, real trials, measured on this (loaded) machine:
nothing to gain, and a trial that fails.

The children run with one torch thread: on 2 cores shared with other jobs, more threads only add noise."""

from __future__ import annotations

import pytest
from tune_cli import HERE, TUNE_TIMEOUT_S, gpuprof_tune, trials_of


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
def test_a_script_with_nothing_to_fix_reports_no_gain_outside_the_noise(tmp_path):
    script = HERE / "clean_loop.py"
    # no --steps: a pilot of 20 says how many steps a ±5 % interval on the mean step time takes
    result = gpuprof_tune("--out", tmp_path / "plain", script, "--steps", 1000)
    interval = result["baseline_step_time_s"]
    assert interval["low"] <= interval["point"] <= interval["high"]
    assert (tmp_path / "plain" / "pilot" / "meta.json").is_file()
    if result["steps"] > 20:  # the pilot fell short: the baseline was run again for that many steps
        assert result["baseline"]["run_dir"] == str(tmp_path / "plain" / "baseline")
        assert result["baseline"]["measured_steps"] >= 0.75 * result["steps"]  # warm-up left out
    assert result["winner"] is None and result["diff"] == ""
    assert all(trial["effect"] != "faster" for trial in result["trials"])
    # a knob that changes nothing on a CPU, measured anyway, is never a gain: timed against the baseline runs
    # either side of it, it would have to beat both. (A burst of other load during its own run can still
    # pull its mean step time down to "slower": the mean counts every stalled step.)
    forced = gpuprof_tune("--steps", 100, "--only", "tf32", "--out", tmp_path / "tf32", script, "--steps", 200)
    tf32 = trials_of(forced)["tf32"]
    assert tf32["status"] == "measured" and tf32["speedup"] is not None
    assert tf32["effect"] != "faster" and forced["winner"] is None
    assert forced["conclusion"] == "No knob gained outside the noise (1 measured)"


@pytest.mark.slow
@pytest.mark.timeout(TUNE_TIMEOUT_S)
# not on purpose: gpuprof's gradient-norm collector cannot read sparse gradients and switches itself off
@pytest.mark.capture_may_switch_off
def test_a_trial_that_fails_is_reported_and_the_next_one_runs(tmp_path):
    result = gpuprof_tune("--steps", 5, "--only", "fused-optimizer,gc-freeze", "--out", tmp_path / "tune",
                          HERE / "sparse_sgd.py", "--steps", 40)
    fused, frozen = trials_of(result)["fused-optimizer"], trials_of(result)["gc-freeze"]
    assert fused["status"] == "failed" and "sparse" in fused["error"]
    assert fused["speedup"] is None
    assert frozen["status"] == "measured" and frozen["parity"]["status"] == "identical"
