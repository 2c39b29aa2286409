"""The FLOPs-per-token formula and the peak-FLOPS table."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from gpuprof import flops, hardware


def test_gpt2_124m_flops_per_token_follows_nanogpt():
    with torch.device("meta"):  # shapes only, no memory
        model = GPT2LMHeadModel(GPT2Config())  # 124M: 12 layers, 12 heads, d=768, 1024 positions
    n_params = sum(p.numel() for p in model.parameters()) - 1024 * 768  # without position embeddings
    assert n_params == 123_653_376
    assert flops.model_flops_per_token(model, 1024) == 6 * n_params + 12 * 12 * 12 * 64 * 1024


@pytest.mark.parametrize(("name", "dtype", "peak"), [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H200", "bf16", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
    ("Tesla V100-SXM2-32GB", "fp16", 125e12),
    ("NVIDIA L4", "fp16", 121e12),
    ("NVIDIA L40S", "bf16", 362.05e12),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
    ("NVIDIA GeForce RTX 3090", "fp32", 35.6e12),
])
def test_known_peaks(name, dtype, peak):
    assert hardware.peak_flops_per_s(name, dtype) == pytest.approx(peak)


@pytest.mark.parametrize(("name", "dtype"), [
    ("NVIDIA GeForce RTX 3090 Ti", "bf16"), ("NVIDIA A10G", "bf16"), ("Tesla V100-SXM2-32GB", "bf16"), (None, "bf16"),
])
def test_unknown_peaks_are_none(name, dtype):
    assert hardware.peak_flops_per_s(name, dtype) is None
