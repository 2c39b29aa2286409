"""Every knob of the GPT-2 reference workload, the model sizes and the two variant presets.

`TrainConfig` is the single source of truth: the CLI builds one from its flags, the
Python API takes one directly, and `dataclasses.asdict(config)` is what the run
records. A knob left at `None` takes its value from the variant preset (or from the
model size for `batch_size` / `seq_len`), so any single knob can be A/B-ed on its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gpuprof.errors import GpuprofError

# nanoGPT's trick: 50257 rounded up to a multiple of 64 so the vocabulary matmul is fast.
PADDED_VOCAB_SIZE = 50304


@dataclass(frozen=True)
class ModelSize:
    n_layer: int
    n_head: int
    d_model: int
    n_positions: int
    batch_size: int  # default sequences per optimizer step per rank
    vocab_size: int = PADDED_VOCAB_SIZE


# `tiny` is for tests and CPU demos, not a GPT-2: its vocabulary matches the 8192-token
# tokenizer, so the LM head does not dwarf the two blocks the diagnoses are about.
SIZES = {
    "tiny": ModelSize(n_layer=2, n_head=4, d_model=128, n_positions=256, batch_size=8, vocab_size=8192),
    "gpt2": ModelSize(n_layer=12, n_head=12, d_model=768, n_positions=1024, batch_size=8),
    "gpt2-medium": ModelSize(n_layer=24, n_head=16, d_model=1024, n_positions=1024, batch_size=8),
    "gpt2-large": ModelSize(n_layer=36, n_head=20, d_model=1280, n_positions=1024, batch_size=4),
    "gpt2-xl": ModelSize(n_layer=48, n_head=25, d_model=1600, n_positions=1024, batch_size=4),
}

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
ATTENTIONS = ("eager", "sdpa")
DEVICES = ("auto", "cpu", "cuda")
# Under torchrun: DistributedDataParallel (every rank holds the whole model) or FSDP2
# (`fully_shard` per block and on the root: parameters, gradients and optimizer state sharded).
PARALLELS = ("ddp", "fsdp")

# The knobs a variant decides. Activation checkpointing and torch.compile stay off in
# `optimized` too: they are toggles (memory for speed, compile time for speed).
VARIANTS = {
    "baseline": {
        "precision": "fp32",
        "attention": "eager",
        "grad_accum": 1,
        "activation_checkpointing": False,
        "fused_adamw": False,
        "tf32": False,
        "num_workers": 0,
        "pin_memory": False,
        "grad_clip": 0.0,
        "compile": False,
    },
    "optimized": {
        "precision": "auto",
        "attention": "sdpa",
        "grad_accum": 2,
        "activation_checkpointing": False,
        "fused_adamw": True,
        "tf32": True,
        "num_workers": 2,
        "pin_memory": True,
        "grad_clip": 1.0,
        "compile": False,
    },
}


@dataclass
class TrainConfig:
    model_size: str = "tiny"
    variant: str = "baseline"
    steps: int = 50
    # Sequences per optimizer step per rank; `grad_accum` splits them into micro-batches,
    # so both variants see the same data per step and start from the same loss.
    batch_size: int | None = None
    seq_len: int | None = None
    vocab_size: int | None = None  # None: the model size's (50304 for the GPT-2 sizes)
    n_layer: int | None = None  # None: the model size's transformer blocks
    dropout: float = 0.0
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    seed: int = 1337
    device: str = "auto"
    # Several processes (torchrun): how the model is spread over them.
    parallel: str = "ddp"
    reshard_after_forward: bool = True  # fsdp: free gathered parameters after forward (gather again in backward)
    cpu_offload: bool = False  # fsdp: keep sharded parameters, gradients and optimizer state in host memory
    # Variant knobs (None: from the preset).
    precision: str | None = None
    attention: str | None = None
    grad_accum: int | None = None
    activation_checkpointing: bool | None = None
    fused_adamw: bool | None = None
    tf32: bool | None = None
    num_workers: int | None = None
    pin_memory: bool | None = None
    grad_clip: float | None = None
    compile: bool | None = None
    # Data, recording, checkpoints.
    data: str | None = None
    run_dir: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    log_every: int = 10
    trace_steps: str | None = None  # "A:B": a torch.profiler window over steps A..B-1
    sample_interval_s: float | str = "auto"  # the device and host sampler's period (gpuprof.profile's)
    # Problems on purpose, for demonstrating the diagnoses.
    data_delay_ms: float = 0.0
    host_sync: bool = False
    host_work_ms: float = 0.0  # busy host work every step (a regression on purpose, for `compare --gate`)
    straggler_rank: int | None = None
    straggler_delay_ms: float = 0.0
    inject: list[str] | None = None  # faults, "FAULT@STEP" (gpuprof/workloads/gpt2/faults.py)
    on_nonfinite: str = "record"  # record | raise | skip (gpuprof.numerics)

    def __post_init__(self):
        _check_choice("model size", self.model_size, SIZES)
        _check_choice("variant", self.variant, VARIANTS)
        for knob, value in VARIANTS[self.variant].items():
            if getattr(self, knob) is None:
                setattr(self, knob, value)
        size = SIZES[self.model_size]
        self.batch_size = size.batch_size if self.batch_size is None else self.batch_size
        self.seq_len = size.n_positions if self.seq_len is None else self.seq_len
        self.vocab_size = size.vocab_size if self.vocab_size is None else self.vocab_size
        self.n_layer = size.n_layer if self.n_layer is None else self.n_layer
        self._validate(size)
        self.trace_window  # a malformed window fails now, not mid-run

    @property
    def trace_window(self) -> range | None:
        if self.trace_steps is None:
            return None
        first, _, stop = self.trace_steps.partition(":")
        try:
            window = range(int(first), int(stop))
        except ValueError:
            raise GpuprofError(f"trace steps must be START:STOP, e.g. 3:6, not {self.trace_steps!r}") from None
        if not window:
            raise GpuprofError(f"trace steps {self.trace_steps!r} hold no step (STOP must exceed START)")
        return window

    def _validate(self, size: ModelSize) -> None:
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("attention", self.attention, ATTENTIONS)
        _check_choice("device", self.device, DEVICES)
        _check_choice("parallel", self.parallel, PARALLELS)
        if self.parallel != "fsdp" and (self.cpu_offload or not self.reshard_after_forward):
            raise GpuprofError("--cpu-offload and --no-reshard-after-forward need --parallel fsdp")
        if self.parallel == "fsdp" and self.precision == "fp16":
            raise GpuprofError("--parallel fsdp runs bf16 or fp32: fp16 needs a GradScaler that agrees across "
                               "shards, which this workload does not use")
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "vocab_size", "n_layer", "log_every"):
            if getattr(self, name) < 1:
                raise GpuprofError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("num_workers", "checkpoint_every", "warmup_steps", "data_delay_ms", "host_work_ms",
                     "straggler_delay_ms", "grad_clip", "lr", "weight_decay"):
            if getattr(self, name) < 0:
                raise GpuprofError(f"{name} must not be negative, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise GpuprofError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.seq_len > size.n_positions:
            raise GpuprofError(
                f"seq_len {self.seq_len} exceeds the {self.model_size} context of {size.n_positions}"
            )
        if self.batch_size % self.grad_accum:
            raise GpuprofError(
                f"batch_size {self.batch_size} is not divisible by grad_accum {self.grad_accum}"
            )

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.grad_accum

    @property
    def tokens_per_step(self) -> int:
        """Tokens one rank trains on per optimizer step."""
        return self.batch_size * self.seq_len

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_choice(what: str, value, choices) -> None:
    if value not in choices:
        raise GpuprofError(f"unknown {what} {value!r}; choose from {', '.join(choices)}")
