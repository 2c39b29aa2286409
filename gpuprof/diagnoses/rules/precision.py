"""Matmuls in full fp32 on a GPU that has tensor cores.

Seen in what the loop ran (the autocast dtype capture saw in the forward, else the compute
dtype it recorded, and torch's TF32 settings at start), or in the device trace: the share
of matmul time spent in tensor-core kernels.
"""

from __future__ import annotations

from gpuprof.diagnoses.finding import Finding
from gpuprof.diagnoses.knob import knob
from gpuprof.diagnoses.recorded_loop import FP32_NAMES, recorded_dtype
from gpuprof.diagnoses.registry import rule

# torch.set_float32_matmul_precision levels that let fp32 matmuls use TF32 (or bf16) tensor cores.
TENSOR_CORE_FP32_PRECISIONS = {"high", "medium"}
TENSOR_CORE_MATMUL_MIN_PCT = 50.0


def tf32_enabled(ctx) -> bool | None:
    """Whether fp32 matmuls may use TF32, from torch's settings at start (None when not recorded)."""
    settings = ctx.loop("torch")
    if not settings:
        return None
    return bool(settings.get("cuda_matmul_allow_tf32")) or settings.get("float32_matmul_precision") in TENSOR_CORE_FP32_PRECISIONS


def trace_tensor_core_pct(ctx) -> float | None:
    trace = ctx.device_trace
    share = trace.tensor_core_share() if trace is not None else None
    if share is None or share.empty or not share["matmul_time_us"].sum():
        return None
    return float(100 * share["tensor_core_time_us"].sum() / share["matmul_time_us"].sum())


@rule("fp32-matmul", "compute", gpu_only=True, on_trace=True)
def fp32_matmul(ctx):
    if not ctx.has_tensor_cores:
        return None
    dtype, tensor_core_pct = recorded_dtype(ctx.meta), trace_tensor_core_pct(ctx)
    tf32 = tf32_enabled(ctx)
    fp32_settings = dtype in FP32_NAMES and tf32 is False
    idle_tensor_cores = tensor_core_pct is not None and tensor_core_pct < TENSOR_CORE_MATMUL_MIN_PCT
    if not (idle_tensor_cores or (fp32_settings and tensor_core_pct is None)):
        return None
    device = ctx.device
    return Finding(
        rule="fp32-matmul",
        severity="warning",
        title="Matmuls run in full fp32, leaving the tensor cores idle"
        + (f" ({tensor_core_pct:.0f}% of matmul time on tensor cores)" if tensor_core_pct is not None else ""),
        evidence={
            "compute_dtype": dtype,
            "tf32": tf32,
            "float32_matmul_precision": ctx.loop("torch").get("float32_matmul_precision"),
            "tensor_core_matmul_pct": tensor_core_pct,
            "device_name": device.get("name"),
            "capability": device.get("capability"),
            "threshold_pct": TENSOR_CORE_MATMUL_MIN_PCT,
        },
        fix=precision_fix(ctx),
    )


def precision_fix(ctx) -> str:
    """Mixed precision the GPU has: bf16, and TF32 for what stays fp32, from Ampere on; fp16 with a GradScaler
    before (a V100 has neither bf16 nor TF32)."""
    hardware = ctx.hardware
    fix = f"Run forward and loss under {hardware.autocast}"
    if hardware.bf16 is False:
        return f"{fix}{ctx.workload_flags('--precision fp16')}: this GPU's tensor cores compute in fp16."
    tf32 = "torch.backends.cuda.matmul.allow_tf32 = True" + (" (Ampere on)" if hardware.bf16 is None else "")
    return f"{fix}, or at least {tf32}{ctx.workload_flags('--precision bf16 --tf32')}."


@knob("bf16-autocast", rule="fp32-matmul", train_flags=("--precision", "bf16"))
def bf16_autocast(patch):
    """The model's forward runs under torch.autocast(dtype=torch.bfloat16) on the model's device, where
    that device computes in bf16 (a CPU with bf16 instructions, AVX512-BF16 or AMX, as oneDNN reports;
    a GPU from Ampere on). Elsewhere bf16 is emulated, several times slower than fp32, and nothing changes.

    A model whose parameters are not fp32, and a forward the script already runs under autocast, are
    left as they are. A loss the script computes outside the model sees bf16 logits."""

    def autocast_forward(model) -> str | None:
        import functools

        import torch

        from gpuprof.hardware import native_bf16

        param = next(model.parameters())
        device = param.device.type
        if not native_bf16(device) or param.dtype != torch.float32:
            return None
        forward = model.forward

        @functools.wraps(forward)
        def bf16_forward(*args, **kwargs):
            if torch.is_autocast_enabled(device):
                return forward(*args, **kwargs)
            with torch.autocast(device, dtype=torch.bfloat16):
                return forward(*args, **kwargs)

        model.forward = bf16_forward
        return f"{{model}}.forward = torch.autocast({device!r}, dtype=torch.bfloat16)({{model}}.forward)"

    patch.model(autocast_forward)


@knob("tf32", rule="fp32-matmul", train_flags=("--tf32",))
def tf32(patch):
    """torch.set_float32_matmul_precision("high"): fp32 matmuls may run on TF32 tensor cores (CUDA,
    Ampere on); a CPU has none and runs as before."""
    import torch

    def allow_tf32():
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        return lambda: torch.set_float32_matmul_precision(before)

    patch.setting(allow_tf32, 'torch.set_float32_matmul_precision("high")')
