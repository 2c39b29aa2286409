"""Peak dense FLOP/s by GPU model and compute dtype: the one table MFU is computed against.

Figures are the vendors' datasheet numbers for dense math (the "with sparsity" figures
halved where a datasheet quotes only those), per GPU, in FLOP/s. Tensor-core figures
are used for bf16/fp16/tf32/fp8; fp32 is the non-tensor-core figure. A GPU or dtype
not in the table has an unknown peak (None) rather than a guessed one.

Sources: NVIDIA datasheets for V100 (2020), A100 (2021), A10, T4, H100 (SXM, PCIe, NVL),
H200 (SXM, NVL), L4, L40, L40S; the Ampere GA102 and Ada Lovelace whitepapers for
RTX 3090 and RTX 4090 (FP16/BF16 tensor with FP32 accumulate, which PyTorch uses).
"""

from __future__ import annotations

import re

import torch

from gpuprof.torch_compat import private

T = 1e12

# (pattern matched against the device name, {dtype: dense peak FLOP/s}); first match wins,
# so the more specific names come first.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100.*NVL", {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T}),
    (r"H100.*PCIe", {"fp32": 51.2 * T, "tf32": 378 * T, "bf16": 756 * T, "fp16": 756 * T, "fp8": 1513 * T}),
    (r"H100", {"fp32": 66.9 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T}),
    (r"H200.*NVL", {"fp32": 60 * T, "tf32": 417.5 * T, "bf16": 835.5 * T, "fp16": 835.5 * T, "fp8": 1670.5 * T}),
    (r"H200", {"fp32": 66.9 * T, "tf32": 494.7 * T, "bf16": 989.4 * T, "fp16": 989.4 * T, "fp8": 1978.9 * T}),
    (r"A100", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T}),
    (r"A10\b", {"fp32": 31.2 * T, "tf32": 62.5 * T, "bf16": 125 * T, "fp16": 125 * T}),
    (r"V100.*PCIE", {"fp32": 14 * T, "fp16": 112 * T}),
    (r"V100", {"fp32": 15.7 * T, "fp16": 125 * T}),
    (r"\bT4\b", {"fp32": 8.1 * T, "fp16": 65 * T}),
    (r"L40S", {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362.05 * T, "fp16": 362.05 * T, "fp8": 733 * T}),
    (r"L40\b", {"fp32": 90.5 * T, "tf32": 90.5 * T, "bf16": 181.05 * T, "fp16": 181.05 * T, "fp8": 362 * T}),
    (r"\bL4\b", {"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T, "fp8": 242.5 * T}),
    (r"RTX 4090(?! D)", {"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165.2 * T, "fp16": 165.2 * T, "fp8": 330.3 * T}),
    (r"RTX 3090(?! Ti)", {"fp32": 35.6 * T, "tf32": 35.6 * T, "bf16": 71 * T, "fp16": 71 * T}),
)

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def native_bf16(device_type: str) -> bool:
    """Whether `device_type` computes bf16 in hardware: a GPU from Ampere on, or a CPU whose oneDNN has a bf16
    path (AVX512-BF16, AMX). Elsewhere bf16 is emulated, several times slower than fp32."""
    if device_type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return device_type == "cpu" and private("torch.ops.mkldnn._is_mkldnn_bf16_supported", bool)()


def dtype_name(dtype: torch.dtype | str, allow_tf32: bool = False) -> str:
    """"bf16"/"fp16"/"fp32"/"tf32" for a compute dtype; fp32 matmuls run as tf32 when allowed."""
    name = dtype if isinstance(dtype, str) else _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
    return "tf32" if name == "fp32" and allow_tf32 else name


def peak_flops_per_s(device_name: str | None, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device at `dtype`, or None when the device or dtype is unknown."""
    if not device_name:
        return None
    for pattern, peaks in PEAK_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peaks.get(dtype)
    return None
