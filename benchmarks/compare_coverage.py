"""How often the block-bootstrap speedup interval (gpuprof.analysis.run.stats) covers the true
ratio, on synthetic AR(1) step times with a known mean ratio (not a timed test).

    python benchmarks/compare_coverage.py                 # 200 pairs of runs per cell
    python benchmarks/compare_coverage.py --pairs 500

Each cell draws `--pairs` pairs of runs (A's mean 100 ms, B's 80 ms, noise sd 10 ms with lag-one
autocorrelation phi) and prints the share of 95 % intervals that hold the true 1.25x, with the
mean block length chosen.
"""

from __future__ import annotations

import argparse

import numpy as np

from gpuprof.analysis.run import stats


def ar1(rng, n: int, phi: float, mean: float, sd: float) -> np.ndarray:
    shocks = rng.normal(0, sd * np.sqrt(1 - phi**2), n)
    noise = np.empty(n)
    noise[0] = rng.normal(0, sd)
    for index in range(1, n):
        noise[index] = phi * noise[index - 1] + shocks[index]
    return mean + noise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=200)
    args = parser.parse_args()
    print("phi  steps  coverage  mean block")
    for phi in (0.0, 0.5, 0.8):
        for n in (50, 100, 400):
            rng = np.random.default_rng(1)
            hits, blocks = 0, []
            for pair in range(args.pairs):
                a, b = ar1(rng, n, phi, 0.1, 0.01), ar1(rng, n, phi, 0.08, 0.01)
                hits += stats.speedup_interval(a, b, seed=pair).contains(0.1 / 0.08)
                blocks.append(stats.block_length(a))
            print(f"{phi:<4} {n:>5}  {hits / args.pairs:>7.1%}  {np.mean(blocks):>10.1f}")


if __name__ == "__main__":
    main()
