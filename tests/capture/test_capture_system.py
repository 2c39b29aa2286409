"""The background sampler on a machine without a GPU: host samples, and nothing said of the device it lacks."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpuprof
from gpuprof.errors import GpuprofError

LOOP = Path(__file__).with_name("capture_loop.py")


def test_a_loop_on_the_cpu_samples_the_host_and_tells_the_user_nothing_of_device_metrics(tmp_path):
    """A CPU run has no device to sample: the event says so, the terminal stays the loop's own."""
    result = subprocess.run([sys.executable, str(LOOP), str(tmp_path / "run"), "--steps", "4", "--sleep-s", "0.15",
                             "--runs", "2"], capture_output=True, text=True, timeout=400, check=True)
    assert "device metrics off" not in result.stderr and "NVML" not in result.stderr
    for index in (0, 1):
        run = gpuprof.load_run(tmp_path / f"run-{index}")
        system = run.system
        assert run.meta["sample_interval_s"] == 1.0  # "auto": the host alone, every second
        assert len(system) >= 1  # 0.6 s of steps: the first row comes after 0.1 s
        assert system["device_index"].isna().all() and system["gpu_util_pct"].isna().all()
        assert system["host_cpu_pct"].between(0, 100).all()
        assert (system["proc_rss_bytes"] > 50e6).all()
        assert (system["host_mem_used_bytes"] < system["host_mem_total_bytes"]).all()
        assert system["time_unix_s"].is_monotonic_increasing
        notice = run.events[run.events["kind"] == "device_metrics_off"]
        assert notice["details"].iloc[0]["reason"] == "training on cpu"


def test_an_explicit_sample_interval_is_kept(tmp_path):
    with gpuprof.profile(tmp_path / "run", sample_interval_s=0.05) as prof:
        time.sleep(2.0)
        prof.step()
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["sample_interval_s"] == 0.05
    assert len(run.system) >= 3  # about 40 (at 1 s, the host-only default: 2); the margin is for a loaded machine


def test_a_run_shorter_than_the_first_interval_still_has_a_host_row(tmp_path):
    with gpuprof.profile(tmp_path / "run", sample_interval_s=30) as prof:
        prof.step()
    system = gpuprof.load_run(tmp_path / "run").system
    assert len(system) == 1 and system["proc_rss_bytes"].iloc[0] > 50e6  # taken as the run closed


@pytest.mark.parametrize("bad", [-1, "often", True])
def test_a_bad_sample_interval_is_one_clear_error(tmp_path, bad):
    with pytest.raises(GpuprofError, match="sample_interval_s"):
        gpuprof.profile(tmp_path / "run", sample_interval_s=bad)


def test_the_rss_read_every_step_agrees_with_psutil_and_follows_the_process():
    import psutil

    from gpuprof.capture.memory import RssReader

    reader = RssReader()
    before = reader.rss_bytes()
    ballast = bytearray(64 * 2**20)
    ballast[::4096] = b"x" * len(ballast[::4096])  # every page touched: resident
    after, reference = reader.rss_bytes(), psutil.Process().memory_info().rss
    reader.close()
    assert abs(after - reference) < 8 * 2**20
    assert after - before > 56 * 2**20
