"""Tiny GPT-2 runs recorded by gpuprof.profile, and CUDA memory snapshots in torch's own format made
on any machine (torch converts a profile recorded with `profile_memory=True` into the snapshot
format, torch.cuda._memory_viz, with the allocations, frees and stacks of the profiled work)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.cuda._memory_viz import _profile_to_snapshot
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ, BATCH = 256, 32, 4


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
