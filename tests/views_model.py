"""A small plain-torch model recorded under torch.profiler with every option the TensorBoard plugin's views
need (record_shapes, with_stack, profile_memory, with_modules); its sizes are what the trace's input shapes
and allocations must show."""

from __future__ import annotations

from pathlib import Path

import torch

BATCH, IN, HIDDEN, OUT = 8, 32, 64, 1
ACTIVE_STEPS = 3
FLOAT_BYTES = 4


class ViewsModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(IN, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, inputs):
        return self.out(torch.relu(self.hidden(inputs)))


def record_views_trace(folder: Path) -> Path:
    """One warm-up step, then ACTIVE_STEPS recorded, written by tensorboard_trace_handler into `folder`."""
    torch.manual_seed(0)
    model = ViewsModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=ACTIVE_STEPS, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(folder)),
                                record_shapes=True, with_stack=True, profile_memory=True, with_modules=True) as prof:
        train(model, optimizer, [(torch.randn(BATCH, IN), torch.randn(BATCH, OUT)) for _ in range(1 + ACTIVE_STEPS)],
              prof)
    return folder


def train(model, optimizer, batches, prof) -> None:
    """A plain regression loop, one profiler step per batch."""
    for inputs, targets in batches:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        prof.step()
