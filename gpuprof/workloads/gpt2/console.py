"""What the workload prints: a progress bar on rank 0, and one summary line at the end."""

from __future__ import annotations

import resource
import sys
import time

import torch

from gpuprof.units import bytes_text


class Progress:
    """A tqdm bar with loss and tokens/s, refreshed every `log_every` steps.

    Reading the loss waits for the device, so it happens only at refreshes; the bar
    itself advances every step without a sync. Silent on ranks other than 0.
    """

    def __init__(self, *, enabled: bool, total_steps: int, start_step: int, log_every: int,
                 tokens_per_step: int, description: str):
        from tqdm.auto import tqdm

        self.enabled, self.log_every, self.tokens_per_step = enabled, log_every, tokens_per_step
        self._bar = tqdm(total=total_steps, initial=start_step, desc=description, unit="step",
                         disable=not enabled, file=sys.stderr, dynamic_ncols=True)
        self._last_time, self._last_step = time.perf_counter(), start_step

    def update(self, step: int, loss: torch.Tensor, last: bool) -> None:
        if not self.enabled:
            return
        self._bar.update(1)
        done = step + 1
        if done % self.log_every and not last:
            return
        loss_value = loss.item()
        now = time.perf_counter()
        tokens_per_s = self.tokens_per_step * (done - self._last_step) / (now - self._last_time)
        self._bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        self._last_time, self._last_step = now, done

    def logs_above(self):
        """A context in which log lines (gpuprof's warnings as the profiler starts and stops) print above the
        bar, not into the middle of it."""
        from tqdm.contrib.logging import logging_redirect_tqdm

        return logging_redirect_tqdm(tqdm_class=type(self._bar))

    def close(self) -> None:
        self._bar.close()


def peak_memory(device: torch.device) -> tuple[int, str]:
    """Peak bytes and what they measure: allocated tensors on CUDA, the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "CUDA allocated"
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process RSS"


def summary_line(result) -> str:
    memory = bytes_text(result.peak_memory_bytes)
    return (
        f"{result.config.variant} {result.config.model_size}: {result.steps_run} "
        f"step{'' if result.steps_run == 1 else 's'}, "
        f"mean step time {result.mean_step_time_s:.3f} s, {result.tokens_per_s:,.0f} tokens/s, "
        f"peak memory {memory} ({result.peak_memory_kind})"
    )
