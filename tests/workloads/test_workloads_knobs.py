"""Every knob is accepted and does what it says, observed inside the real training step."""

from __future__ import annotations

import time

import pytest
import torch
from torch.overrides import TorchFunctionMode

from gpuprof.errors import GpuprofError
from gpuprof.workloads.gpt2 import TrainConfig, prepare, run
from gpuprof.workloads.gpt2.loop import lr_at


class CallRecorder(TorchFunctionMode):
    """Names of the torch functions and tensor methods called while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def record_calls(module: torch.nn.Module, calls: list) -> None:
    module.register_forward_hook(lambda mod, args, output: calls.append(output))


# auto on a CPU: bf16 where oneDNN computes it (AVX512-BF16, AMX), else fp32 (emulated bf16 is slower)
CPU_AUTO_DTYPE = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


@pytest.mark.parametrize(
    ("precision", "dtype", "scaled"),
    [("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
     ("fp16", torch.float16, True), ("auto", CPU_AUTO_DTYPE, False)],
)
def test_precision_is_the_dtype_seen_inside_the_model(small, precision, dtype, scaled):
    session = prepare(small(steps=1, batch_size=2, precision=precision))
    outputs = []
    record_calls(session.raw_model.transformer.h[0].mlp.c_fc, outputs)
    run(session)
    assert [out.dtype for out in outputs] == [dtype]
    assert session.scaler.is_enabled() is scaled
    assert next(session.raw_model.parameters()).dtype == torch.float32  # master weights stay fp32


def test_variants_resolve_to_their_presets(small):
    assert small(variant="optimized").precision == "auto"
    assert small(variant="optimized", precision="fp32").precision == "fp32"  # a flag overrides
    baseline = small()
    assert (baseline.attention, baseline.grad_accum, baseline.num_workers) == ("eager", 1, 0)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attention_implementation(small, attention):
    session = prepare(small(steps=1, batch_size=2, attention=attention))
    with CallRecorder() as recorder:
        run(session)
    assert ("scaled_dot_product_attention" in recorder.names) is (attention == "sdpa")


@pytest.mark.parametrize("grad_accum", [1, 4])
def test_grad_accum_splits_the_step_into_micro_batches(small, grad_accum):
    session = prepare(small(steps=2, batch_size=8, grad_accum=grad_accum))
    shapes = []
    session.raw_model.register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    run(session)
    assert shapes == [(8 // grad_accum, 64)] * (2 * grad_accum)


@pytest.mark.parametrize("enabled", [False, True])
def test_activation_checkpointing_recomputes_blocks_in_backward(small, enabled):
    session = prepare(small(steps=1, batch_size=2, activation_checkpointing=enabled))
    attention_forwards = []
    record_calls(session.raw_model.transformer.h[0].attn, attention_forwards)
    run(session)
    assert session.raw_model.is_activation_checkpointing is enabled
    assert len(attention_forwards) == (2 if enabled else 1)


@pytest.mark.parametrize(("flag", "fused"), [(False, None), (True, True)])
def test_fused_adamw(small, flag, fused):
    session = prepare(small(steps=1, batch_size=2, fused_adamw=flag))
    run(session)
    assert session.optimizer.defaults["fused"] is fused
    assert session.optimizer.state  # it stepped


def test_grad_clip_bounds_the_gradient_norm_the_optimizer_sees(small):
    norms = {}
    for clip in (0.0, 0.01):
        session = prepare(small(steps=1, batch_size=2, grad_clip=clip))
        params = list(session.raw_model.parameters())

        def record_norm(optimizer, args, kwargs, clip=clip, params=params):
            norms[clip] = torch.nn.utils.get_total_norm([p.grad for p in params]).item()

        session.optimizer.register_step_pre_hook(record_norm)
        run(session)
    assert norms[0.01] <= 0.01 * 1.001 < norms[0.0]


def test_data_loader_workers_and_pinned_memory(small):
    session = prepare(small(num_workers=2, pin_memory=True))
    loader = session.batches.loader
    assert loader.num_workers == 2 and loader.persistent_workers
    assert loader.pin_memory is (session.placement.device.type == "cuda")  # pinning is for CUDA copies
    inputs, targets = session.batches.next()
    assert inputs.shape == targets.shape == (8, 64)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_compile_wraps_the_model(small):
    session = prepare(small(compile=True))
    assert isinstance(session.model, torch._dynamo.eval_frame.OptimizedModule)
    assert session.model._orig_mod is session.raw_model


def test_data_delay_slows_the_loader(small):
    session = prepare(small(data_delay_ms=300))
    started = time.perf_counter()
    session.batches.next()
    assert time.perf_counter() - started >= 0.3


def test_host_sync_reads_the_loss_every_step(small):
    item_calls = {}
    for host_sync in (False, True):
        session = prepare(small(steps=3, batch_size=2, host_sync=host_sync))
        with CallRecorder() as recorder:
            run(session)
        item_calls[host_sync] = recorder.names.count("item")  # AdamW and the loader call it too
    assert item_calls[True] - item_calls[False] == 3


def test_straggler_rank_sleeps_every_step(small):
    result = run(prepare(small(steps=2, batch_size=2, straggler_rank=0, straggler_delay_ms=400)))
    assert result.mean_step_time_s >= 0.4


def test_host_work_keeps_the_host_busy_every_step(small):
    result = run(prepare(small(steps=3, batch_size=2, host_work_ms=300)))
    assert result.mean_step_time_s >= 0.3


def test_n_layer_overrides_the_size(small):
    assert len(prepare(small(n_layer=3)).raw_model.transformer.h) == 3
    with pytest.raises(GpuprofError, match="n_layer must be at least 1"):
        small(n_layer=0)


def test_model_shape_knobs(small):
    session = prepare(small(vocab_size=16384, dropout=0.2, seq_len=32, device="cpu"))
    model = session.raw_model
    assert model.lm_head.out_features == 16384 and model.transformer.wte.num_embeddings == 16384
    assert {m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)} == {0.2}
    assert next(model.parameters()).device.type == "cpu"
    assert session.batches.next()[0].shape == (8, 32)
    assert (len(model.transformer.h), model.config.n_embd, model.config.n_head) == (2, 128, 4)


def test_learning_rate_warms_up_then_decays(small):
    config = small(steps=20, lr=1e-3, warmup_steps=5, min_lr_ratio=0.1)
    rates = [lr_at(step, config) for step in range(20)]
    assert rates[:5] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3])
    assert rates[-1] == pytest.approx(1e-4) and rates == rates[:5] + sorted(rates[5:], reverse=True)
    session = prepare(small(steps=2, batch_size=2, lr=1e-3, warmup_steps=5))
    run(session)
    assert session.optimizer.param_groups[0]["lr"] == pytest.approx(lr_at(1, session.config))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 and pinned memory act on CUDA only")
def test_cuda_only_knobs(small):
    session = prepare(small(device="cuda", tf32=True, pin_memory=True, variant="optimized"))
    assert torch.backends.cuda.matmul.allow_tf32 and session.batches.loader.pin_memory


@pytest.mark.parametrize(
    "bad",
    [{"model_size": "gpt5"}, {"variant": "fast"}, {"precision": "fp8"}, {"steps": 0},
     {"batch_size": 6, "grad_accum": 4}, {"seq_len": 2048}, {"dropout": 1.0}, {"num_workers": -1}],
)
def test_bad_config_values_are_gpuprof_errors(bad):
    with pytest.raises(GpuprofError):
        TrainConfig(**bad)


def test_cuda_without_a_gpu_is_a_clear_error(small):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(GpuprofError, match="no CUDA device"):
        prepare(small(device="cuda"))
