"""Run under torchrun by test_workloads_distributed.py: the workload under DDP, then under FSDP2, in one job.

DDP: 3 steps, rank 1 a straggler; saves this rank's parameters and losses (OUT_DIR/ddp-rank-R.pt).
FSDP2: trains 4 steps saving a DCP checkpoint every 2, then resumes a second run from the step-2
checkpoint to step 4; saves this rank's losses of both and the full (gathered) final weights
(OUT_DIR/fsdp-rank-R.pt). The worker owns the process group, so train() leaves it open for the next
run and for gathering the weights.
"""

import os
import sys

import torch

from gpuprof.workloads.gpt2 import TrainConfig, train

out_dir = sys.argv[1]
rank = os.environ["RANK"]
torch.distributed.init_process_group("gloo")

ddp = train(TrainConfig(model_size="tiny", variant="optimized", vocab_size=8192, seq_len=64, batch_size=4,
                        steps=3, num_workers=0, run_dir=f"{out_dir}/ddp-run", straggler_rank=1,
                        straggler_delay_ms=100))
torch.save({"params": ddp.model.state_dict(), "losses": ddp.losses, "world_size": ddp.world_size},
           f"{out_dir}/ddp-rank-{rank}.pt")

common = dict(model_size="tiny", variant="optimized", parallel="fsdp", vocab_size=8192, seq_len=32,
              batch_size=4, steps=4, num_workers=0, log_every=1000)
full = train(TrainConfig(**common, run_dir=f"{out_dir}/run", checkpoint_every=2))
weights = {name: p.full_tensor() for name, p in full.model.state_dict().items()}  # collective
resumed = train(TrainConfig(**common, run_dir=f"{out_dir}/resumed", resume=f"{out_dir}/run/checkpoints/step-000002"))
resumed_weights = {name: p.full_tensor() for name, p in resumed.model.state_dict().items()}
torch.save({"losses": full.losses, "resumed_losses": resumed.losses, "resumed_start": resumed.start_step,
            "weights": weights, "resumed_weights": resumed_weights, "world_size": full.world_size},
           f"{out_dir}/fsdp-rank-{rank}.pt")
torch.distributed.destroy_process_group()
