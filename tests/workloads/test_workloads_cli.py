"""The real `gpuprof train` command: a recorded run (a subprocess), and bad input as one line, exit 2
(every case through the CLI's entry in-process, one of each kind of error in a subprocess)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import gpuprof
from gpuprof.cli import main

SMALL_FLAGS = ["--model", "tiny", "--vocab-size", "8192", "--seq-len", "64", "--batch-size", "4"]


def gpuprof_train(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuprof", "train", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_train_records_a_run_and_prints_a_summary(tmp_path):
    """Without --run-dir the run goes under ./runs/, named for its variant."""
    done = gpuprof_train(*SMALL_FLAGS, "--variant", "optimized", "--steps", "3", "--num-workers", "0",
                         "--sample-interval", "0.05", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.startswith("optimized tiny: 3 steps, mean step time ")
    assert "tokens/s" in summary and "peak memory" in summary
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.endswith("-optimized") and (run_dir / "meta.json").is_file()
    run = gpuprof.load_run(run_dir)
    assert len(run.steps) == 3
    native_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # else bf16 is emulated, slower than fp32
    assert run.meta["config"]["variant"] == "optimized"
    assert run.meta["sample_interval_s"] == run.meta["config"]["sample_interval_s"] == 0.05
    assert run.meta["config"]["compute_dtype"] == ("bfloat16" if native_bf16 else "float32")


def write_tokens(path, ids) -> str:
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return str(path)


BAD_INPUTS = {
    "missing data path": (["--data", "/nonexistent/corpus.txt"], "does not exist"),
    "empty text file": (["--data", "{tmp}/empty.txt"], "no text found"),
    "token id beyond vocab": (["--data", "{tmp}/big_ids.bin"], "beyond the model vocabulary"),
    "unknown model size": (["--model", "gpt5"], "invalid choice"),
    "non-integer steps": (["--steps", "many"], "invalid int value"),
    "zero steps": (["--steps", "0"], "steps must be at least 1"),
    "unknown precision": (["--precision", "fp8"], "invalid choice"),
    "negative sample interval": (["--sample-interval", "-0.1"], "expected a number of seconds"),
}


def bad_input_args(tmp_path, case: str) -> tuple[list[str], str]:
    """`gpuprof train` arguments for one BAD_INPUTS case (its files written under tmp_path), and the message."""
    (tmp_path / "empty.txt").write_text("")
    write_tokens(tmp_path / "big_ids.bin", [1, 2, 9000] * 100)
    flags, message = BAD_INPUTS[case]
    return [*SMALL_FLAGS, "--steps", "2", "--run-dir", str(tmp_path / "run"), *[f.format(tmp=tmp_path) for f in flags]], message


def assert_one_line(code: int, stderr: str, message: str) -> None:
    assert code == 2, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, case):
    """Through the CLI's entry in this process (a fresh interpreter per case only repeats its start-up)."""
    args, message = bad_input_args(tmp_path, case)
    try:
        code = main(["train", *args])
    except SystemExit as exit:  # argparse's errors leave through sys.exit, as in `python -m gpuprof`
        code = exit.code
    assert_one_line(code, capsys.readouterr().err, message)


@pytest.mark.parametrize("case", ["missing data path", "unknown model size"])  # a GpuprofError, an argparse error
def test_bad_input_from_the_shell_is_one_line_and_exit_code_2(tmp_path, case):
    args, message = bad_input_args(tmp_path, case)
    done = gpuprof_train(*args)
    assert_one_line(done.returncode, done.stderr, message)


def test_every_config_knob_has_a_flag():
    from gpuprof.cli import build_parser
    from gpuprof.cli.train import config_from_args
    from gpuprof.workloads.gpt2 import TrainConfig

    argv = ["train", "--model", "gpt2", "--variant", "optimized", "--steps", "7", "--batch-size", "6",
            "--seq-len", "128", "--vocab-size", "4096", "--data", "d.txt", "--dropout", "0.1", "--lr", "0.001",
            "--min-lr-ratio", "0.5", "--warmup-steps", "3", "--weight-decay", "0.05", "--seed", "5",
            "--device", "cpu", "--precision", "bf16", "--attention", "eager", "--grad-accum", "3",
            "--parallel", "fsdp", "--no-reshard-after-forward", "--cpu-offload",
            "--num-workers", "1", "--grad-clip", "0.5", "--activation-checkpointing", "--no-fused-adamw",
            "--no-tf32", "--no-pin-memory", "--compile", "--run-dir", "r", "--log-every", "2", "--trace-steps", "2:4",
            "--sample-interval", "0.5", "--checkpoint-every", "4", "--checkpoint-dir", "c", "--resume", "x.pt",
            "--data-delay-ms", "5", "--host-sync", "--host-work-ms", "3", "--straggler-rank", "1", "--straggler-delay-ms", "20",
            "--inject", "embedding-nan@2", "--on-nonfinite", "raise"]
    config = config_from_args(build_parser().parse_args(argv)).as_dict()
    defaults = TrainConfig(variant="optimized").as_dict()
    unchanged = [name for name in config if name != "variant" and config[name] == defaults[name]]
    assert unchanged == []
    assert (config["model_size"], config["precision"], config["grad_accum"], config["compile"]) == (
        "gpt2", "bf16", 3, True)


def test_the_demos_training_runs_keep_kinetos_start_and_stop_lines_off_the_terminal(tmp_path, capfd):
    """`gpuprof demo` trains in child processes that share its terminal: their trace windows start and stop
    the profiler, and kineto would print a line at each, into the middle of the progress bars."""
    from gpuprof.cli.demo import _gpuprof_subprocess

    _gpuprof_subprocess(["train", *SMALL_FLAGS, "--steps", "3", "--trace-steps", "1:2", "--num-workers", "0",
                         "--run-dir", str(tmp_path / "run")])
    printed = capfd.readouterr()
    assert gpuprof.load_run(tmp_path / "run").trace_files  # the profiler did start and stop
    assert "USDT:" not in printed.err + printed.out and "profiler_start" not in printed.err
