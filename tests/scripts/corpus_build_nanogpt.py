"""karpathy/build-nanogpt's train_gpt2.py (script_corpus.SOURCES["build_nanogpt"]), unmodified, shrunk and kept
offline from outside, at run time (build_nanogpt_patches.py).

The script does everything at its top level with constants (B = 64, T = 1024, total_batch_size = 2**19,
max_steps = 19073, GPT-2 124M from `GPTConfig(vocab_size=50304)`), reads `edu_fineweb10B/*.npy` shards through its
own `DataLoaderLite`, downloads tiktoken's GPT-2 encoding and HellaSwag's validation set, and evaluates (validation
loss on 20 batches, HellaSwag, then 4 samples of 32 tokens) at every 250th step and at its last. Here it gets:

- SHRINK's sizes and a 2-layer GPT (MODEL), each name rebound right after the script binds it; and evaluation every
  `eval_every` steps (`max_steps - 1`, which the loop compares each step with to set `last_step`, equals those
  steps too: the script evaluates there as at its last step, checkpoint included);
- a byte-level tiktoken (a token per UTF-8 byte: VOCAB tokens, the model's vocabulary);
- shards of random tokens where it looks (a val shard, then two train shards), and HellaSwag examples of random
  words in `hellaswag/hellaswag_val.jsonl` beside hellaswag.py, which then downloads nothing;
- under torchrun (`ranks` > 1), each rank a CPU process on gloo: the script's `assert torch.cuda.is_available()`
  passes for it and its `cuda:LOCAL_RANK` is the CPU (the rest: torch_examples_patches.cuda_to_cpu).

    run_build_nanogpt(tmp_path, patches=(), ranks=1, eval_every=EVAL_EVERY, train_shard_tokens=SHARD_TOKENS,
                      gpuprof_args=(), how=run_script, **names) -> ScriptRun (or ScriptLaunch, with script_launch)
        `names` override SHRINK (the script's own names); `train_shard_tokens` sizes each train shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from build_nanogpt_patches import VOCAB
from script_corpus import run_script

SHRINK = dict(total_batch_size=512, B=4, T=32, max_steps=9, warmup_steps=2)  # 4 micro-batches a step on one rank
EVAL_EVERY = 4  # steps 4 and 8 (the last) evaluate; step 0's evaluation comes before recording starts
SHARD_TOKENS = 6000
HELLASWAG_EXAMPLES = 4
OFFLINE = ("build_nanogpt_patches:offline_tiktoken",)
ON_CPU_RANKS = ("torch_examples_patches:cuda_to_cpu", "build_nanogpt_patches:cuda_asserted_on_cpu")


def run_build_nanogpt(tmp_path: Path, patches=(), ranks: int = 1, eval_every: int = EVAL_EVERY,
                      train_shard_tokens: int = SHARD_TOKENS, gpuprof_args=(), how=run_script, **names):
    workdir = tmp_path / "work"
    write_shards(workdir / "edu_fineweb10B", train_shard_tokens)
    write_hellaswag(workdir / "hellaswag" / "hellaswag_val.jsonl")
    shrink = ("build_nanogpt_patches:shrink", {"names": {**SHRINK, **names}, "eval_every": eval_every})
    on_cpu = ON_CPU_RANKS if ranks > 1 else ()
    return how("build_nanogpt", tmp_path, [], patches=(*OFFLINE, shrink, *on_cpu, *patches), ranks=ranks,
               gpuprof_args=gpuprof_args)


def grad_accum_steps(ranks: int = 1, **names) -> int:
    """The script's own `total_batch_size // (B * T * ddp_world_size)`."""
    settings = {**SHRINK, **names}
    return settings["total_batch_size"] // (settings["B"] * settings["T"] * ranks)


def write_shards(folder: Path, train_tokens: int, seed: int = 0) -> None:
    """What the repository's fineweb.py writes, of random tokens: uint16 .npy shards, the first one val, then two
    train shards of `train_tokens` each."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, tokens in [("val_000000", SHARD_TOKENS), ("train_000001", train_tokens), ("train_000002", train_tokens)]:
        np.save(folder / f"edufineweb_{name}.npy", rng.integers(0, VOCAB, tokens, dtype=np.uint16))


def write_hellaswag(path: Path, seed: int = 0) -> None:
    """HellaSwag's validation examples as hellaswag.py reads them (a context, 4 endings, the label's index): under
    30 bytes, well within the model's positions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = [f"w{index}" for index in range(50)]

    def text(count: int) -> str:
        return " ".join(rng.choice(words, count))

    examples = [{"ctx": text(4), "endings": [text(3) for _ in range(4)], "label": int(rng.integers(4))}
                for _ in range(HELLASWAG_EXAMPLES)]
    path.write_text("".join(json.dumps(example) + "\n" for example in examples))


def printed_losses(stdout: str) -> list[float]:
    """The `loss:` of each `step N | loss: ...` line the script prints (its loss_accum), in order."""
    return [float(line.split("loss: ")[1].split(" ")[0]) for line in stdout.splitlines() if line.startswith("step ")]


SLOW_DISK = '''"""numpy.load from a slow disk: a library's delay, not the script's (this file sits in site-packages)."""
import functools
import os
import time

import numpy as np


def slow_numpy_load(delay_s, files, on_rank=None):
    if on_rank is not None and int(os.environ.get("RANK", 0)) != on_rank:
        return
    load = np.load

    @functools.wraps(load)
    def slow_load(file, *args, **kwargs):
        if files in os.path.basename(file):
            time.sleep(delay_s)
        return load(file, *args, **kwargs)

    np.load = slow_load
'''


def slow_disk_library(folder: Path) -> Path:
    """A site-packages folder holding slow_disk.py, for PYTHONPATH: the patch "slow_disk:slow_numpy_load" (`files`: a
    part of the names of the shards read `delay_s` slower; `on_rank`: only there, under torchrun). In a library, the
    time is the script's own: its load_tokens', which its DataLoaderLite.next_batch calls."""
    library = folder / "site-packages"
    library.mkdir(parents=True, exist_ok=True)
    (library / "slow_disk.py").write_text(SLOW_DISK)
    return library
