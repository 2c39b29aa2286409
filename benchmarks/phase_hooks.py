"""Per-step cost of the automatic phase hooks (gpuprof.capture.phases), in microseconds.

A small MLP loop (so the hooks are not lost in the model's own time) runs in blocks of
`--steps` steps, alternately bare and with PhaseHooks attached; both have the BackwardWatcher
that capture always attaches, so the difference is the phase hooks alone: forward pre/post
hooks, the grad_fn prehook, the optimizer step hooks, and the per-step bookkeeping including
reading the totals. Printed: the median over pairs of (hooked - bare) per step, with p10-p90.
Time is this thread's CPU time (on CPU with one torch thread all the work runs on it), so other
processes on a shared machine add little noise; on CUDA it is wall time after a synchronize.

    .venv/bin/python benchmarks/phase_hooks.py --pairs 30 --steps 200 --threads 1
    .venv/bin/python benchmarks/phase_hooks.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from gpuprof.capture.backward import BackwardWatcher
from gpuprof.capture.collector import CollectorSet
from gpuprof.capture.phases import PhaseHooks
from gpuprof.capture.timing import clock_for


def build(device: torch.device):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return model, optimizer, torch.randn(32, 64, device=device)


def run_block(model, optimizer, inputs, steps: int, hooks: PhaseHooks | None) -> float:
    """Seconds per step; with `hooks`, the step boundaries the Profiler would call too."""
    clock = time.perf_counter if inputs.is_cuda else time.thread_time
    start = clock()
    for _ in range(steps):
        if hooks is not None:
            hooks.on_step_start(None, 0)
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if hooks is not None:
            hooks.finish_step().totals_s()
    if inputs.is_cuda:
        torch.cuda.synchronize()
    return (clock() - start) / steps


def attach(model, optimizer, device) -> PhaseHooks:
    collectors = CollectorSet(lambda collector, hook, error: print(f"{hook} failed: {error!r}"))
    hooks = PhaseHooks(model, optimizer, clock_for(device))
    collectors.add(hooks)
    hooks.on_start(SimpleNamespace(collectors=collectors, event=print))
    return hooks


class BackwardEnd:
    """The BackwardWatcher callback, passed on to the phase hooks while a hooked block runs."""

    hooks: PhaseHooks | None = None

    def __call__(self) -> None:
        if self.hooks is not None:
            self.hooks.on_after_backward(None, 0)


def pair_us(model, optimizer, inputs, steps: int, backward_end: BackwardEnd, hooked_first: bool) -> float:
    """(hooked - bare) microseconds per step over one block of each."""
    seconds = {}
    for hooked in (hooked_first, not hooked_first):
        backward_end.hooks = attach(model, optimizer, inputs.device) if hooked else None
        seconds[hooked] = run_block(model, optimizer, inputs, steps, backward_end.hooks)
        if backward_end.hooks is not None:
            backward_end.hooks.on_close(None)
    return (seconds[True] - seconds[False]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, optimizer, inputs = build(torch.device(args.device))
    backward_end = BackwardEnd()
    BackwardWatcher(model, backward_end).attach()
    bare_us = run_block(model, optimizer, inputs, args.steps, None) * 1e6  # also the warm-up
    differences = [pair_us(model, optimizer, inputs, args.steps, backward_end, pair % 2 == 0)
                   for pair in range(args.pairs)]
    deciles = statistics.quantiles(differences, n=10)
    print(f"phase hooks: {statistics.median(differences):+.1f} us/step (median of {args.pairs} pairs of "
          f"{args.steps} steps; p10 {deciles[0]:+.1f}, p90 {deciles[-1]:+.1f}); bare step {bare_us:.0f} us, "
          f"device {args.device}, {args.threads} thread(s)")


if __name__ == "__main__":
    main()
