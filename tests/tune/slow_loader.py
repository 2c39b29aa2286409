"""A training loop whose DataLoader prepares every batch in the main process, over a dataset whose items
are slow to read (each one waits, as a network file system or a decoder would): the loop `gpuprof tune`
should speed up from outside. A tiny GPT-2 that computes its own loss; same seed, same batches."""

import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1000)
parser.add_argument("--item-delay-ms", type=float, default=20.0)
parser.add_argument("--attention", default=None, help="the model's attn_implementation (default: transformers')")
args = parser.parse_args()


class SlowTokens(torch.utils.data.Dataset):
    def __init__(self, n_items: int, seq_len: int = 32, vocab: int = 256):
        self.tokens = torch.randint(0, vocab, (n_items, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        time.sleep(args.item_delay_ms / 1000)
        return self.tokens[index]


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                   bos_token_id=0, eos_token_id=0, attn_implementation=args.attention))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
loader = torch.utils.data.DataLoader(SlowTokens(8 * args.steps), batch_size=8, shuffle=True,
                                     generator=torch.Generator().manual_seed(0))
for step, tokens in enumerate(loader):
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"done: loss {loss.item():.4f}")
