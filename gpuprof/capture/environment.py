"""Facts about where the run happens: rank, devices, library versions."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import socket
from dataclasses import dataclass

import psutil
import torch

import gpuprof
from gpuprof import torch_compat
from gpuprof.modules import initialized


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: int
    world_size: int


def rank_info() -> RankInfo:
    """From an initialized torch.distributed group, else torchrun's environment, else a single process."""
    if initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return RankInfo(rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", rank)), world_size=world)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(driver: str | None) -> dict[str, str | None]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "gpuprof": gpuprof.__version__,
        "driver": driver,
        "torch_internals_missing": ", ".join(torch_compat.missing()) or None,  # each one's signal is off
    }


def device_facts(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {
            "index": device.index if device.index is not None else torch.cuda.current_device(),
            "name": props.name,
            "kind": "cuda",
            "total_memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
        }
    return {"index": None, "name": platform.processor() or platform.machine(), "kind": device.type,
            "total_memory_bytes": None, "capability": None, "cpu_count": os.cpu_count()}


def host_facts() -> dict:
    # psutil's count: the scale of the host_cpu_pct it measures
    return {"host": socket.gethostname(), "host_cpu_count": psutil.cpu_count(), "pid": os.getpid(),
            "platform": platform.platform()}


def torch_settings() -> dict:
    """torch's global numerics/speed switches, as the loop runs with them."""
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
    }


def resolve_device(model: torch.nn.Module | None) -> torch.device:
    if model is not None:
        for param in model.parameters():
            return param.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
