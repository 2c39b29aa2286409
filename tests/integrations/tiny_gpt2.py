"""The tiny GPT-2 and token data the integration tests train, with no gpuprof in sight.

Also a plain training script (`python tiny_gpt2.py --steps 4 [--ddp] [--compile] ...`): a nanoGPT-style loop
with the loss computed outside the model, that `gpuprof run` records without any change to it.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

transformers.logging.set_verbosity_error()
VOCAB, SEQ, BATCH = 256, 32, 4
PHASES = ["data_time_s", "forward_time_s", "backward_time_s", "optimizer_time_s"]


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=64,
                                      bos_token_id=0, eos_token_id=0))


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random sequences; `delay_s` makes every item slow, as a loader that tokenizes per step."""

    def __init__(self, n_items: int = 64, delay_s: float = 0.0):
        self.n_items, self.delay_s = n_items, delay_s

    def __len__(self):
        return self.n_items

    def __getitem__(self, index):
        time.sleep(self.delay_s)
        tokens = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens}


def assert_phases_cover_the_steps(steps) -> None:
    """Every phase measured in every step, nothing counted twice, and together most of a typical step:
    clipping, zero_grad, later micro-batches' loading and framework bookkeeping are `other` (5-10%
    here, more under load). The median step, so that one step stalled by a busy machine in `other`
    code does not decide it."""
    assert (steps[PHASES] > 0).all().all()
    named = steps[PHASES].sum(axis=1)
    assert (named <= steps["step_time_s"] * 1.05).all()
    assert (named / steps["step_time_s"]).median() >= 0.6


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def muon_and_adamw(model: torch.nn.Module) -> list[torch.optim.Optimizer]:
    """The nanoGPT speedruns' pair: Muon for the blocks' weight matrices, AdamW for the rest."""
    named = list(model.named_parameters())
    matrix = [param.ndim == 2 and ".h." in name for name, param in named]
    return [torch.optim.Muon([p for (_, p), m in zip(named, matrix) if m], lr=0.02),
            torch.optim.AdamW([p for (_, p), m in zip(named, matrix) if not m], lr=1e-3)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--fail-at", type=int, default=None, help="raise in this optimizer step")
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel over gloo, under torchrun")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--nan-embedding-at", type=int, default=None, help="a NaN into the token embedding then")
    parser.add_argument("--muon", action="store_true", help="Muon for the blocks' matrices, AdamW for the rest")
    args = parser.parse_args()
    model = tiny_model()
    if args.ddp:
        torch.distributed.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    if args.compile:
        model = torch.compile(model)
    optimizers = muon_and_adamw(model) if args.muon else [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    loader = iter(torch.utils.data.DataLoader(RandomTokens(args.steps * args.accumulation * BATCH), batch_size=BATCH))
    for step in range(args.steps):
        if step == args.fail_at:
            raise RuntimeError(f"failing on purpose at step {step}")
        if step == args.nan_embedding_at:
            with torch.no_grad():
                model.transformer.wte.weight[0] = float("nan")
        for _ in range(args.accumulation):
            tokens = next(loader)["input_ids"]
            loss = next_token_loss(model(input_ids=tokens).logits, tokens) / args.accumulation
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item() * args.accumulation:.4f}")
    if args.ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
