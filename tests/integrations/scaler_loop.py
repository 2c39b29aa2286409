"""A loop with a GradScaler and an LR scheduler, for `gpuprof run`: at --inf-iteration its loss is
made infinite, so the scaler skips that optimizer step (optimizer.step() does not run at all)."""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--inf-iteration", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    for iteration in range(args.iterations):
        x = torch.randn(8, 16)
        loss = model(x).square().mean()
        if iteration == args.inf_iteration:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad()
        print(f"iteration {iteration} loss {loss.item():.6f} scale {scaler.get_scale():g}")


if __name__ == "__main__":
    main()
