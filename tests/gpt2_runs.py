"""Tiny GPT-2 runs recorded by gpuprof.profile, and CUDA memory snapshots in torch's own format made
on any machine (torch converts a profile recorded with `profile_memory=True` into the snapshot
format, torch.cuda._memory_viz, with the allocations, frees and stacks of the profiled work)."""

from __future__ import annotations

import statistics

from pathlib import Path

import torch
from torch.cuda._memory_viz import _profile_to_snapshot
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ, BATCH = 256, 32, 4
PLUGIN_CYCLE_STEPS = 8  # record_plugin_trace's profiler schedule: wait 4, warm up 1, record 3
# record_plugin_trace's batch: steps of tens of ms, against which a loader's handoff from its workers (a few ms
# under load: a pipe read, scheduling) is no input bound; 4 sequences step in ~6 ms, where it was read as one
PLUGIN_BATCH = 8 * BATCH


def tiny_gpt2() -> tuple[GPT2LMHeadModel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def record(run_dir: Path, steps: int, trace_steps: range, before_step=None) -> Path:
    """Trains the tiny GPT-2 for `steps` steps under gpuprof.profile with a trace window;
    `before_step(prof, model, optimizer, tokens)` runs at the start of each step."""
    import gpuprof

    model, optimizer = tiny_gpt2()
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, trace_steps=trace_steps,
                         sample_interval_s=None) as prof:
        for _ in range(steps):
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
            if before_step is not None:
                before_step(prof, model, optimizer, tokens)
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss, tokens=tokens.numel())
    return Path(run_dir)


def training_step_snapshot(model, optimizer, tokens: torch.Tensor) -> dict:
    """The snapshot of one training step of a Hugging Face causal LM on `tokens`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                record_shapes=True, with_stack=True) as profile:
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return _profile_to_snapshot(profile)


class SlowTokens(torch.utils.data.Dataset):
    """Random token rows, each `delay_s` to prepare (a tokenizer or augmentation the loop waits for)."""

    def __init__(self, rows: int, delay_s: float):
        self.rows, self.delay_s = rows, delay_s

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> torch.Tensor:
        import time

        time.sleep(self.delay_s)
        return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))


def train_step(model, optimizer, tokens: torch.Tensor) -> None:
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def step_time_s(model, optimizer, batch: int, repeats: int = 5) -> float:
    """The median of `repeats` timed training steps on a random batch, after one untimed (the best of a few
    reads a moment the machine was quiet, and a loaded machine's later steps are slower than that)."""
    import time

    tokens = torch.randint(0, VOCAB, (batch, SEQ))
    train_step(model, optimizer, tokens)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        train_step(model, optimizer, tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def record_plugin_trace(log_dir: Path, num_workers: int, data_to_compute: float = 2.5, spans: int = 1,
                        worker_name: str | None = None, **profile_options) -> Path:
    """Trains the tiny GPT-2 under plain torch.profiler on a Dataset whose batch takes `data_to_compute`
    times a training step to prepare (measured first, so that the loop is input-bound on any machine
    without workers, busy ones included, and workers can keep ahead of it), writing as the TensorBoard plugin's users do (tensorboard_trace_handler: one
    `*.pt.trace.json` per worker and span in `log_dir`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded machine's cores: one thread steps steadily
    try:
        model, optimizer = tiny_gpt2()
        item_delay_s = data_to_compute * step_time_s(model, optimizer, PLUGIN_BATCH) / PLUGIN_BATCH
        # Workers get the first steps (the schedule's wait) to fill their queue, as a real loop's warm-up does.
        extra = {"persistent_workers": True, "prefetch_factor": 4} if num_workers else {}
        loader = torch.utils.data.DataLoader(SlowTokens(PLUGIN_BATCH * (PLUGIN_CYCLE_STEPS * spans + 4), item_delay_s),
                                             batch_size=PLUGIN_BATCH, num_workers=num_workers, **extra)
        schedule = torch.profiler.schedule(wait=4, warmup=1, active=3, repeat=spans)
        handler = torch.profiler.tensorboard_trace_handler(str(log_dir), worker_name=worker_name)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                    on_trace_ready=handler, **profile_options) as prof:
            for tokens in loader:
                train_step(model, optimizer, tokens)
                prof.step()
    finally:
        torch.set_num_threads(threads)
    return Path(log_dir)
