"""lucidrains/x-transformers' train_enwik8.py (script_corpus.SOURCES["x_transformers_enwik8"]), unmodified, shrunk
and kept on the CPU from outside, at run time (x_transformers_patches.py).

The script does everything at its top level: a 6-layer TransformerWrapper of width 512 over bytes, enwik8 read from
`./data/enwik8.gz` (its first 90e6 bytes train, the next 5e6 validate), batches drawn with `next(train_loader)` from
`cycle(DataLoader(...))`, a generator it defines, GRADIENT_ACCUMULATE_EVERY micro-batches an optimizer step, a
validation loss every VALIDATE_EVERY iterations and `model.generate(...)` every GENERATE_EVERY (both at iteration 0
too), printing `training loss: X` each iteration. Here it gets SHRINK's constants (its own names), a Decoder of
MODEL's size, the CPU for `.cuda()`, and random bytes as enwik8 (a repeated 16 KiB block: enough bytes for the
script's own split, a small file).

    run_x_transformers(tmp_path, patches=(), gpuprof_args=(), how=run_script, **names) -> ScriptRun (or ScriptLaunch)
        `names` override SHRINK.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
from script_corpus import run_script

SHRINK = dict(NUM_BATCHES=8, BATCH_SIZE=2, GRADIENT_ACCUMULATE_EVERY=4, LEARNING_RATE=1e-3, VALIDATE_EVERY=2,
              GENERATE_EVERY=4, GENERATE_LENGTH=8, SEQ_LEN=32)
ENWIK8_BYTES = int(90e6) + 200_000  # the script validates on what follows its first 90e6 bytes
BLOCK_BYTES = 16_384  # within gzip's window: the file stays small


def run_x_transformers(tmp_path: Path, patches=(), gpuprof_args=(), how=run_script, **names):
    write_enwik8(tmp_path / "work" / "data" / "enwik8.gz")
    shrink = ("x_transformers_patches:shrink", {"names": {**SHRINK, **names}})
    return how("x_transformers_enwik8", tmp_path, [], patches=(shrink, "x_transformers_patches:cuda_is_cpu",
                                                                  *patches), gpuprof_args=gpuprof_args)


def write_enwik8(path: Path, seed: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(seed).integers(32, 127, BLOCK_BYTES, dtype=np.uint8)
    with gzip.open(path, "wb", compresslevel=1) as file:
        file.write(np.resize(block, ENWIK8_BYTES).tobytes())


def printed_losses(stdout: str) -> list[float]:
    """The `training loss: X` the script prints each iteration (its last micro-batch's loss), in order."""
    return [float(line.split(": ")[1]) for line in stdout.splitlines() if line.startswith("training loss: ")]
