"""The built-in collectors a Profiler starts with, in the order they see each step."""

from __future__ import annotations

import torch

from gpuprof.capture.ddp import DdpCollector
from gpuprof.capture.fsdp import FsdpCollector
from gpuprof.capture.gradients import GradientCollector
from gpuprof.capture.live_export import LiveTensorBoard
from gpuprof.capture.loopfacts import LoopFacts
from gpuprof.capture.memory import MemoryCollector
from gpuprof.capture.oom import OomCollector
from gpuprof.capture.optimizer import OptimizerCollector
from gpuprof.capture.scaler import ScalerCollector
from gpuprof.capture.stack_sampler import StackSampler
from gpuprof.capture.system import SystemSampler
from gpuprof.capture.trace import TraceCollector
from gpuprof.capture.watchdog import HangWatchdog
from gpuprof.modules import is_sharded
from gpuprof.numerics.monitor import NumericsMonitor
from gpuprof.numerics.tape import Tape
from gpuprof.optimizers import has_step_hooks


def builtin_collectors(prof) -> list:
    options = prof.options
    stacks = StackSampler(options.stack_interval_s) if options.stack_interval_s else None
    sampler = SystemSampler(options.sample_interval_s, stacks) if options.sample_interval_s or stacks else None
    system_rows = sampler if options.sample_interval_s else None
    # phases first: its backward-end stamp comes before the other collectors' work on the gradients
    collectors = [prof.phase_hooks, prof.model_info, LoopFacts(prof.model, prof.optimizer, prof.loader), stacks,
                  sampler, MemoryCollector(prof.device, system_rows), OomCollector(prof.device, options.memory_history)]
    # an optimizer without step hooks (reported by phase_hooks) is left to the collectors that need none
    hookable_optimizer = prof.optimizer if has_step_hooks(prof.optimizer) else None
    gradients = None
    if prof.model is not None and options.grad_norms:
        gradients = GradientCollector(prof.model, hookable_optimizer, prof.scaler,
                                      options.layer_interval, options.update_ratio_interval)
        collectors.append(gradients)
    if hookable_optimizer is not None:
        collectors.append(OptimizerCollector(hookable_optimizer, prof.lr_scheduler, prof.scaler))
    if prof.scaler is not None:
        collectors.append(ScalerCollector(prof.scaler))
    if isinstance(prof.model, torch.nn.parallel.DistributedDataParallel):
        collectors.append(DdpCollector(prof.model))
    if is_sharded(prof.model):
        collectors.append(FsdpCollector(prof.model, prof.optimizer))
    if prof.model is not None and options.numerics is not None:
        tape = Tape(prof.model, prof.scaler)  # before the monitor: the step's tape is taken at its end
        collectors += [tape, NumericsMonitor(
            prof.model, hookable_optimizer, prof.scaler, loss_fn=prof.loss_fn, on_nonfinite=options.on_nonfinite,
            options=options.numerics, gradients=gradients,
            tape=tape)]
    if options.trace_steps:
        collectors.append(TraceCollector(options.trace_steps, options.record_shapes,
                                         options.profile_memory, options.with_stack))
    if options.hang_timeout_s != 0:
        collectors.append(HangWatchdog(options.hang_timeout_s))
    if options.live_export is not None:
        collectors.append(LiveTensorBoard(options.live_export))
    return [collector for collector in collectors if collector is not None]
