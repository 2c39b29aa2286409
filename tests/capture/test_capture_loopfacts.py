"""meta.json's "loop": what the model, optimizer, DataLoader and torch settings of a real loop say."""

from __future__ import annotations

import contextlib

import torch
from capture_loop import BATCH, batch, tiny_model
from transformers import GPT2LMHeadModel

import gpuprof


@contextlib.contextmanager
def cudnn_benchmark(enabled: bool):
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def eager_attention_model() -> GPT2LMHeadModel:
    config = tiny_model().config
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


def accepts_fused(model) -> bool:
    try:
        torch.optim.AdamW(model.parameters(), fused=True)
    except RuntimeError:
        return False
    return True


def record(run_dir, model, optimizer, loader=None, autocast=None, steps=2):
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, loader=loader, sample_interval_s=0) as prof:
        for step in range(steps):
            inputs = batch(step)
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = model(input_ids=inputs, labels=inputs).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    return gpuprof.load_run(run_dir).meta["loop"]


def test_loop_facts_of_an_eager_attention_bf16_loop(tmp_path):
    model = eager_attention_model()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], foreach=False)
    loader = torch.utils.data.DataLoader(torch.zeros(8, 4), batch_size=BATCH, pin_memory=False)
    with torch.no_grad():  # an evaluation call before training: not the "first training forward"
        model(input_ids=batch(0))
    with cudnn_benchmark(True):
        loop = record(tmp_path / "run", model, optimizer, loader, autocast=torch.bfloat16)
    assert loop["model"]["class"] == "GPT2LMHeadModel"
    assert loop["model"]["attn_implementation"] == "eager"
    assert loop["model"]["compiled"] is False
    assert loop["model"]["module_types"]["GPT2Block"] == 2 and len(loop["model"]["module_types"]) <= 20
    assert loop["optimizer"] == {"class": "AdamW", "fused": None, "foreach": False, "param_groups": 2,
                                 "fused_supported": accepts_fused(model), "params_without_optimizer": 0,
                                 "params_without_optimizer_names": []}
    assert loop["loader"] == {"class": "DataLoader", "num_workers": 0, "pin_memory": False, "prefetch_factor": None,
                              "persistent_workers": False, "batch_size": BATCH}
    assert loop["torch"]["cudnn_benchmark"] is True
    assert loop["torch"]["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    assert loop["autocast_dtype"] == "bf16"


def test_loop_facts_of_a_fused_sdpa_fp32_loop_without_loader(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)  # has no fused kernel
    loop = record(tmp_path / "run", model, optimizer)
    assert loop["model"]["attn_implementation"] == "sdpa"
    assert loop["optimizer"]["fused_supported"] is False and loop["optimizer"]["class"] == "RMSprop"
    assert loop["loader"] is None
    assert loop["autocast_dtype"] is None
    assert loop["torch"]["cudnn_benchmark"] is torch.backends.cudnn.benchmark
