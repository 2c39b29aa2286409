"""Validate gpuprof on a real GPU in one command: ceilings, the GPT-2 reference, capture overhead,
sync-freedom, NaN forensics, trace and run analysis (issue 7).

    python benchmarks/gpu_validate.py OUT_DIR                                      # CUDA, GPT-2 124M
    python benchmarks/gpu_validate.py OUT_DIR --device cpu --model tiny --steps 5   # dry run on CPU

Sections, in this order (each guarded: a failure is recorded with its traceback and the rest still run;
the quick ones first, so a run cut short keeps what they measured):
  environment  GPU, driver, torch/CUDA versions; measured bf16 matmul TFLOP/s and device-to-device
               copy GB/s (on CPU: fp32/bf16 matmul GFLOP/s and memcpy GB/s)
  overhead     the optimized model in benchmarks/overhead.py's loop, bare vs always-on capture, interleaved,
               on loops written the ways users write them (loss outside the model, with and without
               clip_grad_norm_, or labels= with phases marked), and with numerics' state kept every step
               or not at all; 30 pairs each, with the memory capture adds (peak_memory_added_pct)
  overhead_small_step  benchmarks/overhead.py's small-step loop (tiny GPT-2, 4x64 tokens) on this device
  sync_debug   torch.cuda.set_sync_debug_mode("error") armed after 2 warm-up steps, around healthy captured
               steps of each default loop (`after_warmup`), then "warn" to name any synchronizing call site
               (CUDA only)
  forensics    `gpuprof train --inject` attn-overflow (fp16) and embedding-nan; the blame, and `gpuprof replay`
  forensics_any_loop  the workload's faults in a nanoGPT-style user loop (loss outside the model, GradScaler
               for fp16): the blame, and `gpuprof replay` where the model is a plain Hugging Face one
  trace        a short torch.profiler window of the optimized loop, analyzed by `gpuprof trace`
  memory       `prof.memory_snapshot()` with `memory_history=True` on the optimized loop, read back as the
               dashboard's Memory page reads it (CUDA only)
  reference    `gpuprof train` baseline and optimized, each in its own process (so peak memory and TF32
               settings are its own); figures from the recorded runs' summary, and what NVML sampled
  analyze      `gpuprof analyze` on every recorded run
  reference_compiled  optimized + torch.compile, the same way (last: compiling takes longest)
Everything goes under OUT_DIR: runs/, logs/, trace.txt/.json, analyze/, results.json (the record, rewritten
after every section), results.md; a short table is printed last.

On a machine without network: torch and transformers must be installed already. On a machine with
network and the same Python version and platform, gather the other dependencies as wheels:
    pip download -d wheels/ setuptools wheel pandas pyarrow nvidia-ml-py psutil rich tqdm msgspec plotly streamlit
(the runtime list is pyproject.toml's `dependencies` minus torch, transformers, tokenizers), carry
wheels/ with the repository, then on the GPU machine:
    pip install --no-index --find-links wheels/ -e .
    python benchmarks/gpu_validate.py /tmp/gpu-validate
Commit the printed table as benchmarks/results/<date>-<gpu>.md (see benchmarks/results/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import overhead  # benchmarks/overhead.py, beside this script

import gpuprof
from gpuprof.analysis.memory_snapshot import read_snapshot
from gpuprof.analysis.run import summarize
from gpuprof.cli import main as gpuprof_cli
from gpuprof.flops import model_flops_per_token
from gpuprof.hardware import peak_flops_per_s
from gpuprof.numerics.blame import Blame, format_blame
from gpuprof.run.jsonable import json_safe
from gpuprof.run.schema import EventKind
from gpuprof.workloads.gpt2 import TrainConfig, build_model, build_optimizer
from gpuprof.workloads.gpt2.faults import Injector, parse
from gpuprof.workloads.gpt2.model import compute_dtype, enable_tf32

SCHEMA = "gpuprof.gpu_validate"
SCHEMA_VERSION = 3
OVERHEAD_TARGET_PCT = 1.0
REFERENCE_TIMEOUT_S = 240  # one `gpuprof train` process; torch.compile's first step dominates
# Each reference variant: `gpuprof train` flags on top of the shared ones.
VARIANTS = {
    "baseline": ["--variant", "baseline"],
    "optimized": ["--variant", "optimized"],
}
COMPILED_VARIANT, COMPILED_FLAGS = "optimized_compiled", ["--variant", "optimized", "--compile"]
# Capture overhead: loop name -> (overhead.train_steps' loop arguments, gpuprof.profile options).
LOOSE = dict(marked=False, loss_outside=True)  # a plain loop: no prof.phase(), the loss computed outside the model
OVERHEAD_LOOPS = {
    "loss outside, no clipping": ({**LOOSE, "clip": False}, {}),
    "loss outside, clip_grad_norm_": ({**LOOSE, "clip": True}, {}),
    "labels=, phases marked": (dict(marked=True, loss_outside=False, clip=True), {}),
    "loss outside, no clipping, keep_state every_step": ({**LOOSE, "clip": False},
                                                         {"numerics": {"keep_state": "every_step"}}),
    "loss outside, no clipping, keep_state off": ({**LOOSE, "clip": False}, {"numerics": {"keep_state": False}}),
}
DEFAULT_LOOPS = tuple(OVERHEAD_LOOPS)[:3]  # every default on: the headline is the worst of these
SYNC_LOOPS = DEFAULT_LOOPS
MIN_PAIRS = 30  # interleaved pairs per overhead figure: fewer cannot show a 1 % effect on a GPU's spread
SYNC_WARMUP_STEPS = 2  # captured steps before sync debug mode is armed: lazy initialisation may sync once
# What the summary's ratios compare (optimized over baseline).
RATIO_METRICS = ("step_time_p50_s", "tokens_per_s", "mfu", "peak_mem_allocated_bytes")
# The culprit each fault has by construction (gpuprof/workloads/gpt2/faults.py).
FAULTS = {
    "attn-overflow": {"flags": ["--precision", "fp16", "--attention", "eager"], "phase": "forward",
                      "where": ".attn", "first": "inf"},
    "embedding-nan": {"flags": [], "phase": "state", "where": "transformer.wte", "first": "nan"},
}
FAULT_STEP = 1
# The same faults in a user's loop (tests/numerics/numerics_helpers.py's FAULT_CASES, on the tiny model):
# replayable where the model is a plain Hugging Face one (sqrt-zero adds a module of its own).
ANY_LOOP_FAULTS = {
    "attn-overflow": {"precision": "fp16", "attention": "eager", "step": 1, "phase": "forward", "where": ".attn",
                      "first": "inf", "replayable": True},
    "ignored-labels": {"precision": "bf16", "step": 1, "phase": "loss", "where": "", "first": "nan", "replayable": True},
    "sqrt-zero": {"precision": "bf16", "step": 1, "phase": "backward", "where": ".mlp", "first": "inf",
                  "replayable": False},
    # weights of 1e20: which op overflows first, and to inf or NaN, depends on the model's size
    "lr-spike": {"precision": "bf16", "step": 2, "phase": "forward", "where": "", "first": None, "replayable": True},
}
ANY_LOOP_LR = 1e-4
OVERHEAD_MODEL = {"gpt2": "124m", "tiny": "tiny"}  # this script's --model as benchmarks/overhead.py names it


@dataclass(frozen=True)
class Plan:
    """Sizes for one model: batches, vocabulary, and the loops of the in-process sections."""

    batch_size: int  # sequences per optimizer step in the reference runs
    seq_len: int
    vocab_size: int
    micro_batch: int  # sequences per step in the overhead, sync and trace loops
    overhead_reps: int
    overhead_steps: int
    small_step_pairs: int
    small_step_steps: int  # timed steps per block of the small-step loop
    sync_steps: int
    fault_batch_size: int
    fault_seq_len: int
    matmul_size: int  # n of the n x n matmul that measures the ceiling


PLANS = {
    "gpt2": Plan(batch_size=16, seq_len=1024, vocab_size=50304, micro_batch=8, overhead_reps=MIN_PAIRS, overhead_steps=10,
                 small_step_pairs=MIN_PAIRS, small_step_steps=20, sync_steps=5, fault_batch_size=4, fault_seq_len=256,
                 matmul_size=8192),
    # the dry run's: every section once, at the fewest tokens (bf16 steps are slow on a CPU without AMX)
    "tiny": Plan(batch_size=4, seq_len=32, vocab_size=1024, micro_batch=2, overhead_reps=2, overhead_steps=2,
                 small_step_pairs=2, small_step_steps=5, sync_steps=3, fault_batch_size=2, fault_seq_len=32,
                 matmul_size=512),
}


class SectionSkipped(Exception):
    """A section that does not apply here (e.g. CUDA-only on CPU); the message is the note."""


# --------------------------------------------------------------------------- driver


def main() -> int:
    args = parse_args()
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_validate: --device cuda but torch sees no CUDA device (use --device cpu for a dry run)",
              file=sys.stderr)
        return 2
    bench = Bench(args, out)
    started = time.perf_counter()
    results = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "started_unix_s": time.time(),
               "args": {"device": args.device, "model": args.model, "steps": args.steps,
                        "skip_compile": args.skip_compile, "sections": list(args.sections)}, "sections": {}}
    for name, section in SECTIONS.items():
        if name not in args.sections:
            continue
        print(f"== {name}", flush=True)
        results["sections"][name] = run_section(section, bench)
        results["runtime_s"] = time.perf_counter() - started
        results.update(headlines(results["sections"]))
        write_json(out / "results.json", results)
    table = summary_table(results)
    (out / "results.md").write_text(results_markdown(results, table))
    print(table)
    return 0


def headlines(sections: dict) -> dict:
    """The record's headline views, each read from its sections: `device`, `variants` (the reference
    runs and their speedups), `overhead` (every measured loop) and `nan` (every blame)."""
    reference, compiled = sections.get("reference", {}), sections.get("reference_compiled", {})
    variants = {name: {"run": run, "ratios_vs_baseline": reference.get("ratios_vs_baseline", {}).get(name)}
                for name, run in reference.get("variants", {}).items()}
    if "variant" in compiled:
        variants[COMPILED_VARIANT] = {"run": compiled["variant"], "ratios_vs_baseline": compiled["ratio_vs_baseline"]}
    overhead = dict(sections.get("overhead", {}).get("loops", {}))
    if sections.get("overhead_small_step", {}).get("status") == "ok":
        overhead["small step"] = sections["overhead_small_step"]
    nan = {f"{name}: {fault}": {key: result.get(key) for key in ("status", "blame", "matches_expected",
                                                                  "replay_same_blame", "keep_state")}
           for name in ("forensics", "forensics_any_loop")
           for fault, result in sections.get(name, {}).get("faults", {}).items()}
    return {"device": sections.get("environment", {}).get("device_name"), "variants": variants,
            "overhead": overhead, "nan": nan}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder for runs, traces, results.json and results.md")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", choices=tuple(PLANS), default="gpt2")
    parser.add_argument("--steps", type=int, default=30, help="steps per reference run, warm-up included")
    parser.add_argument("--skip-compile", action="store_true",
                        help="leave out the torch.compile variant (its compilation takes minutes on a small CPU)")
    parser.add_argument("--sections", nargs="+", choices=tuple(SECTIONS), default=tuple(SECTIONS), metavar="SECTION",
                        help=f"run only these sections, in this script's order (default: all; {', '.join(SECTIONS)})")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first is warm-up), got {args.steps}")
    return args


def run_section(section, bench: "Bench") -> dict:
    started = time.perf_counter()
    try:
        record = {"status": "ok", **section(bench)}
    except SectionSkipped as skipped:
        record = {"status": "skipped", "note": str(skipped)}
    except Exception as error:  # noqa: BLE001 - the point: record it and go on with the next section
        traceback.print_exc()
        record = {"status": "failed", "error": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()[-4000:]}
    record["duration_s"] = time.perf_counter() - started
    print(f"   {record['status']} in {record['duration_s']:.1f} s", flush=True)
    return record


class Bench:
    """What the sections share: arguments, output folders, and the optimized model built once."""

    def __init__(self, args: argparse.Namespace, out: Path):
        self.args, self.out = args, out
        self.device = torch.device(args.device)
        self.plan = PLANS[args.model]
        self.runs = out / "runs"
        self.logs = out / "logs"
        self.logs.mkdir(exist_ok=True)
        self._workbench = None

    @property
    def workbench(self) -> "Workbench":
        if self._workbench is None:
            self._workbench = Workbench.build(self)
        return self._workbench

    def train_flags(self) -> list[str]:
        return ["--model", self.args.model, "--device", self.args.device, "--seq-len", str(self.plan.seq_len),
                "--vocab-size", str(self.plan.vocab_size)]


@dataclass
class Workbench:
    """The optimized variant's model and optimizer (sdpa, fused AdamW, TF32, bf16 autocast) for
    benchmarks/overhead.py's loop, which the overhead, sync and trace sections drive."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    tokens: torch.Tensor
    dtype: torch.dtype
    flops_per_token: float | None

    @classmethod
    def build(cls, bench: Bench) -> "Workbench":
        plan, device = bench.plan, bench.device
        config = TrainConfig(model_size=bench.args.model, variant="optimized", batch_size=plan.micro_batch,
                             grad_accum=1, seq_len=plan.seq_len, vocab_size=plan.vocab_size, device=bench.args.device)
        enable_tf32(device)
        torch.manual_seed(config.seed)
        model = build_model(config).to(device)
        tokens = torch.randint(0, plan.vocab_size, (plan.micro_batch, plan.seq_len))
        if device.type == "cuda":
            tokens = tokens.pin_memory()
        return cls(model, build_optimizer(model, config), tokens, compute_dtype(config, device),
                   model_flops_per_token(model, plan.seq_len))

    def steps(self, prof, n: int, device: torch.device, loop: dict | None = None) -> None:
        overhead.train_steps(prof, self.model, self.optimizer, self.tokens, n, self.dtype, device, **(loop or {}))

    def timed_steps(self, prof, n: int, device: torch.device, loop: dict) -> dict[str, float]:
        return overhead.timed_steps(prof, n, self.model, self.optimizer, self.tokens, device, self.dtype, **loop)

    def profile(self, run_dir: Path, **options):
        return gpuprof.profile(run_dir, model=self.model, optimizer=self.optimizer,
                               flops_per_token=self.flops_per_token, **options)


# --------------------------------------------------------------------------- 1. environment


def section_environment(bench: Bench) -> dict:
    device = bench.device
    facts = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
             "transformers": package_version("transformers"), "gpuprof": gpuprof.__version__,
             "torch_threads": torch.get_num_threads()}
    size = bench.plan.matmul_size
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                     total_memory_bytes=props.total_memory, driver=nvml_driver(),
                     cudnn=torch.backends.cudnn.version())
        facts["bf16_matmul_tflop_per_s"] = matmul_flop_per_s(size, torch.bfloat16, device) / 1e12
        facts["d2d_copy_gb_per_s"] = copy_bytes_per_s(2**30, device) / 1e9
        datasheet = peak_flops_per_s(props.name, "bf16")
        facts["bf16_datasheet_tflop_per_s"] = datasheet / 1e12 if datasheet else None
        facts["bf16_matmul_of_datasheet_pct"] = (
            100 * facts["bf16_matmul_tflop_per_s"] * 1e12 / datasheet if datasheet else None)
    else:
        facts["device_name"] = "cpu"
        facts["fp32_matmul_gflop_per_s"] = matmul_flop_per_s(size, torch.float32, device) / 1e9
        facts["bf16_matmul_gflop_per_s"] = matmul_flop_per_s(size, torch.bfloat16, device) / 1e9
        facts["memcpy_gb_per_s"] = copy_bytes_per_s(2**26, device) / 1e9
    return facts


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvml_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - no NVML: the driver stays unknown
        return None


def seconds_per_call(function, device: torch.device, min_time_s: float = 0.5) -> float:
    """Mean seconds of `function()` over enough calls to fill `min_time_s`, after two warm-up calls."""
    for _ in range(2):
        function()
    synchronize(device)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_time_s:
        function()
        calls += 1
        if calls % 10 == 0 or device.type == "cpu":
            synchronize(device)
    synchronize(device)
    return (time.perf_counter() - start) / calls


def matmul_flop_per_s(n: int, dtype: torch.dtype, device: torch.device) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / seconds_per_call(lambda: torch.mm(a, b), device)


def copy_bytes_per_s(n_bytes: int, device: torch.device) -> float:
    """Bytes read plus bytes written per second by a same-device copy (CUDA bandwidthTest's count)."""
    source = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    return 2 * n_bytes / seconds_per_call(lambda: target.copy_(source), device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- 2. reference


def section_reference(bench: Bench) -> dict:
    variants, summaries = {}, {}
    for name, flags in VARIANTS.items():
        variants[name], summary = reference_variant(bench, name, flags)
        if summary is not None:
            summaries[name] = summary
    if "baseline" not in summaries:
        raise RuntimeError(f"the baseline run failed: {variants['baseline'].get('error')}")
    return {"variants": variants, "ratios_vs_baseline": ratios(summaries), **failures(variants)}


def section_reference_compiled(bench: Bench) -> dict:
    """The optimized variant under torch.compile; last, since its compilation takes longest."""
    if bench.args.skip_compile:
        raise SectionSkipped("--skip-compile")
    record, summary = reference_variant(bench, COMPILED_VARIANT, COMPILED_FLAGS)
    if summary is None:
        raise RuntimeError(record["error"])
    baseline = summarize(gpuprof.load_run(bench.runs / "baseline"))
    return {"variant": record, "ratio_vs_baseline": ratios({"baseline": baseline, COMPILED_VARIANT: summary})[COMPILED_VARIANT]}


def reference_variant(bench: Bench, name: str, flags: list[str]):
    """One `gpuprof train` process: its record, and the recorded run's summary (None if it failed)."""
    run_dir = bench.runs / name
    command = [sys.executable, "-m", "gpuprof", "train", *bench.train_flags(), *flags,
               "--steps", str(bench.args.steps), "--batch-size", str(bench.plan.batch_size),
               "--log-every", str(bench.args.steps), "--run-dir", str(run_dir)]
    record = run_reference(command, run_dir, bench.logs / f"reference-{name}.log")
    if record["status"] != "ok":
        return record, None
    run = gpuprof.load_run(run_dir)
    summary = summarize(run)
    record.update(reference_figures(summary, run))
    return record, summary


def run_reference(command: list[str], run_dir: Path, log: Path) -> dict:
    """One `gpuprof train` process, its output in `log`."""
    started = time.perf_counter()
    record = {"command": " ".join(command), "log": str(log), "run_dir": str(run_dir)}
    with log.open("w") as output:
        try:
            done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, timeout=REFERENCE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"timed out after {REFERENCE_TIMEOUT_S} s", **record}
    if done.returncode:
        return {"status": "failed", "error": f"exit code {done.returncode}: {log.read_text()[-1500:]}", **record}
    return {"status": "ok", "wall_s": time.perf_counter() - started, **record}


REFERENCE_FIGURES = ("n_steps", "measured_steps", "warmup", "step_time_p50_s", "step_time_mean_s", "step_time_cv",
                     "tokens_per_s", "mfu", "peak_mem_allocated_bytes", "peak_mem_reserved_bytes", "health")


def reference_figures(summary, run) -> dict:
    """The recorded run's figures as its summary computes them, the knobs that made them, and what
    the device sampler and the step timing recorded."""
    figures = summary.to_dict()
    config = run.meta.get("config") or {}
    system = run.system
    sampled = [column for column in system.columns if system[column].notna().any()]
    loop_model = (run.meta.get("loop") or {}).get("model") or {}
    return {**{key: figures[key] for key in REFERENCE_FIGURES}, "compute_dtype": run.meta.get("compute_dtype"),
            "peak_flops_per_s": run.meta.get("peak_flops_per_s"), "clock": run.meta.get("clock"),
            "system_samples": len(system), "sampled_columns": sampled,
            **{knob: config.get(knob) for knob in ("attention", "fused_adamw", "compile", "grad_accum")},
            "seen_compiled": loop_model.get("compiled")}  # what capture saw of the loop, beside the knob


def failures(items: dict) -> dict:
    """A section whose parts failed is failed too, keeping what the other parts measured."""
    failed = [name for name, item in items.items() if item.get("status") == "failed"]
    return {"status": "failed", "error": f"failed: {', '.join(failed)} (see their error)"} if failed else {}


def ratios(summaries: dict) -> dict:
    """Each variant over the baseline, per headline figure of their run summaries (point estimates;
    `gpuprof compare` gives them with their intervals)."""
    baseline = summaries["baseline"]
    return {name: {metric: _ratio(getattr(summary, metric), getattr(baseline, metric)) for metric in RATIO_METRICS}
            for name, summary in summaries.items() if name != "baseline"}


def _ratio(value, reference):
    return value / reference if value is not None and reference else None


# --------------------------------------------------------------------------- 3. capture overhead


def section_overhead(bench: Bench) -> dict:
    """overhead.py's interleaved bare/captured blocks on the optimized model, for loops written the ways
    users write them, and for parts of the capture changed one at a time. The headline is the least
    flattering loop with every default on."""
    workbench, plan = bench.workbench, bench.plan
    loops = {}
    for name, (loop, options) in OVERHEAD_LOOPS.items():
        pairs = overhead.collect_pairs(
            plan.overhead_reps,
            lambda prof: workbench.timed_steps(prof, plan.overhead_steps, bench.device, loop),
            lambda rep: workbench.profile(bench.runs / "overhead" / f"{slug(name)}-{rep}", **options),
            bench.device, verbose_label=name)
        loops[name] = {**pairs.figures(), "overhead_pct": 100 * (pairs.median_ratio() - 1), "options": options}
    headline = max(DEFAULT_LOOPS, key=lambda name: loops[name]["overhead_pct"])
    overhead_pct = loops[headline]["overhead_pct"]
    return {"loops": loops, "headline_loop": headline, "steps_per_block": plan.overhead_steps,
            "tokens_per_step": workbench.tokens.numel(), "overhead_pct": overhead_pct,
            "target_pct": OVERHEAD_TARGET_PCT, "within_target": overhead_pct <= OVERHEAD_TARGET_PCT}


def slug(name: str) -> str:
    return "-".join("".join(c if c.isalnum() else " " for c in name).split())


def section_overhead_small_step(bench: Bench) -> dict:
    """benchmarks/overhead.py's own small-step loop (tiny GPT-2, 4x64 tokens, loss outside the model, no
    clipping, fp32) on this device: the step is short, so gpuprof's host work per step weighs most."""
    args = argparse.Namespace(model="tiny", device=bench.args.device, dtype="fp32", batch=4, seq=64,
                              steps=bench.plan.small_step_steps, phases=False, loss="outside", no_clip=True)
    small = overhead.Bench(args, bench.runs / "overhead-small-step")
    pairs = small.pairs({}, bench.plan.small_step_pairs, "small step", verbose=True)
    return {**pairs.figures(), "loop": overhead.describe(args, small), "overhead_pct": 100 * (pairs.median_ratio() - 1)}


# --------------------------------------------------------------------------- 4. sync debug mode


SWITCHED_OFF_KINDS = ("collector_disabled", "profiler_disabled")


def section_sync_debug(bench: Bench) -> dict:
    """Healthy captured steps with CUDA syncs turned into errors, on each loop of SYNC_LOOPS. gpuprof
    swallows its own errors (switching that part off), so a sync inside capture also shows as a
    switched-off event; a pass in "warn" mode names every synchronizing call site, so a sync in the
    loop's own code is told apart."""
    if bench.device.type != "cuda":
        raise SectionSkipped("CUDA only: torch.cuda.set_sync_debug_mode watches CUDA stream synchronizations")
    loops = {name: sync_check(bench, name, OVERHEAD_LOOPS[name][0]) for name in SYNC_LOOPS}
    after_warmup = {"warmup_steps": SYNC_WARMUP_STEPS, "checked_steps": bench.plan.sync_steps, "mode": "error",
                    "sync_errors": {name: loop["sync_error"] for name, loop in loops.items() if loop["sync_error"]},
                    "gpuprof_sync_free": all(loop["gpuprof_sync_free"] for loop in loops.values()),
                    "no_sync": all(loop["no_sync"] for loop in loops.values())}
    return {"checked_steps": bench.plan.sync_steps, "loops": loops, "after_warmup": after_warmup,
            "gpuprof_sync_free": after_warmup["gpuprof_sync_free"], "no_sync": after_warmup["no_sync"]}


def sync_check(bench: Bench, name: str, loop: dict) -> dict:
    workbench, run_dir = bench.workbench, bench.runs / f"sync-debug-{slug(name)}"
    _, bare_sites = under_sync_debug(workbench, overhead.Bare(), bench, "warn", loop)
    with workbench.profile(run_dir) as prof:
        error, _ = under_sync_debug(workbench, prof, bench, "error", loop)
        _, sites = under_sync_debug(workbench, prof, bench, "warn", loop)
    run = gpuprof.load_run(run_dir)
    events = run.events
    switched_off = events[events["kind"].isin(SWITCHED_OFF_KINDS)]["message"].tolist()
    gpuprof_sites = [site for site in sites if f"{Path(gpuprof.__file__).parent}" in site]
    return {"steps_recorded": len(run.steps), "mem_allocated_bytes_min": run.steps["mem_allocated_bytes"].min(),
            "timed_steps": int(run.steps["step_time_s"].gt(0).sum()), "sync_error": error, "switched_off": switched_off, "sync_sites": sites, "gpuprof_sync_sites": gpuprof_sites,
            "bare_loop_sync_sites": bare_sites, "run_dir": str(run_dir),
            "gpuprof_sync_free": not switched_off and not gpuprof_sites,
            "no_sync": error is None and not switched_off and not gpuprof_sites}


def under_sync_debug(workbench: Workbench, prof, bench: Bench, mode: str, loop: dict) -> tuple[str | None, list[str]]:
    """`sync_steps` steps after SYNC_WARMUP_STEPS warm-up ones under set_sync_debug_mode(mode), armed only
    after the warm-up (where gpuprof also measures memory and places its kept state): the error a
    synchronizing call raised ("error"), and the file:line of each one that warned ("warn")."""
    workbench.steps(prof, SYNC_WARMUP_STEPS, bench.device, loop)
    torch.cuda.synchronize()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(mode)
        try:
            workbench.steps(prof, bench.plan.sync_steps, bench.device, loop)
        except RuntimeError as raised:
            error = f"{raised}\n{traceback.format_exc()[-2000:]}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    sites = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
    return error, sites


# --------------------------------------------------------------------------- 5. NaN forensics


def section_forensics(bench: Bench) -> dict:
    faults = {fault: guarded(inject, bench, fault, expected) for fault, expected in FAULTS.items()}
    return {"faults": faults, **failures(faults)}


def section_forensics_any_loop(bench: Bench) -> dict:
    """The workload's faults in a loop written as users write them (no workload code in the loop):
    each blame, and `gpuprof replay` of its bundle where the model is a plain Hugging Face one."""
    faults = {fault: guarded(any_loop_fault, bench, fault, expected) for fault, expected in ANY_LOOP_FAULTS.items()}
    return {"faults": faults, **failures(faults)}


def any_loop_fault(bench: Bench, fault: str, expected: dict) -> dict:
    run_dir = bench.runs / f"any-loop-{fault}"
    user_loop(bench, run_dir, fault, expected)
    blame = recorded_blame(run_dir)
    print(format_blame(blame), flush=True)
    where = blame.tensor or blame.module or ""
    meta = gpuprof.load_run(run_dir).meta
    record = {"run_dir": str(run_dir), "precision": expected["precision"], "blame": blame.details(),
              "keep_state": meta.get("numerics_keep_state"), "state_placement": meta.get("numerics_state_placement"),
              "blame_text": format_blame(blame),
              "matches_expected": (blame.step == expected["step"] and blame.phase == expected["phase"]
                                   and expected["where"] in where and expected["first"] in (None, blame.first))}
    if expected["replayable"]:
        replay_code, replay_output = cli(["replay", blame.bundle, "--device", bench.args.device],
                                         bench.logs / f"replay-any-loop-{fault}.log")
        record.update(replay_exit_code=replay_code, replay_same_blame=replay_code == 0, replay_output=replay_output)
    return record


def user_loop(bench: Bench, run_dir: Path, fault: str, expected: dict) -> None:
    """nanoGPT's shape: logits from the model, F.cross_entropy outside it, a GradScaler for fp16,
    AdamW, profiled with gpuprof.profile's defaults; the fault applied to this loop's own model."""
    device, plan = bench.device, bench.plan
    injector = Injector([parse(f"{fault}@{FAULT_STEP}")])
    torch.manual_seed(0)
    config = GPT2Config(**overhead.MODELS[OVERHEAD_MODEL[bench.args.model]], bos_token_id=0, eos_token_id=0,
                        attn_implementation=expected.get("attention", "sdpa"))
    model = injector.prepare_model(GPT2LMHeadModel(config)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=ANY_LOOP_LR)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**8, enabled=expected["precision"] == "fp16")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[expected["precision"]]
    generator = torch.Generator().manual_seed(1)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, scaler=scaler) as prof:
        for step in range(expected["step"] + 2):
            for group in optimizer.param_groups:
                group["lr"] = injector.lr(step, ANY_LOOP_LR)
            injector.before_step(step, model)
            x = torch.randint(0, config.vocab_size, (plan.fault_batch_size, plan.fault_seq_len), generator=generator)
            x = x.to(device)
            y = injector.targets(step, x.roll(-1, 1))
            with torch.autocast(device.type, dtype=dtype):
                logits = model(x).logits
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach(), tokens=x.numel())


def guarded(function, *args) -> dict:
    """`function(*args)` with status ok, or its error with status failed."""
    try:
        return {"status": "ok", **function(*args)}
    except Exception as error:  # noqa: BLE001 - one failing part must not hide the others
        traceback.print_exc()
        return {"status": "failed", "error": f"{type(error).__name__}: {error}"}


def inject(bench: Bench, fault: str, expected: dict) -> dict:
    """`gpuprof train --inject FAULT@1`, then the recorded blame and `gpuprof replay` of its bundle."""
    run_dir = bench.runs / f"fault-{fault}"
    argv = ["train", *bench.train_flags(), "--variant", "baseline", *expected["flags"], "--steps", "3",
            "--batch-size", str(bench.plan.fault_batch_size), "--seq-len", str(bench.plan.fault_seq_len),
            "--log-every", "3", "--inject", f"{fault}@{FAULT_STEP}", "--run-dir", str(run_dir)]
    exit_code, _ = cli(argv, bench.logs / f"forensics-{fault}.log")
    if exit_code:
        raise RuntimeError(f"gpuprof {' '.join(argv)} exited with {exit_code}")
    blame = recorded_blame(run_dir)
    print(format_blame(blame), flush=True)
    replay_code, replay_output = cli(["replay", blame.bundle, "--device", bench.args.device],
                                     bench.logs / f"replay-{fault}.log")
    where = blame.tensor or blame.module or ""
    return {"command": "gpuprof " + " ".join(argv), "run_dir": str(run_dir), "blame": blame.details(),
            "blame_text": format_blame(blame),
            "matches_expected": (blame.step == FAULT_STEP and blame.phase == expected["phase"]
                                 and expected["where"] in where and blame.first == expected["first"]),
            "replay_exit_code": replay_code, "replay_same_blame": replay_code == 0, "replay_output": replay_output}


def recorded_blame(run_dir: Path) -> Blame:
    events = gpuprof.load_run(run_dir).events
    found = events[events["kind"] == EventKind.NONFINITE]
    if found.empty:
        raise RuntimeError(f"no {EventKind.NONFINITE} event recorded in {run_dir}")
    row = found.iloc[0]
    details = row["details"] if isinstance(row["details"], dict) else json.loads(row["details"])
    return Blame.from_details({**details, "step": int(row["step"])})


def cli(argv: list[str], log: Path) -> tuple[int, str]:
    """A gpuprof command in this process; its stdout is returned, stdout and stderr go to `log`."""
    stdout = io.StringIO()
    with log.open("w") as errors, contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(errors):
        exit_code = gpuprof_cli(argv)
    log.write_text(stdout.getvalue() + log.read_text())
    return exit_code, stdout.getvalue()


# --------------------------------------------------------------------------- 6. trace and analyze


TRACE_STEPS = range(2, 5)  # `gpuprof trace` leaves the window's last step out, as HTA does
TRACE_TOP = 50  # kernels listed, enough to find the attention kernel
MEMORY_STEPS = 3  # enough for the optimizer state to exist in the snapshot


def section_trace(bench: Bench) -> dict:
    """A three-step torch.profiler window of the optimized loop, through `gpuprof trace --json`."""
    workbench, run_dir = bench.workbench, bench.runs / "trace-window"
    with workbench.profile(run_dir, trace_steps=TRACE_STEPS) as prof:
        workbench.steps(prof, TRACE_STEPS.stop + 1, bench.device)
    windows = gpuprof.load_run(run_dir).trace_windows
    if not windows:
        raise RuntimeError(f"no trace window written under {run_dir}")
    window = run_dir / "traces" / next(iter(windows))
    exit_code, text = cli(["trace", str(window)], bench.logs / "trace.log")
    exit_code_json, document = cli(["trace", str(window), "--json", "--top", str(TRACE_TOP)],
                                   bench.logs / "trace-json.log")
    if exit_code or exit_code_json:
        raise RuntimeError(f"gpuprof trace exited with {exit_code or exit_code_json}")
    (bench.out / "trace.txt").write_text(text)
    (bench.out / "trace.json").write_text(document)
    return {"window": str(window), **trace_headlines(json.loads(document)["tables"])}


def section_memory(bench: Bench) -> dict:
    """An on-demand CUDA memory snapshot (allocation history on), read back by the dashboard's reader."""
    if bench.device.type != "cuda":
        raise SectionSkipped("CUDA only: torch.cuda.memory._snapshot() needs the CUDA caching allocator")
    workbench, run_dir = bench.workbench, bench.runs / "memory-snapshot"
    with workbench.profile(run_dir, memory_history=True) as prof:
        workbench.steps(prof, MEMORY_STEPS, bench.device)
        path = prof.memory_snapshot()
    if path is None:
        raise RuntimeError("prof.memory_snapshot() recorded nothing on a CUDA device")
    snapshot = read_snapshot(path)
    top = snapshot.top_allocations.head(3)
    return {"snapshot": str(path), "allocated_bytes": snapshot.allocated_bytes,
            "reserved_bytes": snapshot.reserved_bytes, "segments": snapshot.segments,
            "timeline_points": len(snapshot.timeline), "top_allocations": top.to_dict("records")}


def trace_headlines(tables: dict) -> dict:
    top = tables["top_kernels"] if tables["top_kernels"] else tables["top_cpu_ops"]
    temporal = tables["temporal_breakdown"][0] if tables["temporal_breakdown"] else {}
    return {"profiler_steps": tables["overview"][0]["profiler_steps"],
            "device_events": tables["overview"][0]["device_events"],
            "idle_time_pct": temporal.get("idle_time_pct"),
            "tensor_core_pct": (tables["tensor_core_share"] or [{}])[0].get("tensor_core_pct"),
            "host_device_syncs": len(tables["host_device_syncs"]),
            "flash_attention_kernel": any("flash" in row["name"].lower() for row in tables["top_kernels"]),
            "top": [row["name"] for row in top[:3]]}


def section_analyze(bench: Bench) -> dict:
    folder = bench.out / "analyze"
    folder.mkdir(exist_ok=True)
    analyses = {}
    for run_dir in sorted(path.parent for path in bench.runs.glob("*/meta.json")):
        analyses[run_dir.name] = guarded(analyze, run_dir, folder, bench.logs)
    if not analyses:
        raise RuntimeError(f"no recorded runs under {bench.runs}")
    return {"runs": analyses, **failures(analyses)}


def analyze(run_dir: Path, folder: Path, logs: Path) -> dict:
    """`gpuprof analyze RUN` as text and as JSON, both kept under OUT_DIR/analyze/."""
    exit_code, document = cli(["analyze", str(run_dir), "--json"], logs / f"analyze-{run_dir.name}.log")
    if exit_code:
        raise RuntimeError(f"gpuprof analyze {run_dir} exited with {exit_code}")
    _, text = cli(["analyze", str(run_dir)], logs / f"analyze-{run_dir.name}-text.log")
    (folder / f"{run_dir.name}.txt").write_text(text)
    (folder / f"{run_dir.name}.json").write_text(document)
    report = json.loads(document)
    return {"tokens_per_s": report["summary"]["tokens_per_s"], "verdict": report["verdict"]["headline"],
            "findings": [f"{finding['severity']} {finding['rule']}" for finding in report["findings"]]}


SECTIONS = {  # the quick ones first: a run cut short keeps what they measured
    "environment": section_environment,
    "overhead": section_overhead,
    "overhead_small_step": section_overhead_small_step,
    "sync_debug": section_sync_debug,
    "forensics": section_forensics,
    "forensics_any_loop": section_forensics_any_loop,
    "trace": section_trace,
    "memory": section_memory,
    "reference": section_reference,
    "analyze": section_analyze,
    "reference_compiled": section_reference_compiled,
}


# --------------------------------------------------------------------------- output


def write_json(path: Path, results: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(json_safe(results), indent=1, allow_nan=False))
    tmp.replace(path)


def summary_table(results: dict) -> str:
    sections = results["sections"]
    lines = [f"gpuprof GPU validation: {results['args']['model']} on {device_label(sections)}, "
             f"{results['runtime_s']:.0f} s", "", "| section | status | headline |", "|---|---|---|"]
    for name, record in sections.items():
        headline = HEADLINES[name](record) if record["status"] == "ok" else record.get("note") or record.get("error")
        lines.append(f"| {name} | {record['status']} | {one_line(headline)} |")
    reference = sections.get("reference", {})
    if reference.get("status") == "ok":
        lines += ["", "| variant | step p50 | tokens/s | MFU | peak alloc | speedup (baseline step / step) |",
                  "|---|---|---|---|---|---|"]
        rows, speedups = dict(reference["variants"]), dict(reference["ratios_vs_baseline"])
        compiled = sections.get("reference_compiled")
        if compiled is not None:
            rows[COMPILED_VARIANT] = compiled.get("variant") or compiled
            speedups[COMPILED_VARIANT] = compiled.get("ratio_vs_baseline", {})
        for name, run in rows.items():
            lines.append(variant_row(name, run, speedups.get(name, {})))
    return "\n".join(lines)


def device_label(sections: dict) -> str:
    environment = sections.get("environment", {})
    return environment.get("device_name") or "unknown device"


def one_line(text) -> str:
    return " ".join(str(text).split())[:200]


def variant_row(name: str, run: dict, ratio: dict) -> str:
    if run["status"] != "ok":
        return f"| {name} | {run['status']}: {one_line(run.get('note') or run.get('error'))} | | | | |"
    speedup = ratio.get("step_time_p50_s")
    return (f"| {name} | {fmt(run['step_time_p50_s'], 1e3, '.1f', ' ms')} | {fmt(run['tokens_per_s'], 1, ',.0f')} "
            f"| {fmt(run['mfu'], 100, '.1f', '%')} | {fmt(run['peak_mem_allocated_bytes'], 2**-30, '.2f', ' GiB')} "
            f"| {fmt(speedup and 1 / speedup, 1, '.2f', 'x')} |")


def fmt(value, scale: float, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value * scale:{spec}}{unit}"


def environment_headline(record: dict) -> str:
    if "bf16_matmul_tflop_per_s" in record:
        return (f"driver {record['driver']}, torch {record['torch']}, CUDA {record['cuda']}: bf16 matmul "
                f"{record['bf16_matmul_tflop_per_s']:.0f} TFLOP/s ({fmt(record['bf16_matmul_of_datasheet_pct'], 1, '.0f', '%')}"
                f" of datasheet), D2D copy {record['d2d_copy_gb_per_s']:,.0f} GB/s")
    return (f"torch {record['torch']}, {record['torch_threads']} threads: matmul fp32 {record['fp32_matmul_gflop_per_s']:.1f} / "
            f"bf16 {record['bf16_matmul_gflop_per_s']:.1f} GFLOP/s, memcpy {record['memcpy_gb_per_s']:.1f} GB/s")


def reference_headline(record: dict) -> str:
    parts = [f"{name} {1 / ratio['step_time_p50_s']:.2f}x" for name, ratio in record["ratios_vs_baseline"].items()
             if ratio.get("step_time_p50_s")]
    return "step-time speedup over baseline: " + (", ".join(parts) or "n/a")


def overhead_headline(record: dict) -> str:
    verdict = "within" if record["within_target"] else "OVER"
    loops = record["loops"]
    others = ", ".join(f"{name} {loop['overhead_pct']:+.2f}%" for name, loop in loops.items()
                       if name != record["headline_loop"])
    return (f"capture {record['overhead_pct']:+.2f}% per step on the least flattering default loop "
            f"({record['headline_loop']}; {verdict} the {record['target_pct']:g}% target; median of "
            f"{loops[record['headline_loop']]['pairs']} interleaved pairs); {others}")


def compiled_headline(record: dict) -> str:
    return f"step-time speedup over baseline {1 / record['ratio_vs_baseline']['step_time_p50_s']:.2f}x"


def memory_headline(record: dict) -> str:
    return (f"snapshot of {record['segments']} segments, {record['allocated_bytes'] / 2**30:.2f} GiB allocated, "
            f"{record['timeline_points']} timeline points")


def small_step_headline(record: dict) -> str:
    return (f"x{record['ratio_median']:.3f} (p10-p90 x{record['ratio_p10']:.3f}-x{record['ratio_p90']:.3f}, "
            f"{record['pairs']} pairs), +{record['added_us_per_step']:.0f} us on {record['bare_step_s'] * 1e3:.2f} ms "
            f"steps, memory {record['peak_memory_added_pct']:+.3f}%: {record['loop']}")


def sync_headline(record: dict) -> str:
    if record["no_sync"]:
        return (f"no host-device sync in {record['checked_steps']} captured steps of each of {len(record['loops'])} "
                f"loops, armed after {record['after_warmup']['warmup_steps']} warm-up steps")
    parts = []
    for name, loop in record["loops"].items():
        if loop["no_sync"]:
            parts.append(f"{name}: none")
        elif loop["gpuprof_sync_free"]:
            parts.append(f"{name}: none from gpuprof; the loop syncs at {', '.join(loop['sync_sites'])}")
        else:
            parts.append(f"{name}: SYNC from gpuprof: {loop['gpuprof_sync_sites'] or loop['switched_off']}")
    return "; ".join(parts)


def forensics_headline(record: dict) -> str:
    parts = []
    for fault, result in record["faults"].items():
        blame = result["blame"]
        ok = "expected" if result["matches_expected"] else "UNEXPECTED"
        replay = {True: "same", False: "DIFFERS", None: "not replayable"}[result.get("replay_same_blame")]
        op = f" {blame['op']}" if blame["op"] else ""
        kept = f"; state kept {result['keep_state']}" if "keep_state" in result else ""
        parts.append(f"{fault}: step {blame['step']} {blame['phase']} {blame['tensor'] or blame['module']}{op} "
                     f"{blame['first']} ({ok}; replay {replay}{kept})")
    return "; ".join(parts)


def trace_headline(record: dict) -> str:
    return (f"{record['profiler_steps']} steps, {record['device_events']} device events, idle "
            f"{fmt(record['idle_time_pct'], 1, '.1f', '%')}, tensor cores {fmt(record['tensor_core_pct'], 1, '.0f', '%')}, "
            f"flash attention kernel {'seen' if record['flash_attention_kernel'] else 'not seen'}, "
            f"top: {', '.join(record['top'][:2])}")


def analyze_headline(record: dict) -> str:
    counts = [f"{name} {len(run.get('findings', []))}" for name, run in record["runs"].items()]
    return "findings per run: " + ", ".join(counts)


HEADLINES = {
    "environment": environment_headline, "reference": reference_headline, "overhead": overhead_headline,
    "overhead_small_step": small_step_headline, "sync_debug": sync_headline, "forensics": forensics_headline,
    "forensics_any_loop": forensics_headline, "trace": trace_headline, "memory": memory_headline,
    "analyze": analyze_headline, "reference_compiled": compiled_headline,
}


def results_markdown(results: dict, table: str) -> str:
    sections = results["sections"]
    lines = [table, ""] + overhead_markdown(sections)
    for name in ("forensics", "forensics_any_loop"):
        for fault, result in sections.get(name, {}).get("faults", {}).items():
            if result["status"] != "ok":
                continue
            where = f"`{result['command']}`" if "command" in result else f"a user's loop, {result['precision']}"
            lines += [f"### {name}: {fault}", "", where, "", "```", result["blame_text"], "```", ""]
    for name, record in sections.items():
        if record["status"] == "failed":
            lines += [f"### {name} failed", "", "```", record.get("traceback") or record["error"], "```", ""]
    return "\n".join(lines)


def overhead_markdown(sections: dict) -> list[str]:
    """Every measured loop: wall-time ratio captured/bare, its spread, and the time added per step."""
    loops = dict(sections.get("overhead", {}).get("loops", {}))
    if sections.get("overhead_small_step", {}).get("status") == "ok":
        loops[f"small step: {sections['overhead_small_step']['loop']}"] = sections["overhead_small_step"]
    if not loops:
        return []
    lines = ["### capture overhead", "", "| loop | pairs | ratio (median) | p10-p90 | added per step | bare step "
             "| memory added |", "|---|---|---|---|---|---|---|"]
    for name, loop in loops.items():
        lines.append(f"| {name} | {loop['pairs']} | x{loop['ratio_median']:.4f} | x{loop['ratio_p10']:.3f}-"
                     f"x{loop['ratio_p90']:.3f} | {loop['added_us_per_step']:+.0f} us | {loop['bare_step_s'] * 1e3:.2f} ms "
                     f"| {loop['peak_memory_added_bytes'] / 2**20:+.1f} MiB ({loop['peak_memory_added_pct']:+.3f}%, "
                     f"{loop['memory_measured']}) |")
    return lines + [""]


if __name__ == "__main__":
    sys.exit(main())
