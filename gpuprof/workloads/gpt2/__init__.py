"""The GPT-2 reference training workload (nanoGPT-style, Hugging Face GPT2LMHeadModel).

    from gpuprof.workloads.gpt2 import TrainConfig, train
    result = train(TrainConfig(model_size="tiny", variant="optimized", steps=20, run_dir="runs/x"))
    result.losses, result.mean_step_time_s, result.tokens_per_s

Modules, in reading order: config (knobs, sizes, variants), data (corpus, tokenizer,
batches), model (GPT-2, precision, optimizer), distributed (torchrun), checkpoint,
loop (prepare, train_step, run), console (progress bar, summary).
"""

from __future__ import annotations

import importlib

# Public name -> defining module, imported on first use so that the CLI can read the
# sizes and variants without importing torch.
_PUBLIC = {
    "TrainConfig": "config", "SIZES": "config", "VARIANTS": "config", "PADDED_VOCAB_SIZE": "config",
    "cache_dir": "data", "token_file": "data",
    "build_model": "model", "build_optimizer": "model", "lm_loss": "model",
    "Session": "loop", "TrainResult": "loop", "prepare": "loop", "run": "loop", "train": "loop",
    "train_step": "loop",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
