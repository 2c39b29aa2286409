"""A training loop with nothing for `gpuprof tune` to fix: batches already in memory, the fused AdamW,
a tiny GPT-2 on torch's scaled_dot_product_attention that computes its own loss."""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
args = parser.parse_args()

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                   bos_token_id=0, eos_token_id=0, attn_implementation="sdpa"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
batches = torch.randint(0, 256, (args.steps, 8, 32), generator=torch.Generator().manual_seed(0))
for tokens in batches:
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"done: loss {loss.item():.4f}")
