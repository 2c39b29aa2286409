"""Fixtures for the diagnoses tests.

Rules are tested on real runs recorded once per session (see `recorded_runs`). Facts only a
GPU records (NVML samples, tensor cores, CUDA allocator counters) cannot come from a CPU
machine; for those, `write_gpu_run` writes a run through the real RunWriter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diagnoses_helpers import CPU_DEVICE, STEP_TIME_S, healthy_step
from filelock import FileLock

from gpuprof.run.reader import load_run
from gpuprof.run.schema import FORMAT, FORMAT_VERSION, TRACES_DIR
from gpuprof.run.writer import RunWriter

GPU_META = {
    "format": FORMAT,
    "format_version": FORMAT_VERSION,
    "status": "finished",
    "world_size": 1,
    "devices": [{"index": 0, "name": "NVIDIA A100-SXM4-80GB", "kind": "cuda",
                 "total_memory_bytes": 80 * 2**30, "capability": "8.0"}],
    "model": {"class": "GPT2LMHeadModel"},
    "compute_dtype": "bf16",
    "config": {},
}
# Beside the checkout (/work/main -> /work/shared/traces), or where GPUPROF_SHARED_TRACES says (a worktree).
SHARED_TRACES = Path(os.environ.get("GPUPROF_SHARED_TRACES") or Path(__file__).resolve().parents[2].parent / "shared" / "traces")


def healthy_sample(step: int) -> dict:
    return {"time_unix_s": 1000.0 + STEP_TIME_S * (step + 0.5), "rank": 0, "device_index": 0,
            "gpu_util_pct": 97.0, "power_w": 300.0, "temp_c": 65.0, "sm_clock_mhz": 1410.0,
            "throttle_reasons": []}


@pytest.fixture
def write_gpu_run(tmp_path):
    """write(meta=..., step=..., sample=..., samples=True, traces=()) -> Run: a 20-step A100 run
    written by the real writer.

    `meta` updates GPU_META; `step(i)` / `sample(i)` return overrides for step i's record and
    the system sample taken during it; `samples=False` leaves out NVML samples; `traces` are
    trace files copied into the run's traces/ folder; `stacks(i)` the stack sampler's rows of step i.
    """
    counter = iter(range(1000))

    def write(*, meta=None, step=None, sample=None, steps=20, samples=True, traces=(), stacks=None):
        path = tmp_path / f"gpu-run-{next(counter)}"
        writer = RunWriter(path, 0)
        writer.write_run_meta({**GPU_META, "name": path.name, **(meta or {})})
        for index in range(steps):
            writer.write("steps", [{**healthy_step(index), **(step(index) if step else {})}])
            if samples:
                writer.write("system", [{**healthy_sample(index), **(sample(index) if sample else {})}])
            if stacks:
                writer.write("stacks", stacks(index))
        for trace in traces:
            shutil.copy(trace, writer.artifact_dir(TRACES_DIR) / trace.name)
        writer.close()
        return load_run(path)

    return write




@pytest.fixture
def write_cpu_run(write_gpu_run):
    """write(meta=..., step=..., steps=20, traces=()) -> Run: the written run on a CPU (no NVML samples),
    for thresholds tested on written step streams rather than live timing."""

    def write(*, meta=None, **options):
        return write_gpu_run(meta={"devices": [CPU_DEVICE], **(meta or {})}, samples=False, **options)

    return write


@pytest.fixture
def gpu_device() -> dict:
    return dict(GPU_META["devices"][0])


# The reference workload, small enough for a loaded 2-core machine: every run below is the
# same tiny GPT-2 with one knob turned to show a problem (or not). A 256-token vocabulary over
# random tokens keeps a step to milliseconds, so the delays made on purpose dominate the noise.
VOCAB_SIZE = 256
TRAIN = ("--model", "tiny", "--steps", "6", "--batch-size", "4", "--seq-len", "32", "--device", "cpu",
         "--vocab-size", str(VOCAB_SIZE))
DATA_DELAY_MS = 500
STRAGGLER_DELAY_MS = 400
# Both DDP runs sleep this long in their loaders: a step long against the few milliseconds of
# host jitter between two processes sharing 2 cores, so only the straggler's delay stands out.
DDP_DATA_DELAY = ("--data-delay-ms", "200")
RECORDED = {
    "baseline": ((), 1),
    "data_delay": (("--data-delay-ms", str(DATA_DELAY_MS)), 1),
    # sdpa too: the silent pair of attention-not-fused, and a second change for `compare`; the
    # trace window (ending with the run) is where host-device-sync sees the loop's loss.item().
    "host_sync": (("--host-sync", "--attention", "sdpa", "--trace-steps", "3:6"), 1),
    "ddp": (DDP_DATA_DELAY, 2),
    "ddp_straggler": (DDP_DATA_DELAY + ("--straggler-rank", "1", "--straggler-delay-ms", str(STRAGGLER_DELAY_MS)), 2),
    # FSDP2 over gloo, traced: two processes on a loaded 2-core machine wait on each other's collectives
    "fsdp": (("--parallel", "fsdp", "--trace-steps", "3:5"), 2),
    "fsdp_no_reshard": (("--parallel", "fsdp", "--no-reshard-after-forward", "--trace-steps", "3:5"), 2),
}
# Runs of as many processes recorded by one torchrun job, one after the other (train_runs.py): a job
# of its own costs the launcher and every rank importing torch and transformers again.
RECORDED_TOGETHER = (("fsdp", "fsdp_no_reshard"),)
TRAIN_RUNS = Path(__file__).with_name("train_runs.py")


def train_argv(run_dir, data, extra) -> list[str]:
    return ["train", *TRAIN, "--data", str(data), *extra, "--run-dir", str(run_dir)]


def train_command(argvs: list[list[str]], n_procs) -> list[str]:
    """`gpuprof` with each of argvs: one process, a torchrun job, or for several runs one job of train_runs.py."""
    if n_procs == 1:
        (argv,) = argvs
        return [sys.executable, "-m", "gpuprof", *argv]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n_procs}"]
    if len(argvs) == 1:
        return [*launcher, "-m", "gpuprof", *argvs[0]]
    return [*launcher, str(TRAIN_RUNS), json.dumps(argvs)]


class RecordedRuns:
    """Real runs of the reference workload, recorded on first use and shared by all xdist workers."""

    data_delay_ms = DATA_DELAY_MS
    straggler_delay_ms = STRAGGLER_DELAY_MS

    def __init__(self, root):
        self.root = root

    def tokens(self):
        """A uint16 token file the workload reads as its data (random tokens below VOCAB_SIZE)."""
        path = self.root / "tokens.bin"
        with FileLock(str(self.root / "tokens.lock")):
            if not path.is_file():
                np.random.default_rng(0).integers(0, VOCAB_SIZE, 100_000, dtype=np.uint16).tofile(path)
        return path

    def path(self, name: str):
        run_dir = self.root / name
        together = next((names for names in RECORDED_TOGETHER if name in names), (name,))
        with FileLock(str(self.root / f"{together[0]}.lock")):
            if not (run_dir / "meta.json").is_file():
                argvs = [train_argv(self.root / each, self.tokens(), RECORDED[each][0]) for each in together]
                # One thread per process: tiny ops gain nothing from more, and spinning threads
                # of concurrent test processes slow each other down on 2 cores.
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                result = subprocess.run(train_command(argvs, RECORDED[name][1]),
                                        capture_output=True, text=True, timeout=600, env=env)
                assert result.returncode == 0, f"recording {', '.join(together)} failed:\n{result.stderr[-3000:]}"
        return run_dir

    def __getitem__(self, name: str):
        return load_run(self.path(name))


@pytest.fixture(scope="session")
def recorded_runs(tmp_path_factory, worker_id):
    # Every xdist worker gets its own basetemp; their parent is shared for the session.
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "diagnoses-runs"
    root.mkdir(exist_ok=True)
    return RecordedRuns(root)


# ---------------------------------------------------------------- small real training loops
# Numerical problems the reference workload has no knob for are shown by a small real loop
# recorded with gpuprof.profile (step-time rules are tested on written streams instead).
LOOP_STEPS = 16


class Blocks(torch.nn.Module):
    """A stack of numbered blocks (`blocks.N`), the shape gpuprof's per-block gradient checks group by."""

    def __init__(self, width: int = 16, depth: int = 4, activation=torch.nn.ReLU, init_gain: float = 1.0):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)
        self.activation = activation()
        for block in self.blocks:
            torch.nn.init.normal_(block.weight, std=init_gain / width**0.5)

    def forward(self, x):
        for block in self.blocks:
            x = self.activation(block(x))
        return self.head(x)


def run_loop(run_dir, *, model=None, corrupt=None, fp16_scaler=False, guard_scheduler=True, wrap=None,
             clip=None):
    """A real 16-step loop under gpuprof.profile.

    corrupt(step, x) -> x changes a batch; fp16_scaler: autocast fp16 with a GradScaler and a
    per-step LR scheduler, stepped only on real optimizer steps when guard_scheduler;
    wrap(model) -> the module trained (DataParallel); clip: the max_norm of a clip_grad_norm_ before each update.
    """
    import gpuprof

    torch.manual_seed(0)
    model = model or Blocks()
    trained = wrap(model) if wrap else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.95)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=4, enabled=fp16_scaler)
    with gpuprof.profile(run_dir, model=trained, optimizer=optimizer, scaler=scaler if fp16_scaler else None,
                         lr_scheduler=scheduler if fp16_scaler else None, sample_interval_s=None,
                         layer_interval=1) as prof:
        for step in range(LOOP_STEPS):
            with prof.phase("data"):
                x, y = torch.randn(64, 16), torch.randn(64, 1)
                x = corrupt(step, x) if corrupt else x
            with prof.phase("forward"):
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_scaler):
                    loss = torch.nn.functional.mse_loss(trained(x).float(), y)
            with prof.phase("backward"):
                scaler.scale(loss).backward()
            with prof.phase("optimizer"):
                scale_before = scaler.get_scale() if fp16_scaler else None
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if fp16_scaler and (not guard_scheduler or scaler.get_scale() >= scale_before):
                    scheduler.step()
            prof.step(loss=loss, tokens=x.shape[0])
    return load_run(run_dir)


def overflow_from(first_step: int):
    """Inputs so large from `first_step` on that every fp16 backward overflows (GradScaler skips)."""
    return lambda step, x: x * 1e5 if step >= first_step else x


LOOPS = {
    "healthy": {},
    "corrupt_batch": {"corrupt": lambda step, x: x * 1e3 if step == 12 else x},
    "corrupt_batch_clipped": {"corrupt": lambda step, x: x * 1e3 if step == 12 else x, "clip": 1.0},
    "nan_input": {"corrupt": lambda step, x: x.fill_(float("nan")) if step == 6 else x},
    "fp16_guarded": {"fp16_scaler": True},
    "fp16_overflow": {"fp16_scaler": True, "corrupt": overflow_from(8), "guard_scheduler": False},
    "vanishing": {"model_factory": lambda: Blocks(depth=6, activation=torch.nn.Sigmoid, init_gain=0.05)},
    "dataparallel": {"wrap": torch.nn.DataParallel},
}


@pytest.fixture(scope="session")
def loop_runs(tmp_path_factory):
    """loop_runs[name] -> the Run of the LOOPS scenario `name`, recorded once per worker."""
    root = tmp_path_factory.mktemp("loops")
    cache = {}

    class Loops:
        def __getitem__(self, name):
            if name not in cache:
                options = dict(LOOPS[name])
                factory = options.pop("model_factory", None)
                cache[name] = run_loop(root / name, model=factory() if factory else None, **options)
            return cache[name]

    return Loops()


@pytest.fixture
def shared_trace():
    """shared_trace(folder) -> the trace files of a real trace from ../shared/traces (skips without it)."""

    def files(folder: str) -> list[Path]:
        found = sorted((SHARED_TRACES / folder).glob("*.json*"))
        if not found:
            pytest.skip(f"real traces not present: {SHARED_TRACES / folder}")
        return found

    return files
