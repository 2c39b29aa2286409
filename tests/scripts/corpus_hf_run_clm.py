"""Hugging Face transformers' examples/pytorch/language-modeling/run_clm.py (the `Trainer`), fully offline.

    run_hf_run_clm(tmp_path, patches=(), args=())  -> ScriptRun
        run_clm.py, unmodified, training a tiny GPT-2 from scratch (a local config and a BPE tokenizer trained
        here, script_corpus.write_clm_assets) on local text files: --do_train --do_eval, HF_RUN_CLM_STEPS
        optimizer steps of HF_RUN_CLM_BATCH blocks of HF_RUN_CLM_BLOCK tokens, evaluating HF_RUN_CLM_EVAL_BATCH
        blocks a batch, the loss logged every step, on the CPU, saving only what the script saves at its end;
        `args` go to the script after these, so they override them (`--gradient_accumulation_steps=2`).
        `evaluate.load("accuracy")` gets a local metric (corpus_patches.offline_accuracy).
    written_by_trainer(result, name) -> dict
        a JSON file the Trainer wrote into the script's output folder, `tmp_path/out` (`trainer_state.json`, with
        the loss it logged at each step; `eval_results.json`).
"""

from __future__ import annotations

import json
from pathlib import Path

from script_corpus import ScriptRun, run_script, write_clm_assets

HF_RUN_CLM_LINES = 200  # of 10 words: some 150 blocks of 32 tokens to train on, some 30 to evaluate
HF_RUN_CLM_STEPS = 20
HF_RUN_CLM_BATCH = 2
HF_RUN_CLM_BLOCK = 32
HF_RUN_CLM_EVAL_BATCH = 8
OUTPUT_DIR = "out"  # beside `work`
HF_RUN_CLM_MODEL = "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel"  # the class AutoModelForCausalLM builds


def run_hf_run_clm(tmp_path: Path, patches=(), args=()) -> ScriptRun:
    local = write_clm_assets(tmp_path / "work" / "assets", HF_RUN_CLM_LINES)
    flags = {  # TrainingArguments' and the script's own names
        "model_type": "gpt2", "config_name": local["model"], "tokenizer_name": local["tokenizer"],
        "train_file": local["data_files"]["train"], "validation_file": local["data_files"]["validation"],
        "max_steps": HF_RUN_CLM_STEPS, "per_device_train_batch_size": HF_RUN_CLM_BATCH,
        "per_device_eval_batch_size": HF_RUN_CLM_EVAL_BATCH, "block_size": HF_RUN_CLM_BLOCK,
        "output_dir": tmp_path / OUTPUT_DIR, "report_to": "none", "logging_steps": 1, "save_strategy": "no",
        "dataloader_num_workers": 0, "disable_tqdm": True}
    script_args = ["--do_train", "--do_eval", "--use_cpu", *(f"--{key}={value}" for key, value in flags.items()),
                   *args]
    return run_script("hf_run_clm", tmp_path, script_args, ("corpus_patches:offline_accuracy", *patches))


def written_by_trainer(result: ScriptRun, name: str) -> dict:
    """A JSON file the script's Trainer wrote into its output folder (`trainer_state.json`, `eval_results.json`)."""
    return json.loads((result.workdir.parent / OUTPUT_DIR / name).read_text())
