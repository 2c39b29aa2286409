"""One process or many under torchrun: which rank we are, on which device, and how the
model is spread over the ranks (DDP replicas, or FSDP2 shards).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK (and the rendezvous address); without
them the workload runs as a single process. Multi-node is torchrun's own launch.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpuprof.errors import GpuprofError


@dataclass(frozen=True)
class Placement:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    owns_process_group: bool = False  # whether setup() joined it, so teardown() leaves it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup(device: str, parallel: str = "ddp") -> Placement:
    """Pick the device and, under torchrun, join the process group (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if parallel == "fsdp" and world_size < 2:
        raise GpuprofError("--parallel fsdp shards the model over several processes: run it under "
                           "torchrun --nproc-per-node N (N >= 2)")
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise GpuprofError("--device cuda, but no CUDA device is available")
        torch.cuda.set_device(local_rank)
        placement = Placement(rank, local_rank, world_size, torch.device("cuda", local_rank))
    else:
        placement = Placement(rank, local_rank, world_size, torch.device("cpu"))
    if not placement.distributed or dist.is_initialized():
        return placement
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=placement.device if device == "cuda" else None)
    return dataclasses.replace(placement, owns_process_group=True)


def replicate(model: torch.nn.Module, placement: Placement) -> torch.nn.Module:
    """DistributedDataParallel over the ranks (the model itself on one process)."""
    if not placement.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[placement.local_rank] if placement.device.type == "cuda" else None)


def shard(model: torch.nn.Module, compute_dtype: torch.dtype, *, reshard_after_forward: bool,
          cpu_offload: bool) -> None:
    """FSDP2, in place: each GPT-2 block is one unit, the root holds the embeddings and the head.

    Parameters are gathered in `compute_dtype` and gradients reduced in fp32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if compute_dtype == torch.float16:
        raise GpuprofError("--parallel fsdp runs bf16 or fp32, and this device has no bf16: pass --precision fp32")
    options = {
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy(),
    }
    if compute_dtype != torch.float32:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, **options)
    fully_shard(model, **options)


def barrier(placement: Placement) -> None:
    if placement.distributed:
        dist.barrier()


def all_gather(placement: Placement, value) -> list:
    """Every rank's `value` (any picklable object), in rank order."""
    if not placement.distributed:
        return [value]
    gathered = [None] * placement.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def teardown(placement: Placement) -> None:
    if placement.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
