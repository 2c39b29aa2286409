"""Training loops gpuprof did not write, for the corpus tests: plain PyTorch the way users write it.

`nanogpt_loop` is a nanoGPT-style loop over the tiny GPT-2 (loss computed outside the model
with F.cross_entropy, gradient accumulation, optional fp16 autocast with a GradScaler), wrapped
the way docs/capture.md tells users: `gpuprof.profile(run_dir, model=..., optimizer=...,
loader=...)` and one `prof.step(loss=..., tokens=...)` per optimizer step, no `prof.phase()`.
Each fault is one argument away from the healthy loop. `tiny_gpt2` and `token_loader`
(optionally slow) are for other corpus tests (Trainer, Lightning, Accelerate) to share.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB_SIZE = 256
SEQ_LEN = 32
BATCH_SIZE = 4


@contextlib.contextmanager
def one_thread():
    """Torch on one intra-op thread while recording: on a loaded 2-core machine, spinning threads
    of concurrent processes slow a tiny model's step tenfold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def tiny_gpt2(attn_implementation: str = "sdpa") -> GPT2LMHeadModel:
    """GPT-2 with 2 layers of width 128 over a 256-token vocabulary, from a config (no weights)."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB_SIZE, n_positions=SEQ_LEN,
                        bos_token_id=None, eos_token_id=None, attn_implementation=attn_implementation)
    return GPT2LMHeadModel(config)


class TokenDataset(Dataset):
    """Random token windows (input, next-token target); each item sleeps `delay_s`, like a slow
    tokenizer or a remote read in `__getitem__`."""

    def __init__(self, n_items: int, delay_s: float = 0.0, seq_len: int = SEQ_LEN):
        self.tokens = torch.randint(0, VOCAB_SIZE, (n_items, seq_len + 1), generator=torch.Generator().manual_seed(0))
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.delay_s:
            time.sleep(self.delay_s)
        window = self.tokens[index]
        return window[:-1], window[1:]


def token_loader(n_batches: int, delay_s: float = 0.0, **options) -> DataLoader:
    """A DataLoader of `n_batches` batches of BATCH_SIZE windows; `options` go to DataLoader."""
    return DataLoader(TokenDataset(n_batches * BATCH_SIZE, delay_s), batch_size=BATCH_SIZE, **options)


def adamw(model: torch.nn.Module, **options) -> torch.optim.AdamW:
    """nanoGPT's AdamW; `options` choose the implementation (fused=True, foreach=False)."""
    return torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, **options)


def nanogpt_loop(run_dir, *, steps: int = 6, grad_accum: int = 2, attn_implementation: str = "sdpa",
                 optimizer_options: dict | None = None, loader_delay_s: float = 0.0, fp16: bool = False,
                 read_loss_every_step: bool = False, trace_steps=None):
    """Trains the tiny GPT-2 for `steps` optimizer steps under gpuprof.profile and returns the Run.

    Faults: attn_implementation="eager"; optimizer_options={"foreach": False} (the default is
    fused=True); loader_delay_s per sample; read_loss_every_step (a `loss.item()` each step).
    """
    import gpuprof

    model = tiny_gpt2(attn_implementation)
    optimizer = adamw(model, **(optimizer_options if optimizer_options is not None else {"fused": True}))
    loader = token_loader(steps * grad_accum, loader_delay_s)
    scaler = torch.amp.GradScaler("cpu", enabled=fp16)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, loader=loader, scaler=scaler if fp16 else None,
                         trace_steps=trace_steps, sample_interval_s=None) as prof:
        batches = iter(loader)
        for _ in range(steps):
            for _ in range(grad_accum):
                inputs, targets = next(batches)
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    logits = model(input_ids=inputs).logits
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1)) / grad_accum
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if read_loss_every_step:
                print(f"loss {loss.item() * grad_accum:.3f}")
            prof.step(loss=loss.detach() * grad_accum, tokens=grad_accum * inputs.numel())
    return gpuprof.load_run(run_dir)
