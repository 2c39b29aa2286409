"""What the hardware a run or trace was recorded on supports: the one place a fix asks before it names a
dtype, TF32, pinned memory or a number of DataLoader workers, so that no fix advises what the device lacks
(bf16 or TF32 before Ampere, pin_memory without a GPU) or more workers than the host had cores.

    hardware = Hardware.of(meta, cpu_count=4)
    hardware.bf16, hardware.pin_memory, hardware.loader_workers, hardware.autocast
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuprof.analysis.run.summary import primary_device

# Ampere: bf16 and TF32 on tensor cores. Volta and Turing have fp16 tensor cores only.
BF16_MIN_CAPABILITY = (8, 0)
MAX_LOADER_WORKERS = 4
LOADER_PREFETCH_FACTOR = 2
BF16_AUTOCAST = "bf16 autocast (torch.autocast('cuda', dtype=torch.bfloat16))"
FP16_AUTOCAST = ("fp16 autocast with a GradScaler (torch.autocast('cuda', dtype=torch.float16) and "
                 "torch.amp.GradScaler('cuda'))")


def parse_capability(value) -> tuple[int, int] | None:
    """CUDA compute capability as (major, minor), from "8.0" or [8, 0]."""
    if value is None:
        return None
    parts = str(value).split(".") if isinstance(value, (str, float)) else list(value)
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except (ValueError, IndexError):
        return None


@dataclass(frozen=True)
class Hardware:
    """The first device (its kind and CUDA capability) and the host's CPU count, None where not recorded."""

    device_kind: str | None = None
    capability: tuple[int, int] | None = None
    cpu_count: int | None = None

    @classmethod
    def of(cls, meta: dict, cpu_count: int | None = None) -> "Hardware":
        device = primary_device(meta or {})
        return cls(device.get("kind"), parse_capability(device.get("capability")), cpu_count)

    @property
    def on_gpu(self) -> bool:
        return self.device_kind == "cuda"

    @property
    def bf16(self) -> bool | None:
        """Whether the GPU computes bf16 (and TF32) on tensor cores; None on a GPU of unknown capability,
        False without a GPU (a CPU's bf16 support is not recorded)."""
        if not self.on_gpu:
            return False
        return None if self.capability is None else self.capability >= BF16_MIN_CAPABILITY

    @property
    def pin_memory(self) -> bool:
        """Pinned host memory only speeds up copies to a GPU."""
        return self.on_gpu

    @property
    def loader_workers(self) -> int:
        """DataLoader workers to advise: one per CPU core of the host, at most MAX_LOADER_WORKERS."""
        return max(1, min(MAX_LOADER_WORKERS, self.cpu_count or MAX_LOADER_WORKERS))

    def loader_arguments(self) -> str:
        """DataLoader keywords that prepare batches in the background on this host."""
        pinned = ", pin_memory=True" if self.pin_memory else ""
        return (f"num_workers={self.loader_workers}{pinned}, persistent_workers=True, "
                f"prefetch_factor={LOADER_PREFETCH_FACTOR}")

    @property
    def autocast(self) -> str | None:
        """The mixed precision the GPU runs fastest: bf16 from Ampere on, fp16 with a GradScaler before; both
        named where the capability is unknown; None without a GPU."""
        if not self.on_gpu:
            return None
        if self.bf16 is None:
            return f"{BF16_AUTOCAST} from Ampere on, {FP16_AUTOCAST} before"
        return BF16_AUTOCAST if self.bf16 else FP16_AUTOCAST

    @property
    def half_dtype(self) -> str:
        """The 16-bit dtype to keep weights or activations in: float16 on a GPU without bf16."""
        return "torch.float16" if self.bf16 is False and self.on_gpu else "torch.bfloat16"
