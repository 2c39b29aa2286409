"""`gpuprof run` on unmodified scripts, as subprocesses: a plain loop (also under torchrun), a Trainer, Lightning."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import torchrun
from tiny_gpt2 import BATCH, SEQ, assert_phases_cover_the_steps

import gpuprof
from gpuprof.cli import main
from gpuprof.report import build_report

HERE = Path(__file__).parent

def gpuprof_run(*args, cwd=None, launcher=(sys.executable, "-m")) -> subprocess.CompletedProcess:
    return subprocess.run([*launcher, "gpuprof", "run", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


# The scripts' command lines that tests here also run bare, to compare what they print.
PLAIN_LOOP = (HERE / "tiny_gpt2.py", "--steps", "5", "--accumulation", "2")
TWO_OPTIMIZERS = (HERE / "tiny_gpt2.py", "--steps", "4", "--accumulation", "1", "--muon")
COMPILED = (HERE / "tiny_gpt2.py", "--steps", "3", "--accumulation", "1", "--compile")
SCALER_LOOP = (HERE / "scaler_loop.py", "--iterations", "8", "--inf-iteration", "5")
BARE_RUNNER = """import json, runpy, sys
command_lines, separator = json.loads(sys.argv[1]), sys.argv[2]
for argv in command_lines:
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")
    print(separator, flush=True)
"""
HAS_MUON = hasattr(torch.optim, "Muon")


@pytest.fixture(scope="module")
def bare_stdout() -> dict[tuple, str]:
    """What each of the scripts above prints run bare by Python, one after the other in one interpreter
    (each seeds itself; one start-up instead of one each): command line -> stdout."""
    scripts = [PLAIN_LOOP, *[TWO_OPTIMIZERS] * HAS_MUON, SCALER_LOOP, COMPILED]
    separator = "-- end of a bare run --"
    done = subprocess.run([sys.executable, "-c", BARE_RUNNER, json.dumps([[*map(str, args)] for args in scripts]),
                           separator], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    *outputs, rest = done.stdout.split(f"{separator}\n")
    assert rest == "" and len(outputs) == len(scripts), done.stdout
    return dict(zip(scripts, outputs))


def recorded_like_bare(run_dir, bare_stdout, script_args):
    """The script run under `gpuprof run`, checked to print what it prints bare; its run."""
    done = gpuprof_run("--run-dir", run_dir, *script_args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == bare_stdout[script_args]
    return gpuprof.load_run(run_dir)


def test_a_plain_loop_is_recorded_without_a_change(tmp_path, bare_stdout):
    done = gpuprof_run("--run-dir", tmp_path / "run", *PLAIN_LOOP)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("loss") == 5  # the script ran as itself, with its own arguments
    assert done.stdout == bare_stdout[PLAIN_LOOP]  # and its losses are those of a bare run
    run = gpuprof.load_run(tmp_path / "run")
    steps = run.steps
    assert steps["step"].tolist() == [0, 1, 2, 3, 4]  # from the first iteration on
    assert steps["micro_batches"].tolist() == [2, 2, 2, 2, 2]
    assert (steps["tokens"] == 2 * BATCH * SEQ).all()
    assert np.isfinite(steps["grad_norm"]).all() and (steps["grad_norm"] > 0).all()
    assert np.isfinite(steps["loss"]).all()  # what backward() ran on (the model returns no loss)
    assert_phases_cover_the_steps(steps[steps["step"] > 0])
    first = steps.iloc[0]  # recording starts at its first backward(): its data time was not seen
    assert np.isnan(first["data_time_s"]) and (first[["forward_time_s", "backward_time_s", "optimizer_time_s"]] > 0).all()
    assert run.meta["status"] == "finished"
    assert run.meta["model"]["class"] == "GPT2LMHeadModel"
    assert run.meta["loop"]["loader"]["batch_size"] == BATCH
    assert run.meta["config"]["args"] == ["--steps", "5", "--accumulation", "2"]


@pytest.mark.skipif(not HAS_MUON, reason="torch.optim.Muon is torch 2.9+")
def test_a_loop_stepping_two_optimizers_is_recorded_with_both(tmp_path, bare_stdout):
    run = recorded_like_bare(tmp_path / "run", bare_stdout, TWO_OPTIMIZERS)
    # two optimizers: their order is known once both stepped, so recording starts after the first iteration
    assert run.steps["step"].tolist() == [0, 1, 2]
    assert run.meta["config"]["first_iteration"].startswith("not recorded")
    facts = run.meta["loop"]["optimizer"]
    assert [member["class"] for member in facts["members"]] == ["Muon", "AdamW"]
    assert facts["params_without_optimizer"] == 0
    assert_phases_cover_the_steps(run.steps)


@pytest.mark.slow
def test_a_compiled_model_is_recorded_and_compiles_as_without_gpuprof(tmp_path, bare_stdout):
    run = recorded_like_bare(tmp_path / "run", bare_stdout, COMPILED)
    assert run.meta["model"]["wrapper"] == "OptimizedModule" and run.meta["loop"]["model"]["compiled"]
    assert run.steps["step"].tolist() == [0, 1, 2] and (run.steps["grad_norm"] > 0).all()


def test_a_failing_script_keeps_its_steps_and_its_exit_code(tmp_path):
    done = gpuprof_run("--run-dir", tmp_path / "run", HERE / "tiny_gpt2.py", "--steps", "5", "--fail-at", "3")
    assert done.returncode == 1
    assert "RuntimeError: failing on purpose at step 3" in done.stderr
    assert "gpuprof/integrations" not in done.stderr  # the traceback Python would print
    assert "gpuprof run: recorded in" not in done.stderr  # the traceback is the last thing printed
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["status"] == "failed"
    assert run.steps["step"].tolist() == [0, 1, 2]
    # an exception, named with the script's own line: not a hang, not a dead rank
    verdict = build_report(tmp_path / "run").verdict
    assert verdict.headline == "Stopped by an exception (RuntimeError)"
    assert re.match(r"The script raised RuntimeError: failing on purpose at step 3 at \S+ \(tiny_gpt2\.py:\d+\), "
                        r"after step 2\.", verdict.why), verdict.why
    assert verdict.next_step.startswith("Start from the script where it raised RuntimeError") and "dmesg" not in verdict.next_step


def test_a_missing_script_is_one_line_and_exit_code_2(tmp_path, capsys):
    """Through the CLI's entry in this process: the other tests here run `gpuprof run` as a real process."""
    assert main(["run", str(tmp_path / "nope.py")]) == 2
    stderr = capsys.readouterr().err
    assert stderr.strip().count("\n") == 0 and "no such script" in stderr


def test_the_sample_interval_is_the_users_and_a_bad_one_is_one_line_and_exit_code_2(tmp_path, capsys):
    done = gpuprof_run("--run-dir", tmp_path / "run", "--max-steps", "3", "--sample-interval", "0.05",
                       HERE / "tiny_gpt2.py", "--steps", "5", "--accumulation", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    run = gpuprof.load_run(tmp_path / "run")
    assert run.meta["sample_interval_s"] == 0.05 and run.system["host_cpu_pct"].notna().any()
    for bad in ("fast", "-1", "nan"):
        with pytest.raises(SystemExit) as exit:  # argparse's errors leave through sys.exit
            main(["run", "--sample-interval", bad, str(HERE / "tiny_gpt2.py")])
        assert exit.value.code == 2
        stderr = capsys.readouterr().err
        assert stderr.strip().count("\n") == 0 and "expected a number of seconds" in stderr


def test_a_trainer_script_gets_the_callback(tmp_path):
    done = gpuprof_run("--run-dir", tmp_path / "run", HERE / "hf_trainer_script.py", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = gpuprof.load_run(tmp_path / "run").steps
    assert steps["step"].tolist() == [0, 1, 2]  # the callback records from the Trainer's first step
    assert steps["micro_batches"].tolist() == [2, 2, 2]
    assert steps["loss"].notna().all()
    assert_phases_cover_the_steps(steps)


def test_a_lightning_script_gets_the_callback(tmp_path):
    done = gpuprof_run("--run-dir", tmp_path / "run", HERE / "lightning_gpt2.py", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run = gpuprof.load_run(tmp_path / "run")
    assert run.steps["micro_batches"].tolist() == [2, 2, 2]
    assert run.meta["config"]["accumulate_grad_batches"] == 2
    assert run.meta["config"]["script"] == str(HERE / "lightning_gpt2.py")


@pytest.mark.slow
def test_torchrun_ranks_share_one_default_run_dir(tmp_path):
    done = gpuprof_run(HERE / "tiny_gpt2.py", "--steps", "3", "--ddp", cwd=tmp_path, launcher=(*torchrun(), "-m"))
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("tiny_gpt2-")
    run = gpuprof.load_run(run_dir)
    assert run.meta["model"]["wrapper"] == "DistributedDataParallel"
    assert sorted(run.steps.groupby("rank")["step"].count().items()) == [(0, 3), (1, 3)]  # from the first iteration on


def test_a_grad_scaler_and_lr_scheduler_are_found_and_skipped_steps_are_steps(tmp_path, bare_stdout):
    """torch keeps no registry of GradScalers or schedulers: they are found in the script's frame. A step
    the scaler skips runs no optimizer.step(), so with a scaler each step ends at scaler.update()."""
    done = gpuprof_run("--run-dir", tmp_path / "run", *SCALER_LOOP)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == bare_stdout[SCALER_LOOP]
    steps = gpuprof.load_run(tmp_path / "run").steps.set_index("step")
    assert steps.index.tolist() == list(range(8))  # step 0 is the first iteration
    assert steps["step_skipped"].tolist() == [False] * 5 + [True, False, False]
    scales = steps["scaler_scale"].tolist()
    assert scales[5] == scales[4] / 2  # the skip halves the scale
    assert steps["lr"].notna().all() and steps["lr"].iloc[-1] < steps["lr"].iloc[0]  # the scheduler's
