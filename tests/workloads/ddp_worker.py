"""Run under torchrun by test_workloads_ddp.py: train, then save this rank's parameters and losses."""

import os
import sys

import torch

from gpuprof.workloads.gpt2 import TrainConfig, train

out_dir, run_dir = sys.argv[1], sys.argv[2]
config = TrainConfig(model_size="tiny", variant="optimized", vocab_size=8192, seq_len=64, batch_size=4,
                     steps=3, num_workers=0, run_dir=run_dir, straggler_rank=1, straggler_delay_ms=100)
result = train(config)
rank = os.environ["RANK"]  # train() has left the process group by now
torch.save({"params": result.model.state_dict(), "losses": result.losses, "world_size": result.world_size},
           f"{out_dir}/rank-{rank}.pt")
