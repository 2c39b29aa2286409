"""`gpuprof train`: the GPT-2 reference workload, recorded with gpuprof (docs/workload.md).

Every knob of TrainConfig is a flag; a flag left out takes the variant preset's value,
so `--variant optimized --precision fp32` A/B-tests one change.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from gpuprof.cli.run import SAMPLE_INTERVAL_HELP, seconds
from gpuprof.workloads.gpt2.config import ATTENTIONS, DEVICES, PARALLELS, PRECISIONS, SIZES, VARIANTS, TrainConfig

_PRESET = "default: from the variant"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train the GPT-2 reference workload (baseline or optimized) and record it",
        description="Train GPT-2 (random init) on the Python standard library's sources or your "
        "data, record the run with gpuprof, and print a summary. Under torchrun it runs "
        "DistributedDataParallel, or FSDP2 with --parallel fsdp. Flags left out take the variant's value.",
    )
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}

    def add(group, flag, help_text, **kwargs):
        """A flag whose help shows TrainConfig's default; None leaves the knob to TrainConfig."""
        default = defaults.get(flag.lstrip("-").replace("-", "_"))
        suffix = f" (default: {default})" if default is not None else ""
        group.add_argument(flag, help=help_text + suffix, default=None, **kwargs)

    def toggle(group, flag, help_text):
        group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{help_text} ({_PRESET})")

    what = parser.add_argument_group("what to train")
    what.add_argument("--model", dest="model_size", choices=tuple(SIZES), default=None,
                      help="model size (default: tiny)")
    what.add_argument("--variant", choices=tuple(VARIANTS), default=None, help="knob preset (default: baseline)")
    add(what, "--steps", "optimizer steps", type=int)
    add(what, "--batch-size", "sequences per optimizer step per rank (default: per model size)", type=int)
    add(what, "--seq-len", "tokens per sequence (default: the model's context)", type=int)
    add(what, "--n-layer", "transformer blocks (default: the model size's)", type=int)
    add(what, "--vocab-size", "model vocabulary (default: GPT-2's 50257 rounded up to 50304; 8192 for tiny)", type=int)
    add(what, "--data", "text file, folder of text files, or uint16 .bin token file "
        "(default: the Python standard library's sources)")
    add(what, "--dropout", "dropout probability", type=float)
    add(what, "--lr", "peak learning rate (linear warm-up, cosine decay)", type=float)
    add(what, "--min-lr-ratio", "final learning rate as a fraction of --lr", type=float)
    add(what, "--warmup-steps", "learning-rate warm-up steps", type=int)
    add(what, "--weight-decay", "AdamW weight decay on weight matrices", type=float)
    add(what, "--seed", "random seed (rank r uses seed + r after the shared model init)", type=int)
    add(what, "--device", "device", choices=DEVICES)

    ranks = parser.add_argument_group("several processes (torchrun)")
    ranks.add_argument("--parallel", choices=PARALLELS, default=None,
                       help="ddp: every rank holds the whole model; fsdp: FSDP2 shards parameters, gradients "
                       "and optimizer state over the ranks (default: ddp)")
    ranks.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                       help="fsdp: free gathered parameters after forward and gather them again in backward "
                       "(less memory, more communication) (default: on)")
    ranks.add_argument("--cpu-offload", action="store_true", default=None,
                       help="fsdp: keep sharded parameters, gradients and optimizer state in host memory")

    knobs = parser.add_argument_group("variant knobs")
    knobs.add_argument("--precision", choices=PRECISIONS, default=None,
                       help=f"fp32, or autocast to bf16/fp16 (fp16 adds a GradScaler); auto: bf16 where "
                       f"supported, else fp16 ({_PRESET})")
    knobs.add_argument("--attention", choices=ATTENTIONS, default=None,
                       help=f"eager attention or scaled_dot_product_attention ({_PRESET})")
    knobs.add_argument("--grad-accum", type=int, default=None,
                       help=f"micro-batches per step; must divide --batch-size ({_PRESET})")
    knobs.add_argument("--num-workers", type=int, default=None, help=f"DataLoader worker processes ({_PRESET})")
    knobs.add_argument("--grad-clip", type=float, default=None,
                       help=f"clip the gradient norm to this value, 0 for no clipping ({_PRESET})")
    toggle(knobs, "--activation-checkpointing", "recompute activations in backward to save memory")
    toggle(knobs, "--fused-adamw", "fused AdamW kernel")
    toggle(knobs, "--tf32", "TF32 matmuls on CUDA Ampere and newer (no effect on CPU)")
    toggle(knobs, "--pin-memory", "pinned host memory for batches (CUDA only)")
    toggle(knobs, "--compile", "torch.compile the model")

    record = parser.add_argument_group("recording and checkpoints")
    record.add_argument("--run-dir", default=None, help="record the run here (default: runs/<timestamp>-<variant>)")
    add(record, "--log-every", "refresh the progress bar's loss every N steps", type=int)
    add(record, "--trace-steps", "record a torch.profiler trace of steps START:STOP (e.g. 5:8) per rank",
        metavar="START:STOP")
    record.add_argument("--sample-interval", dest="sample_interval_s", type=seconds, default=None, metavar="S",
                        help=SAMPLE_INTERVAL_HELP)
    add(record, "--checkpoint-every", "save a checkpoint every N steps and at the end, 0 for never", type=int)
    record.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default: RUN_DIR/checkpoints)")
    record.add_argument("--resume", default=None, metavar="CHECKPOINT",
                        help="continue from a checkpoint file, or the latest one in a folder")

    problems = parser.add_argument_group("problems on purpose (to see the diagnoses find them)")
    add(problems, "--data-delay-ms", "sleep this long in the data loader per micro-batch", type=float)
    add(problems, "--host-work-ms", "busy the host this long every step (Python overhead on purpose)", type=float)
    problems.add_argument("--host-sync", action="store_true", default=None,
                          help="call loss.item() every step, as a naive loop does")
    add(problems, "--straggler-rank", "under torchrun, the rank that runs slow", type=int)
    add(problems, "--straggler-delay-ms", "how much slower the straggler is per step", type=float)
    problems.add_argument("--inject", action="append", default=None, metavar="FAULT@STEP",
                          help="inject a numerical fault at a step: attn-overflow (fp16), embedding-nan, "
                          "ignored-labels, lr-spike, sqrt-zero; repeatable (see docs/numerics.md)")
    problems.add_argument("--on-nonfinite", choices=("record", "raise", "skip"), default=None,
                          help="on a NaN/Inf step: record it, raise, or skip the update (default: record)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuprof.numerics.monitor import NonFiniteError
    from gpuprof.workloads.gpt2 import train

    try:
        train(config_from_args(args))
    except NonFiniteError as error:  # --on-nonfinite raise: the report is in the run already
        print(f"gpuprof train: stopped on a non-finite value: {error} (bundle: {error.blame.bundle})")
        return 1
    return 0


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The flags given; TrainConfig fills in the rest. A run is always recorded somewhere."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    knobs = {name: value for name, value in vars(args).items() if name in fields and value is not None}
    config = TrainConfig(**knobs)
    if config.run_dir is None:
        config.run_dir = default_run_dir(config.variant)
    return config


def default_run_dir(variant: str) -> str:
    return f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{variant}"
