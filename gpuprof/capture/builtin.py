"""The built-in collectors a Profiler starts with, in the order they see each step."""

from __future__ import annotations

import torch

from gpuprof.capture.distributed import DdpCollector
from gpuprof.capture.gradients import GradientCollector
from gpuprof.capture.memory import MemoryCollector
from gpuprof.capture.oom import OomCollector
from gpuprof.capture.optimizer import OptimizerCollector
from gpuprof.capture.scaler import ScalerCollector
from gpuprof.capture.system import SystemSampler
from gpuprof.capture.trace import TraceCollector


def builtin_collectors(prof) -> list:
    options = prof.options
    sampler = SystemSampler(options["sample_interval_s"]) if options["sample_interval_s"] else None
    collectors = [prof.model_info, sampler, MemoryCollector(prof.device, sampler),
                  OomCollector(prof.device, options["memory_history"])]
    gradients = None
    if prof.model is not None and options["grad_norms"]:
        gradients = GradientCollector(prof.model, prof.optimizer, prof.scaler,
                                      options["layer_interval"], options["update_ratio_interval"])
        collectors.append(gradients)
    if prof.optimizer is not None:
        collectors.append(OptimizerCollector(prof.optimizer, prof.lr_scheduler, prof.scaler))
    if prof.scaler is not None:
        collectors.append(ScalerCollector(prof.scaler))
    if isinstance(prof.model, torch.nn.parallel.DistributedDataParallel):
        collectors.append(DdpCollector(prof.model))
    if prof.model is not None and options["numerics"] is not False:
        from gpuprof.numerics.monitor import NumericsMonitor

        collectors.append(NumericsMonitor(
            prof.model, prof.optimizer, prof.scaler, loss_fn=prof.loss_fn, on_nonfinite=options["on_nonfinite"],
            options=options["numerics"] if isinstance(options["numerics"], dict) else None, gradients=gradients))
    if options["trace_steps"]:
        collectors.append(TraceCollector(options["trace_steps"], options["record_shapes"],
                                         options["profile_memory"], options["with_stack"]))
    return [collector for collector in collectors if collector is not None]
