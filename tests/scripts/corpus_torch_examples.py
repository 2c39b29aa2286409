"""pytorch/examples' distributed examples, unmodified, under torchrun on two gloo ranks of this machine's CPU (what
they ask of GPUs is adapted from outside: torch_examples_patches.py).

    run_fsdp2_example(tmp_path, patches=(), gpuprof_args=(), how=run_script) -> ScriptRun
        distributed/FSDP2/example.py (its model.py, checkpoint.py, utils.py beside it): a 10-layer toy Transformer
        built on the meta device, `fully_shard` on each layer and the root, 10 iterations of Adam on random tokens
        (`loss = model(x).sum()`, `clip_grad_norm_`), then a full-state checkpoint under work/checkpoints.
    run_ddp_tutorial(tmp_path, patches=(), epochs=.., batch_size=.., gpuprof_args=(), how=run_script) -> ScriptRun
        distributed/ddp-tutorial-series/multigpu_torchrun.py (its datautils.py beside it): a Linear(20, 1) under
        DDP, SGD over MyTrainDataset(2048) split by a DistributedSampler, a snapshot.pt each epoch.

`how=script_launch` gives the launch instead of running it (script_corpus.py), for a job a test stops itself.
"""

from __future__ import annotations

import math
from pathlib import Path

from script_corpus import run_script

RANKS = 2
FSDP2_ITERATIONS = 10  # its loop: `for _ in range(10)`
FSDP2_TOKENS = 32 * 64  # its batch_size x seq_len
FSDP2_MODEL = "model:Transformer"  # the class its model.py defines; fully_shard subclasses it (FSDPTransformer)
FSDP2_ON_CPU = ("torch_examples_patches:cpu_accelerators", "torch_examples_patches:reset_every_layer")

DDP_SAMPLES = 2048  # MyTrainDataset(2048) in its load_train_objs()
DDP_EPOCHS, DDP_BATCH = 2, 128  # its own positional total_epochs and --batch_size: 8 steps an epoch on 2 ranks
DDP_ON_CPU = ("torch_examples_patches:cuda_to_cpu",)


def run_fsdp2_example(tmp_path: Path, patches=(), gpuprof_args=(), how=run_script):
    return how("fsdp2_example", tmp_path, [], patches=(*FSDP2_ON_CPU, *patches), ranks=RANKS,
               gpuprof_args=gpuprof_args)


def run_ddp_tutorial(tmp_path: Path, patches=(), epochs: int = DDP_EPOCHS, batch_size: int = DDP_BATCH,
                     gpuprof_args=(), how=run_script):
    """Saving a snapshot every epoch (its `save_every` 1), to snapshot.pt in its working folder."""
    return how("ddp_tutorial", tmp_path, [epochs, 1, "--batch_size", batch_size], patches=(*DDP_ON_CPU, *patches),
               ranks=RANKS, gpuprof_args=gpuprof_args)


def ddp_tutorial_steps_per_epoch(batch_size: int = DDP_BATCH) -> int:
    """Its DistributedSampler gives each rank ceil(samples / ranks) of them, batched by its DataLoader."""
    return math.ceil(math.ceil(DDP_SAMPLES / RANKS) / batch_size)
