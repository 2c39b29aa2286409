"""A tiny DDP language-model loop on gloo with one fault on one rank, for the hang, dead-rank and straggler tests.

    torchrun --nproc_per_node 2 faulty_ddp_loop.py RUN_DIR --fault stuck|skip|raise|kill|straggler
        [--rank 1] [--at-step 5] [--steps N] [--hang-timeout-s 20] [--delay-ms 60] [--step-sleep-s 0]

stuck: the rank sleeps inside `read_next_shard` at the step (its data phase), the others wait in
backward's all-reduce. skip: rank 0 makes an all_reduce the others skip, who go on to a barrier.
raise: the rank raises in its step. kill: the rank sends itself SIGKILL. straggler: the rank sleeps
`delay_ms` in its data phase every step. The model is a plain embedding and head, not GPT-2: what
these tests look at is the ranks, their collectives and their stacks, and each rank then starts
without the seconds of CPU that importing transformers costs.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

import gpuprof

VOCAB, SEQ, BATCH, WIDTH = 128, 16, 2, 32


class TinyLM(torch.nn.Module):
    """An embedding and a linear head; forward gives the next-token loss over the batch."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(tokens[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def read_next_shard(step: int, rank: int, args) -> torch.Tensor:
    time.sleep(args.step_sleep_s)
    if rank == args.rank and args.fault == "stuck" and step == args.at_step:
        time.sleep(3600)
    if rank == args.rank and args.fault == "straggler":
        time.sleep(args.delay_ms / 1000)
    generator = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def log_metrics(step: int, rank: int, loss: torch.Tensor, args) -> None:
    """The `skip` fault: rank 0 averages the loss for its log at one step, the other ranks do not."""
    if args.fault == "skip" and step == args.at_step:
        if rank == 0:
            dist.all_reduce(loss.detach().clone())
        dist.barrier()


def fail_here(step: int, rank: int, args) -> None:
    if rank != args.rank or step != args.at_step:
        return
    if args.fault == "raise":
        raise RuntimeError(f"bad batch on rank {rank} at step {step}")
    if args.fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("--fault", choices=("stuck", "skip", "raise", "kill", "straggler", "none"), default="none")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--at-step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hang-timeout-s", type=float, default=None)
    parser.add_argument("--delay-ms", type=float, default=60.0)
    parser.add_argument("--step-sleep-s", type=float, default=0.0, help="every rank, every step")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(TinyLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gpuprof.profile(args.run_dir, model=model, optimizer=optimizer, numerics=False,
                         hang_timeout_s=args.hang_timeout_s) as prof:
        for step in range(args.steps):
            tokens = read_next_shard(step, rank, args)
            loss = model(tokens)
            fail_here(step, rank, args)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            log_metrics(step, rank, loss, args)
            prof.step(loss=loss.detach(), tokens=tokens.numel())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
