"""Run under torchrun by test_workloads_fsdp.py: FSDP2 training with DCP checkpoints, then a resume.

Trains 4 steps saving a sharded checkpoint every 2, then resumes a second run from the step-2
checkpoint to step 4; saves this rank's losses of both and the full (gathered) final weights.
The worker owns the process group, so train() leaves it open for gathering the weights.
"""

import os
import sys

import torch

from gpuprof.workloads.gpt2 import TrainConfig, train

out_dir = sys.argv[1]
torch.distributed.init_process_group("gloo")
common = dict(model_size="tiny", variant="optimized", parallel="fsdp", vocab_size=8192, seq_len=32,
              batch_size=4, steps=4, num_workers=0, log_every=1000)
full = train(TrainConfig(**common, run_dir=f"{out_dir}/run", checkpoint_every=2))
weights = {name: p.full_tensor() for name, p in full.model.state_dict().items()}  # collective
resumed = train(TrainConfig(**common, run_dir=f"{out_dir}/resumed", resume=f"{out_dir}/run/checkpoints/step-000002"))
resumed_weights = {name: p.full_tensor() for name, p in resumed.model.state_dict().items()}
torch.save({"losses": full.losses, "resumed_losses": resumed.losses, "resumed_start": resumed.start_step,
            "weights": weights, "resumed_weights": resumed_weights, "world_size": full.world_size},
           f"{out_dir}/rank-{os.environ['RANK']}.pt")
torch.distributed.destroy_process_group()
