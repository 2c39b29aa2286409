"""Faults injected on purpose (`gpuprof train --inject FAULT@STEP`), each with a known culprit.

- `attn-overflow`: the last block's query/key projections x1000, so QK^T overflows fp16
  (needs --precision fp16; eager attention) -> forward, transformer.h.L.attn, aten::bmm, inf
- `embedding-nan`: a NaN in one row of the token embedding -> state, transformer.wte
- `ignored-labels`: every label of the step's batch is the ignore index, and the mean
  cross-entropy over nothing is 0/0 -> loss, outside any module, aten::nll_loss_forward, nan
- `lr-spike`: the step's learning rate is 1e20 -> non-finite at STEP+1, cause: step STEP
- `sqrt-zero`: the last block's MLP output passes a gate computing sqrt(mean((y*m)^2)); m
  turns 0 at STEP: forward stays finite, sqrt's gradient at 0 is infinite -> backward,
  transformer.h.L.mlp

State faults are written before the forward pass of STEP, so the state that step starts
from (which gpuprof keeps) holds them; the re-run sees exactly what training saw.
docs/numerics.md lists the blame each one gets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gpuprof.errors import GpuprofError

FAULTS = ("attn-overflow", "embedding-nan", "ignored-labels", "lr-spike", "sqrt-zero")
ATTENTION_SCALE = 1000.0  # q and k grow 1000x: scores ~1e6 > fp16's 65504, q and k themselves fit
SPIKED_LR = 1e20
IGNORE_INDEX = -100  # F.cross_entropy's default
EMBEDDING_ROW = 0
_SPEC = re.compile(r"^([a-z-]+)@(\d+)$")


@dataclass(frozen=True)
class Fault:
    name: str
    step: int


def parse(spec: str) -> Fault:
    """`attn-overflow@5` -> Fault("attn-overflow", 5); GpuprofError (one line) otherwise."""
    match = _SPEC.match(spec.strip())
    if not match or match.group(1) not in FAULTS:
        raise GpuprofError(f"bad --inject {spec!r}: expected FAULT@STEP with FAULT one of {', '.join(FAULTS)}")
    return Fault(match.group(1), int(match.group(2)))


class SqrtGate(torch.nn.Module):
    """y * (1 + sqrt(mean((y * live)^2))): harmless while live is 1; at live 0 only backward breaks."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.register_buffer("live", torch.ones(()))

    def forward(self, hidden_states):
        y = self.inner(hidden_states)
        return y * (1 + torch.sqrt((y * self.live).pow(2).mean(-1, keepdim=True)))


class Injector:
    """Applies the configured faults at their steps; a no-op without faults."""

    def __init__(self, faults: list[Fault]):
        self.faults = faults

    @classmethod
    def from_specs(cls, specs: list[str] | None) -> "Injector":
        return cls([parse(spec) for spec in specs or []])

    def _at(self, name: str, step: int) -> bool:
        return any(f.name == name and f.step == step for f in self.faults)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Installs the modules a fault needs (before training, so every step runs them)."""
        if any(f.name == "sqrt-zero" for f in self.faults):
            block = model.transformer.h[-1]
            block.mlp = SqrtGate(block.mlp)
        return model

    def before_step(self, step: int, model: torch.nn.Module) -> None:
        """State faults of `step`, written before its forward pass."""
        with torch.no_grad():
            if self._at("attn-overflow", step):
                attn = model.transformer.h[-1].attn
                width = attn.embed_dim
                attn.c_attn.weight[:, : 2 * width] *= ATTENTION_SCALE
                attn.c_attn.bias[: 2 * width] *= ATTENTION_SCALE
            if self._at("embedding-nan", step):
                model.transformer.wte.weight[EMBEDDING_ROW] = float("nan")
            if self._at("sqrt-zero", step):
                model.transformer.h[-1].mlp.live.zero_()

    def lr(self, step: int, lr: float) -> float:
        return SPIKED_LR if self._at("lr-spike", step) else lr

    def targets(self, step: int, targets: torch.Tensor) -> torch.Tensor:
        return torch.full_like(targets, IGNORE_INDEX) if self._at("ignored-labels", step) else targets


def replay_model(config: dict) -> tuple[torch.nn.Module, object]:
    """The workload's model (with its fault modules) and loss, rebuilt for `gpuprof replay`."""
    from gpuprof.workloads.gpt2.config import TrainConfig
    from gpuprof.workloads.gpt2.model import build_model

    try:
        train_config = TrainConfig(**config)
    except TypeError as error:
        raise GpuprofError(f"bundle holds an unknown workload config: {error}") from None
    model = Injector.from_specs(train_config.inject).prepare_model(build_model(train_config))
    return model, workload_loss(train_config.grad_accum)


def workload_loss(grad_accum: int):
    """The loss the loop computes for one micro-batch (inputs, targets), for NaN forensics."""
    from gpuprof.workloads.gpt2.model import lm_loss

    return lambda model, batch: lm_loss(model, *batch) / grad_accum
