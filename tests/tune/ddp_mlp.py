"""A plain DistributedDataParallel loop over gloo, to run under torchrun: a small MLP on random data, no
transformers (each rank of each trial starts in a few seconds)."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=100)
args = parser.parse_args()

torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
inputs = torch.randn(args.steps, 32, 64, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
for batch in inputs:
    loss = (model(batch) - batch).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"done: loss {loss.item():.4f}")
torch.distributed.destroy_process_group()
