"""Capture: instrument a training loop (`profile`, `Profiler`) and plug in collectors (`Collector`, `StepState`)."""

from gpuprof.capture.collector import Collector, StepState
from gpuprof.capture.profiler import Profiler, profile

__all__ = ["Collector", "Profiler", "StepState", "profile"]
