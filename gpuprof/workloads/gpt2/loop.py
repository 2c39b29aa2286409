"""The training loop, top to bottom: prepare everything, then run the steps under gpuprof.

    session = prepare(config)   # device, model, optimizer, scaler, data; restores a checkpoint
    result = run(session)       # the steps, recorded to config.run_dir when it is set
    train(config)               # both, and leaves the process group as it found it
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from gpuprof.run import schema
from gpuprof.workloads.gpt2 import checkpoint, distributed
from gpuprof.workloads.gpt2.config import TrainConfig
from gpuprof.workloads.gpt2.console import Progress, peak_memory, summary_line
from gpuprof.workloads.gpt2.data import Batches, build_batches
from gpuprof.workloads.gpt2.faults import Injector, workload_loss
from gpuprof.workloads.gpt2.model import (
    autocast, build_model, build_optimizer, compute_dtype, enable_tf32, grad_scaler, lm_loss,
)


@dataclass
class Session:
    """Everything one rank trains with. `model` is what runs forward (maybe compiled and
    DDP-wrapped); `raw_model` is the GPT2LMHeadModel underneath (under fsdp: sharded in place)."""

    config: TrainConfig
    placement: distributed.Placement
    model: torch.nn.Module
    raw_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    compute_dtype: torch.dtype
    batches: Batches
    start_step: int = 0


@dataclass
class TrainResult:
    config: TrainConfig
    losses: list[float]  # this rank's loss per optimizer step, from start_step on
    start_step: int
    mean_step_time_s: float
    tokens_per_s: float  # all ranks together
    peak_memory_bytes: int
    peak_memory_kind: str
    world_size: int
    model: torch.nn.Module = field(repr=False)

    @property
    def steps_run(self) -> int:
        return len(self.losses)


def train(config: TrainConfig) -> TrainResult:
    session = prepare(config)
    try:
        return run(session)
    finally:
        distributed.teardown(session.placement)


def prepare(config: TrainConfig) -> Session:
    placement = distributed.setup(config.device, config.parallel)
    device = placement.device
    if config.run_dir is not None:  # one run directory for all ranks: rank 0's
        config = dataclasses.replace(config, run_dir=distributed.all_gather(placement, config.run_dir)[0])
    if config.tf32:
        enable_tf32(device)
    pinned = config.pin_memory and device.type == "cuda"
    batches = build_batches(config, placement.rank, placement.world_size, pinned)  # bad data fails fast
    torch.manual_seed(config.seed)  # the same initial weights on every rank and variant
    raw_model = Injector.from_specs(config.inject).prepare_model(build_model(config)).to(device)
    seed_everything(config.seed + placement.rank)  # then per-rank streams (dropout, ...)
    dtype = compute_dtype(config, device)
    if _sharded(config):  # before the optimizer: it must see the sharded parameters
        distributed.shard(raw_model, dtype, reshard_after_forward=config.reshard_after_forward,
                          cpu_offload=config.cpu_offload)
    optimizer = build_optimizer(raw_model, config)
    scaler = grad_scaler(dtype, device)
    start_step = 0
    if config.resume:
        start_step = _resume(config, raw_model, optimizer, scaler, batches, placement)
    model = torch.compile(raw_model) if config.compile else raw_model
    if not _sharded(config):
        model = distributed.replicate(model, placement)
    return Session(config, placement, model, raw_model, optimizer, scaler, dtype, batches, start_step)


def run(session: Session) -> TrainResult:
    config, placement = session.config, session.placement
    progress = Progress(
        enabled=placement.is_main, total_steps=config.steps, start_step=session.start_step,
        log_every=config.log_every, tokens_per_step=config.tokens_per_step * placement.world_size,
        description=f"{config.variant} {config.model_size}",
    )
    losses, first_step_end = [], None
    start = _synchronized_time(placement.device)
    injector = Injector.from_specs(config.inject)
    with progress.logs_above(), _profiler(session) as prof:
        for step in range(session.start_step, config.steps):
            _set_lr(session.optimizer, injector.lr(step, lr_at(step, config)))
            injector.before_step(step, session.raw_model)
            micro_batches = []
            loss = train_step(session, prof, step, micro_batches, injector)
            prof.step(loss=loss, tokens=config.tokens_per_step, batch=micro_batches)
            losses.append(loss)
            if config.host_sync:
                loss.item()  # what a naive loop does to log: waits for the device every step
            _host_work(config.host_work_ms)
            progress.update(step, loss, last=step + 1 == config.steps)
            if first_step_end is None:
                first_step_end = _synchronized_time(placement.device)  # step 0 includes warm-up
            _maybe_checkpoint(session, step + 1)
    progress.close()
    result = _result(session, losses, start, first_step_end, _synchronized_time(placement.device))
    if placement.is_main:
        recorded = f"; recorded in {config.run_dir}" if config.run_dir else ""
        print(summary_line(result) + recorded, flush=True)
    return result


def train_step(session: Session, prof, step: int, micro_batches: list | None = None,
               injector: Injector | None = None) -> torch.Tensor:
    """One optimizer step over `grad_accum` micro-batches; returns the step's mean loss.
    `micro_batches`, when given, receives each (inputs, targets) for NaN forensics."""
    config, device = session.config, session.placement.device
    step_loss = torch.zeros((), device=device)
    for micro in range(config.grad_accum):
        with prof.phase("data"):
            inputs, targets = session.batches.next()
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            if injector is not None:
                targets = injector.targets(step, targets)
            if micro_batches is not None:
                micro_batches.append((inputs, targets))
        with _gradient_sync(session, enabled=micro == config.grad_accum - 1):
            with prof.phase("forward"):
                with autocast(session.compute_dtype, device):
                    loss = lm_loss(session.model, inputs, targets) / config.grad_accum
                if micro == 0:
                    _straggle(session)
            with prof.phase("backward"):
                session.scaler.scale(loss).backward()
        step_loss += loss.detach()
    with prof.phase("optimizer"):
        if config.grad_clip:
            session.scaler.unscale_(session.optimizer)
            torch.nn.utils.clip_grad_norm_(session.raw_model.parameters(), config.grad_clip)
        session.scaler.step(session.optimizer)
        session.scaler.update()
        session.optimizer.zero_grad(set_to_none=True)
    return step_loss


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step (nanoGPT)."""
    warmup = min(config.warmup_steps, config.steps - 1)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - 1 - warmup)
    min_lr = config.lr * config.min_lr_ratio
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (config.lr - min_lr)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)  # also seeds every CUDA device
    np.random.seed(seed % 2**32)
    random.seed(seed)


def run_config(session: Session) -> dict:
    """What the run records as its config: every knob plus what they resolved to."""
    return {
        **session.config.as_dict(),
        "recorded_by": schema.WORKLOAD_COMMAND,
        "compute_dtype": str(session.compute_dtype).removeprefix("torch."),
        "world_size": session.placement.world_size,
        "device_type": session.placement.device.type,
    }


# --------------------------------------------------------------------------- helpers


def _sharded(config: TrainConfig) -> bool:
    return config.parallel == "fsdp"


def _gradient_sync(session: Session, enabled: bool):
    """DDP all-reduces (FSDP reduce-scatters) gradients only on the last micro-batch of a step."""
    if not session.placement.distributed:
        return contextlib.nullcontext()
    if _sharded(session.config):
        session.raw_model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if enabled else session.model.no_sync()


def _straggle(session: Session) -> None:
    config = session.config
    if config.straggler_delay_ms and session.placement.rank == config.straggler_rank:
        time.sleep(config.straggler_delay_ms / 1000)


def _host_work(duration_ms: float) -> None:
    """Keep the host busy, as per-step Python overhead does: a spin to a deadline, not a sleep."""
    deadline = time.perf_counter() + duration_ms / 1000
    while time.perf_counter() < deadline:
        pass


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _synchronized_time(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _maybe_checkpoint(session: Session, next_step: int) -> None:
    config, placement = session.config, session.placement
    every = config.checkpoint_every
    if not every or (next_step % every and next_step != config.steps):
        return
    trainer = checkpoint.trainer_state(
        step=next_step, scaler=session.scaler, data_position=session.batches.position,
        rng_states=distributed.all_gather(placement, checkpoint.rng_state()), config=config.as_dict(),
    )
    if _sharded(config):  # every rank writes its own shards
        checkpoint.save_sharded(_checkpoint_dir(config), trainer, model=session.raw_model,
                                optimizer=session.optimizer, is_main=placement.is_main)
    elif placement.is_main:
        checkpoint.save(_checkpoint_dir(config), trainer, model=session.raw_model, optimizer=session.optimizer)
    distributed.barrier(placement)


def _checkpoint_dir(config: TrainConfig) -> str:
    if config.checkpoint_dir:
        return config.checkpoint_dir
    if config.run_dir:
        return f"{config.run_dir}/checkpoints"
    return "checkpoints"


def _resume(config: TrainConfig, raw_model, optimizer, scaler, batches, placement) -> int:
    if _sharded(config):
        state = checkpoint.load_sharded(config.resume, model=raw_model, optimizer=optimizer)
    else:
        state = checkpoint.load(config.resume, placement.device)
        checkpoint.restore(state, model=raw_model, optimizer=optimizer)
    scaler.load_state_dict(state["scaler"])
    batches.restore(state["data"])
    rng_states = state["rng"]
    checkpoint.set_rng_state(rng_states[placement.rank % len(rng_states)])
    return state["step"]


def _result(session: Session, losses: list, start: float, first_step_end: float | None,
            end: float) -> TrainResult:
    """Mean step time leaves out the first step (warm-up, compilation) when there are more."""
    config, placement = session.config, session.placement
    if len(losses) > 1:
        mean_step_time_s = (end - first_step_end) / (len(losses) - 1)
    else:
        mean_step_time_s = (end - start) if losses else math.nan
    peak_bytes, peak_kind = peak_memory(placement.device)
    return TrainResult(
        config=config,
        losses=torch.stack(losses).tolist() if losses else [],
        start_step=session.start_step,
        mean_step_time_s=mean_step_time_s,
        tokens_per_s=config.tokens_per_step * placement.world_size / mean_step_time_s,
        peak_memory_bytes=peak_bytes,
        peak_memory_kind=peak_kind,
        world_size=placement.world_size,
        model=session.raw_model,
    )


class _NoProfiler:
    """Stands in for gpuprof.profile when the run is not recorded (no run_dir)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def phase(self, name: str):
        return contextlib.nullcontext()

    def step(self, **kwargs) -> None:
        pass


def _profiler(session: Session):
    config = session.config
    if config.run_dir is None:
        return _NoProfiler()
    from torch.nn.parallel import DistributedDataParallel

    import gpuprof
    from gpuprof.capture.ddp import DdpCollector
    from gpuprof.flops import model_flops_per_token

    return gpuprof.profile(
        config.run_dir,
        model=session.raw_model,
        optimizer=session.optimizer,
        scaler=session.scaler if session.scaler.is_enabled() else None,
        config=run_config(session),
        flops_per_token=model_flops_per_token(session.raw_model, config.seq_len),
        loss_fn=workload_loss(config.grad_accum),
        on_nonfinite=config.on_nonfinite,
        trace_steps=config.trace_window,
        sample_interval_s=config.sample_interval_s,
        # the profile sees the plain model (for names and forensics); DDP's own timing needs the wrapper
        collectors=[DdpCollector(session.model)] if isinstance(session.model, DistributedDataParallel) else (),
        numerics={"builder": {"name": "gpt2", "config": config.as_dict()}},
    )
