"""`gpuprof tune` on the GPT-2 reference workload: every knob it has a flag for, measured (not a timed test).

    python benchmarks/tune_workload.py                                   # tiny GPT-2, 4 x 128 tokens, 20 steps a trial
    python benchmarks/tune_workload.py --steps 30 -- --model gpt2 --batch-size 4 --seq-len 256

What it measures: `gpuprof tune --train FLAGS` (docs/tune.md): a baseline of the workload's
baseline variant, one trial per knob (its `gpuprof train` flag alone), the knobs that helped
together, and the optimized variant; each trial a fresh child process, its speedup over the
baseline the ratio of mean step times after warm-up with its 95 % moving-block bootstrap interval.
It prints a markdown table for the README and what tune concluded, the optimized variant against its
own knobs included. Trials run one after the other, so drift in machine load shows as noise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

DEFAULT_FLAGS = ["--model", "tiny", "--batch-size", "4", "--seq-len", "128"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps per trial")
    parser.add_argument("--out", default=None, help="where the trials' runs go (default: a temporary folder)")
    parser.add_argument("flags", nargs="*", help="gpuprof train flags (after --)")
    args = parser.parse_args()
    from gpuprof.tune.trials import WorkloadTarget
    from gpuprof.tune.tuning import tune

    out = args.out or os.path.join(tempfile.mkdtemp(prefix="gpuprof-tune-"), "tune")
    result = tune(WorkloadTarget(tuple(args.flags or DEFAULT_FLAGS)), out, steps=args.steps,
                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    base = result.baseline
    print(f"baseline: {base.step_time_mean_s:.4g} s/step over {base.measured_steps} steps; {base.verdict}")
    print("| trial | estimate | measured speedup (95% CI) | numerics | status |")
    print("|---|---|---|---|---|")
    for trial in result.trials:
        measured = (f"{trial.speedup.point:.2f}x ({trial.speedup.low:.2f}-{trial.speedup.high:.2f})"
                    if trial.speedup else "—")
        estimate = f"{trial.estimate:.2f}x" if trial.estimate else "—"
        name = f"{trial.name} ({' + '.join(trial.knobs)})" if trial.name == "combined" else trial.name
        print(f"| {name} | {estimate} | {measured} | {trial.parity.get('status', '—')} | {trial.status} |")
    print(result.conclusion)
    for note in result.notes:
        print(f"note: {note}")
    print(f"runs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
