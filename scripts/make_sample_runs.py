"""Regenerate sample_runs/: small recorded runs of the GPT-2 reference workload for the dashboard.

    .venv/bin/python scripts/make_sample_runs.py [--out sample_runs] [--steps 16] [--only NAME ...]

Each run is the tiny model on the CPU (a few MB in all), recorded by `gpuprof train` with a
short torch.profiler trace window:
  baseline      the baseline variant
  optimized     the optimized variant (the same model, the knobs that make it faster)
  nan           a NaN injected into the token embedding part-way through
  slow-data     a data loader slowed on purpose (the dataloader rule fires)
  ddp-2rank     two ranks under torchrun with gloo, rank 1 slowed (a straggler)
  tune          `gpuprof tune` of the slow-data workload: its loader and optimizer knobs measured (a folder
                of the trials' runs and tune.json, for the Tune page)
Runs are recorded into a temporary folder and moved into place only when all succeed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from gpuprof.run.schema import NUMERICS_DIR

REPO = Path(__file__).resolve().parents[1]
MAX_BUNDLE_BYTES = 1_000_000
COMMON = ["--model", "tiny", "--device", "cpu"]


def train_command(name: str, steps: int) -> list[str]:
    """The command that records sample run `name` with `steps` optimizer steps into ./`name` (relative,
    so the recorded config names no temporary folder)."""
    if name == "tune":
        return [sys.executable, "-m", "gpuprof", "tune", "--steps", str(steps), "--only",
                "loader-workers,fused-optimizer", "--out", name, "--train", *COMMON, "--data-delay-ms", "1000"]
    train = [*COMMON, "--steps", str(steps), "--trace-steps", f"{steps - 4}:{steps - 2}", "--run-dir", name]
    gpuprof = [sys.executable, "-m", "gpuprof", "train"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "gpuprof", "train"]
    return {
        "baseline": [*gpuprof, *train, "--variant", "baseline"],
        "optimized": [*gpuprof, *train, "--variant", "optimized"],
        "nan": [*gpuprof, *train, "--variant", "baseline", "--inject", f"embedding-nan@{steps // 2}"],
        "slow-data": [*gpuprof, *train, "--variant", "baseline", "--data-delay-ms", "1000"],
        "ddp-2rank": [*torchrun, *train, "--variant", "baseline", "--straggler-rank", "1",
                      "--straggler-delay-ms", "1000"],
    }[name]


SAMPLE_RUNS = ("baseline", "optimized", "nan", "slow-data", "ddp-2rank", "tune")


def drop_large_bundles(staging: Path) -> None:
    """NaN replay bundles hold the model and optimizer state (~100 MB for the tiny model): too big to ship."""
    for bundle in staging.glob(f"*/{NUMERICS_DIR}/*"):
        if bundle.stat().st_size > MAX_BUNDLE_BYTES:
            print(f"leaving out {bundle.relative_to(staging)} ({bundle.stat().st_size / 1e6:.0f} MB)")
            bundle.unlink()


def record(names: list[str], out: Path, steps: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".sample-runs-") as staging:
        for name in names:
            command = train_command(name, steps)
            print(f"recording {name}: {' '.join(command[1:])}", flush=True)
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
            subprocess.run(command, check=True, cwd=staging, env=env, stdout=subprocess.DEVNULL)
        drop_large_bundles(Path(staging))
        for name in names:
            shutil.rmtree(out / name, ignore_errors=True)
            shutil.move(str(Path(staging) / name), out / name)
    size_mb = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 1e6
    print(f"{out}: {', '.join(names)} ({size_mb:.1f} MB in all)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "sample_runs")
    parser.add_argument("--steps", type=int, default=16, help="optimizer steps per run (default 16)")
    parser.add_argument("--only", nargs="+", choices=SAMPLE_RUNS, default=list(SAMPLE_RUNS))
    args = parser.parse_args()
    try:
        record(args.only, args.out.resolve(), args.steps)
    except subprocess.CalledProcessError as error:
        print(f"make_sample_runs: a recording failed ({error}); sample runs left unchanged", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
