"""Under torchrun: `gpuprof train` once per argument list, one after the other, in one process group.

    torchrun --nproc-per-node 2 train_runs.py '[["train", "--parallel", "fsdp", ...], ["train", ...]]'

This process joins the group, so each `gpuprof train` finds it joined and leaves it for the next.
"""

import json
import sys

import torch

from gpuprof.cli import main

torch.distributed.init_process_group("gloo")
for argv in json.loads(sys.argv[1]):
    if main(argv) != 0:
        sys.exit(f"gpuprof {' '.join(argv)} failed")
torch.distributed.destroy_process_group()
