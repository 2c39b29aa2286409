"""Capture overhead as a user sees it: the wall time of the same loop bare and under gpuprof.profile.

The headline is wall time, with torch's default thread count, the background sampler on and every
default of `gpuprof.profile(run_dir, model=model, optimizer=optimizer)` on (NaN checks included).
Bare and captured blocks of `--steps` steps alternate (which goes first alternating per pair), on
the same model and optimizer in one process, each after one untimed warm-up step; opening and
closing the run (thread start, Parquet compaction) is outside the timed steps and reported apart.
Printed: the median of the per-pair ratios captured/bare, their p10-p90 spread, the CPU time per step
of the process (all threads) and of the training thread, bare and captured (on a loaded machine the
CPU times still measure what capture adds; wall time does not), and the memory capture adds (`peak_memory_added_pct`, median over
pairs): on CUDA the peak allocated bytes of a captured block minus a bare one's, as a percentage of
the device's memory; on the CPU the process RSS at the blocks' ends, of the host's memory (RSS
freed by a captured block may stay with the process into the next bare one: a lower bound).

`--components` adds a table in microseconds per step:
  timer   one captured block with a timer around every gpuprof hook (self time, per part); the
          sampler's thread is timed on its own thread; `--timer-clock thread` times CPU time instead
  switch  the parts switched on one at a time, each as interleaved pairs against bare: the increase
          in wall time per step over the configuration before
  cold    a few of gpuprof's per-step pieces, each timed as the first thing after a bare training
          step (where gpuprof's step-end work runs) and again at once: what the first call costs
          against a repeated one
  ops     the torch ops a captured step calls that a bare one does not (torch.profiler's counts of the aten
          ops called from Python, not those an op runs inside, over --ops-steps steps of each, captured minus
          bare, per step): a count that holds on a loaded machine, where each call costs microseconds cold
  entries empty hooks at the torch events gpuprof is entered from (the model's forward pre-hook and
          hook, the optimizer's step pre- and post-hooks, two parameters' post-accumulate-grad hooks
          queueing an engine callback, `torch.autograd.backward` wrapped, a TorchFunctionMode from the
          forward's end to `backward()`, `prof.step()`), each a no-op behind `torch._dynamo.disable` as
          gpuprof's are: --pairs interleaved pairs against bare, on every clock. What being entered costs,
          without the work done there, to set beside the headline's added time; a block's own movement
          (about +-400 us a step here with 15 pairs) needs 60 pairs or so to show it
  stacks  the stack sampler (gpuprof.capture.stack_sampler): interleaved pairs captured with every default,
          stack samples off and on (at --stack-interval-s, default the Profiler's), the increase in
          wall time per step; and each sample's own time on the training thread (where it is taken),
          wall and CPU, with what that comes to per step and per core at that rate

    .venv/bin/python benchmarks/overhead.py                                  # tiny GPT-2, 4x64 tokens, plain loop
    .venv/bin/python benchmarks/overhead.py --loss outside                   # the loss computed by the loop
    .venv/bin/python benchmarks/overhead.py --loss outside --no-clip         # ... and no clip_grad_norm_
    .venv/bin/python benchmarks/overhead.py --components timer switch
    .venv/bin/python benchmarks/overhead.py --threads 1 --loss outside --no-clip --components timer --timer-clock thread
    .venv/bin/python benchmarks/overhead.py --pairs 3 --components cold
    .venv/bin/python benchmarks/overhead.py --pairs 1 --components ops
    .venv/bin/python benchmarks/overhead.py --pairs 3 --components stacks --stacks-pairs 20
    .venv/bin/python benchmarks/overhead.py --threads 1 --pairs 60 --loss outside --no-clip --components entries
    .venv/bin/python benchmarks/overhead.py --model 124m --batch 1 --seq 128 --pairs 6 --steps 2
    .venv/bin/python benchmarks/overhead.py --model 124m --device cuda --dtype bf16 --batch 16 --seq 1024
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import psutil
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import gpuprof
from gpuprof.capture import losses
from gpuprof.capture.backward import BackwardWatcher
from gpuprof.capture.collector import CollectorSet, _SharedHook
from gpuprof.capture.memory import RssReader
from gpuprof.capture.profiler import Profiler
from gpuprof.capture.stack_sampler import STACK_INTERVAL_S, StackSampler
from gpuprof.capture.system import SystemSampler
from gpuprof.numerics.keeping import StepKeeping, _WeightSample
from gpuprof.numerics.monitor import NumericsMonitor
from gpuprof.numerics.state import hyperparameters, rng_states
from gpuprof.numerics.tape import Tape
from gpuprof.run.writer import StreamWriter

MODELS = {
    "tiny": dict(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=1024),
    "124m": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
}
# `--components switch`: each configuration adds one part to the one before (gpuprof.profile options).
CONFIGURATIONS = {
    "timing, step records, writer": dict(grad_norms=False, numerics=False, sample_interval_s=0),
    "+ gradient norms": dict(numerics=False, sample_interval_s=0),
    "+ numerics flags": dict(numerics={"keep_state": False}, sample_interval_s=0),
    "+ state keeping (numerics default)": dict(sample_interval_s=0),
    "+ sampler (all defaults)": dict(),
}
# `--components switch`, then: all defaults with one part made a no-op, for parts no option switches off.
PATCHED_OUT = {"numerics tape's loss window (a TorchFunctionMode)": (Tape, "_enter_window")}


class Bare:
    """The loop's view of a profiler, doing nothing."""

    def phase(self, name):
        return contextlib.nullcontext()

    def step(self, **kwargs):
        pass


def train_steps(prof, model, optimizer, tokens, steps: int, dtype, device, marked: bool = True,
                loss_outside: bool = False, clip: bool = True) -> None:
    """`steps` optimizer steps; `marked`: with prof.phase() around data, forward, backward, optimizer;
    `loss_outside`: the loop computes the loss from the logits (nanoGPT style) instead of `labels=`;
    `clip`: the loop clips its gradients with clip_grad_norm_ (gpuprof then reads the norm it computes)."""
    phase = prof.phase if marked else Bare().phase
    for _ in range(steps):
        with phase("data"):
            batch = tokens.to(device, non_blocking=True)
        with phase("forward"), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            if loss_outside:
                logits = model(input_ids=batch).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
            else:
                loss = model(input_ids=batch, labels=batch).loss
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        prof.step(loss=loss, tokens=batch.numel())


def interleaved_blocks(reps: int, block, open_run):
    """Per repetition, one bare and one captured block, which goes first alternating:
    yields (rep, bare seconds, capture seconds). `block(prof)` times one block;
    `open_run(rep)` opens the capture run of repetition `rep`."""
    for rep in range(reps):
        times = {}
        for mode in (("bare", "capture") if rep % 2 == 0 else ("capture", "bare")):
            if mode == "bare":
                times[mode] = block(Bare())
            else:
                with open_run(rep) as prof:
                    times[mode] = block(prof)
        yield rep, times["bare"], times["capture"]


# wall: what the user waits; cpu: the process's CPU time, all threads (the sampler's too); thread: the
# training thread's CPU time, where gpuprof's hooks run. CPU times hold on a loaded machine, wall time does not.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time, "thread": time.thread_time}


def timed_steps(prof, steps: int, model, optimizer, tokens, device, dtype, marked: bool,
                loss_outside: bool = False, clip: bool = True) -> dict[str, float]:
    """Seconds per step on every clock over `steps` steps, after one warm-up step; and the block's memory
    (memory_of_block)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train_steps(prof, model, optimizer, tokens, 1, dtype, device, marked, loss_outside, clip)
    _synchronize(device)
    start = {name: clock() for name, clock in CLOCKS.items()}
    train_steps(prof, model, optimizer, tokens, steps, dtype, device, marked, loss_outside, clip)
    _synchronize(device)
    return {**{name: (clock() - start[name]) / steps for name, clock in CLOCKS.items()}, **memory_of_block(device)}


def memory_of_block(device: torch.device) -> dict[str, int]:
    """On CUDA the block's peak allocated bytes (from its warm-up step on); elsewhere the process RSS at
    its end (a peak RSS never comes down, so it cannot tell two blocks of one process apart)."""
    if device.type == "cuda":
        return {"peak_allocated_bytes": torch.cuda.max_memory_allocated(device)}
    return {"rss_bytes": psutil.Process().memory_info().rss}


def memory_total_bytes(device: torch.device) -> int:
    """What peak_memory_added_pct is a percentage of: the device's memory, the host's on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Pairs:
    """Interleaved bare/captured pairs of one configuration, and what they add up to."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bare: list[dict[str, float]] = []
        self.capture: list[dict[str, float]] = []
        self.open_close_s: list[float] = []

    def ratios(self, clock: str = "wall") -> list[float]:
        return [c[clock] / b[clock] for b, c in zip(self.bare, self.capture)]

    def median_ratio(self, clock: str = "wall") -> float:
        return statistics.median(self.ratios(clock))

    def spread(self, clock: str = "wall") -> tuple[float, float]:
        """p10 and p90 of the per-pair ratios (the extremes with fewer than 10 pairs)."""
        ratios = sorted(self.ratios(clock))
        if len(ratios) < 10:
            return ratios[0], ratios[-1]
        deciles = statistics.quantiles(ratios, n=10, method="inclusive")
        return deciles[0], deciles[-1]

    def step_s(self, which: str, clock: str = "wall") -> float:
        return statistics.median(block[clock] for block in getattr(self, which))

    def added_us_per_step(self, clock: str = "wall") -> float:
        """Median over pairs of (captured - bare) seconds per step on `clock`, in microseconds."""
        return statistics.median(c[clock] - b[clock] for b, c in zip(self.bare, self.capture)) * 1e6

    def memory_added(self) -> dict:
        """Median over pairs of the memory capture added: CUDA peak allocated, captured minus bare, or on the
        CPU the process RSS at the blocks' ends; in bytes and as a percentage of the device's (host's) memory."""
        key = "peak_allocated_bytes" if self.device.type == "cuda" else "rss_bytes"
        added = statistics.median(c[key] - b[key] for b, c in zip(self.bare, self.capture))
        total = memory_total_bytes(self.device)
        return {"memory_measured": "cuda peak allocated" if key == "peak_allocated_bytes" else "process rss",
                "peak_memory_added_bytes": added, "peak_memory_added_pct": 100 * added / total,
                "memory_total_bytes": total}

    def figures(self) -> dict:
        """The headline figures, as a record."""
        low, high = self.spread()
        return {"pairs": len(self.bare), "ratio_median": self.median_ratio(), "ratio_p10": low, "ratio_p90": high,
                "ratios": self.ratios(), "bare_step_s": self.step_s("bare"), "capture_step_s": self.step_s("capture"),
                "added_us_per_step": self.added_us_per_step(), "cpu_ratio_median": self.median_ratio("cpu"),
                "cpu_added_us_per_step": self.added_us_per_step("cpu"),
                "thread_cpu_added_us_per_step": self.added_us_per_step("thread"),
                **self.memory_added()}


def collect_pairs(reps: int, block, open_run, device: torch.device, verbose_label: str | None = None) -> Pairs:
    """interleaved_blocks() gathered into Pairs; each pair printed when `verbose_label` is given."""
    result = Pairs(device)
    for rep, bare, capture in interleaved_blocks(reps, block, open_run):
        result.bare.append(bare)
        result.capture.append(capture)
        if verbose_label:
            print(f"  {verbose_label} pair {rep}: bare {bare['wall'] * 1e3:.2f} ms/step, captured "
                  f"{capture['wall'] * 1e3:.2f} ms/step, ratio {capture['wall'] / bare['wall']:.4f}", flush=True)
    return result


class Bench:
    """One model, optimizer and batch, bare and captured in turn."""

    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args, self.tmp = args, tmp
        self.device = torch.device(args.device)
        self.dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
        torch.manual_seed(0)
        config = GPT2Config(**MODELS[args.model], bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq))
        if self.device.type == "cuda":
            self.tokens = self.tokens.pin_memory()
        self._runs = 0

    def train(self, prof, steps: int, marked: bool | None = None) -> None:
        """`steps` steps of this bench's loop under `prof` (phases marked as --phases says, unless `marked`)."""
        train_steps(prof, self.model, self.optimizer, self.tokens, steps, self.dtype, self.device,
                    self.args.phases if marked is None else marked, self.args.loss == "outside", not self.args.no_clip)

    def block(self, prof) -> dict[str, float]:
        return timed_steps(prof, self.args.steps, self.model, self.optimizer, self.tokens, self.device, self.dtype,
                           self.args.phases, self.args.loss == "outside", not self.args.no_clip)

    def open_run(self, options: dict) -> Profiler:
        self._runs += 1
        return gpuprof.profile(self.tmp / f"run-{self._runs}", model=self.model, optimizer=self.optimizer, **options)

    @contextlib.contextmanager
    def timed_run(self, options: dict, open_close_s: list[float]):
        """A captured run whose opening and closing time is appended to `open_close_s`."""
        start = time.perf_counter()
        with self.open_run(options) as prof:
            opened = time.perf_counter()
            yield prof
            closing = time.perf_counter()
        open_close_s.append(opened - start + time.perf_counter() - closing)

    def pairs(self, options: dict, pairs: int, label: str, verbose: bool = False) -> Pairs:
        open_close_s: list[float] = []
        result = collect_pairs(pairs, self.block, lambda rep: self.timed_run(options, open_close_s), self.device,
                               label if verbose else None)
        result.open_close_s = open_close_s
        return result


# ------------------------------------------------------------------ per-hook timer


class HookTimer:
    """Self time (own time less that of timed calls inside it) per part, per thread.

    Installed on the classes for the duration of one captured block: every collector hook the
    profiler calls (by collector name), every hook a collector put into the user's model or
    optimizer through `CollectorSet.guard` or `CollectorSet.hook` (and the shared hooks' own dispatch),
    the profiler's own step and phase work, the backward watcher, the numerics monitor's state
    keeping and flags, and the run writer.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.seconds: dict[str, float] = {}
        self._clock = clock
        self._local = threading.local()
        self._patches: list[tuple[type, str, object]] = []

    def timed(self, label, function):
        """`function` timed under `label` (a string, or a callable of the call's arguments)."""

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            stack = self._stack()
            stack.append(0.0)
            start = self._clock()
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = self._clock() - start
                inner = stack.pop()
                if stack:
                    stack[-1] += elapsed
                name = label(*args) if callable(label) else label
                if threading.current_thread() is not threading.main_thread():
                    name = f"{name} (own thread)"
                self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - inner

        return wrapper

    def _stack(self) -> list[float]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def patch(self, owner: type, attribute: str, label) -> None:
        original = owner.__dict__.get(attribute)
        if original is None:
            print(f"hook timer: {owner.__name__}.{attribute} not found, not timed")
            return
        self._patches.append((owner, attribute, original))
        setattr(owner, attribute, self.timed(label, original))

    @contextlib.contextmanager
    def installed(self):
        self.patch(Profiler, "_end_step", "profiler: step boundaries, records")
        self.patch(Profiler, "_begin_step", "profiler: step boundaries, records")
        self.patch(Profiler, "begin_phase", "profiler: phases")
        self.patch(Profiler, "end_phase", "profiler: phases")
        self.patch(BackwardWatcher, "_on_grad", "backward watcher")
        self.patch(BackwardWatcher, "_finish", "backward watcher")
        self.patch(CollectorSet, "_invoke", lambda _set, collector, *args: _part(collector))
        original_guard = CollectorSet.guard
        self._patches.append((CollectorSet, "guard", original_guard))
        CollectorSet.guard = lambda collectors, collector, hook, function: original_guard(
            collectors, collector, hook, self.timed(_part(collector), function))
        original_hook = CollectorSet.hook
        self._patches.append((CollectorSet, "hook", original_hook))
        CollectorSet.hook = lambda collectors, collector, target, event, function, hook_name=None: original_hook(
            collectors, collector, target, event, self.timed(_part(collector), function), hook_name)
        self.patch(_SharedHook, "_run", "shared torch hooks (dispatch)")
        for method in ("begin", "end", "_refresh_keeper", "before_update"):
            self.patch(StepKeeping, method, "numerics: state keeping")
        self.patch(NumericsMonitor, "_watched_values", "numerics: flags")
        for method in ("_before_forward", "_after_forward", "take", "record_call", "close_micro_batch",
                       "_leave_window"):
            self.patch(Tape, method, "numerics: tape")
        for owner, attribute in ((losses, "_take"), (losses.BackwardLosses, "seen"), (losses.BackwardLosses, "take")):
            self.patch(owner, attribute, "loss taken at backward() (backward_loss)")
        self.patch(StreamWriter, "write", "writer")
        self.patch(SystemSampler, "sample", "sampler")
        self.patch(StackSampler, "sample", "stack sampler")
        self.patch(StackSampler, "_take", "stack sampler: the sample")
        try:
            yield self
        finally:
            for owner, attribute, original in reversed(self._patches):
                setattr(owner, attribute, original)
            self._patches.clear()


def _part(collector) -> str:
    name = getattr(collector, "name", type(collector).__name__)
    return {"gradients": "gradient norms", "numerics": "numerics: other hooks"}.get(name, f"collector {name}")


def hook_table(bench: Bench, steps: int, clock: str) -> tuple[dict[str, float], float]:
    """Microseconds per step per part over `steps` captured steps (all defaults), and the block's
    time per step, both on `clock` ("wall", or "thread": each thread's CPU time)."""
    timer = HookTimer(CLOCKS[clock])
    with timer.installed(), bench.open_run({}) as prof:
        bench.train(prof, 1)
        timer.seconds.clear()
        start = CLOCKS[clock]()
        bench.train(prof, steps)
        _synchronize(bench.device)
        block_s = CLOCKS[clock]() - start
    return {name: seconds / steps * 1e6 for name, seconds in timer.seconds.items()}, block_s / steps


def cold_probes(bench: Bench) -> dict[str, Callable[[], object]]:
    """Pieces of gpuprof's per-step work, each a real code path, to time cold and warm."""
    weights = _WeightSample(bench.model, bench.device, refresh_steps=0)
    weights.absmax(0)  # its views made once, as during a run
    rss, zero = RssReader(), torch.zeros((), device=bench.device)
    return {
        "one 0-d tensor add": lambda: zero + 1,
        "RNG state copy (numerics)": rng_states,
        "hyperparameter snapshot (numerics)": lambda: hyperparameters(bench.optimizer),
        "weight sample, 3 ops (numerics)": lambda: weights.absmax(1),
        "process RSS read (memory)": rss.rss_bytes,
    }


def cold_table(bench: Bench, rounds: int) -> dict[str, tuple[float, float]]:
    """Per probe: the median microseconds as the first call after a bare training step, and as the
    call repeated at once after it."""
    probes = cold_probes(bench)
    first: dict[str, list[float]] = {name: [] for name in probes}
    repeated: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(rounds):
        for name, probe in probes.items():
            bench.train(Bare(), 1, marked=False)
            _synchronize(bench.device)
            for times in (first[name], repeated[name]):
                start = time.perf_counter()
                probe()
                times.append(time.perf_counter() - start)
    return {name: (statistics.median(first[name]) * 1e6, statistics.median(repeated[name]) * 1e6) for name in probes}


def ops_table(bench: Bench, steps: int) -> dict[str, float]:
    """Per aten op, how many more times a captured step calls it from Python than a bare one (torch.profiler's
    counts over `steps` steps of each after one warm-up step; gpuprof's periodic work, every layer_interval or
    state_interval steps, averaged in)."""

    def counts(prof) -> collections.Counter:
        bench.train(prof, 1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as recorded:
            bench.train(prof, steps)
        return collections.Counter(event.name for event in recorded.events()
                                   if event.name.startswith("aten::") and not _inside_an_op(event))

    bare = counts(Bare())
    with bench.open_run({}) as prof:
        captured = counts(prof)
    return {name: (captured[name] - bare[name]) / steps for name in captured | bare if captured[name] != bare[name]}


def _inside_an_op(event) -> bool:
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith("aten::"):
        parent = parent.cpu_parent
    return parent is not None


def stacks_costs(bench: Bench, pairs: int, interval_s: float) -> tuple[Pairs, dict[str, float], int, float]:
    """Interleaved pairs captured with every default, stack samples off (as `bare`) and on; the median
    microseconds of one sample on the training thread (where it is taken), in wall and in that thread's CPU
    time ("wall", "thread"), over every sample of the `on` blocks; and the seconds between two samples there
    (the sampler waits longer after a sample that cost more than its budget)."""
    result = Pairs(bench.device)
    samples_us: dict[str, list[float]] = {"wall": [], "thread": []}
    original = StackSampler._take

    def timed_take(sampler):
        start = {clock: CLOCKS[clock]() for clock in samples_us}
        original(sampler)
        for clock, times in samples_us.items():
            times.append((CLOCKS[clock]() - start[clock]) * 1e6)

    StackSampler._take = timed_take
    sampled_s = 0.0
    try:
        for rep in range(pairs):
            for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                started_s = time.perf_counter()
                with bench.open_run({"stack_interval_s": 0 if mode == "off" else interval_s}) as prof:
                    (result.bare if mode == "off" else result.capture).append(bench.block(prof))
                if mode == "on":
                    sampled_s += time.perf_counter() - started_s
    finally:
        StackSampler._take = original
    medians = {clock: statistics.median(times) if times else float("nan") for clock, times in samples_us.items()}
    samples = len(samples_us["wall"])
    return result, medians, samples, sampled_s / samples if samples else float("nan")


# ------------------------------------------------------------------ entries alone


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class EmptyEntries(Bare):
    """A profiler entered from the same torch events as gpuprof, doing nothing there (`--components entries`)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self._model, self._optimizer, self._handles = model, optimizer, []
        self._window = _PassThrough()
        self.step = torch._dynamo.disable(_nothing)  # also the model's and optimizer's empty hooks

    def __enter__(self) -> "EmptyEntries":
        nothing, model, optimizer = self.step, self._model, self._optimizer
        self._handles = [model.register_forward_pre_hook(nothing, with_kwargs=True),
                         model.register_forward_hook(torch._dynamo.disable(self._open_window)),
                         optimizer.register_step_pre_hook(torch._dynamo.disable(self._close_window)),
                         optimizer.register_step_post_hook(nothing)]
        queue = torch._dynamo.disable(lambda param: torch.autograd.Variable._execution_engine.queue_callback(_nothing))
        self._handles += [param.register_post_accumulate_grad_hook(queue) for param in list(model.parameters())[:2]]
        self._backward = torch.autograd.backward
        torch.autograd.backward = torch._dynamo.disable(self._backward_wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        torch.autograd.backward = self._backward

    def _open_window(self, module, args, output) -> None:
        self._window.__enter__()

    def _close_window(self, optimizer, args, kwargs) -> None:
        """At the optimizer's step, not as backward() returns as gpuprof's does: this loop calls nothing between."""
        self._window.__exit__(None, None, None)

    def _backward_wrapped(self, tensors, *args, **kwargs):
        return self._backward(tensors, *args, **kwargs)


def _nothing(*args, **kwargs) -> None:
    return None


# ------------------------------------------------------------------ report


def describe(args, bench: Bench) -> str:
    return (f"{args.model} GPT-2 on {bench.device.type} ({args.dtype}, {args.batch}x{args.seq} tokens/step, "
            f"{torch.get_num_threads()} torch threads, {'phases marked' if args.phases else 'plain loop'}, "
            f"loss {'outside the model' if args.loss == 'outside' else 'from labels='}, "
            f"{'no clipping' if args.no_clip else 'clip_grad_norm_'})")


def print_headline(args, bench: Bench, pairs: Pairs) -> None:
    low, high = pairs.spread()
    print(f"\n{describe(args, bench)}, all defaults of gpuprof.profile, {args.pairs} interleaved pairs of "
          f"{args.steps} steps:")
    print(f"  wall time:  bare {pairs.step_s('bare') * 1e3:.2f} ms/step, captured {pairs.step_s('capture') * 1e3:.2f} "
          f"ms/step; ratio x{pairs.median_ratio():.4f} median, p10-p90 x{low:.4f}-x{high:.4f}; "
          f"+{pairs.added_us_per_step():.0f} us/step median")
    for clock, label in (("cpu", "process CPU time (all threads)"), ("thread", "training thread's CPU time")):
        low, high = pairs.spread(clock)
        print(f"  {label}: bare {pairs.step_s('bare', clock) * 1e3:.2f} ms/step, captured "
              f"{pairs.step_s('capture', clock) * 1e3:.2f} ms/step; ratio x{pairs.median_ratio(clock):.4f} median, "
              f"p10-p90 x{low:.4f}-x{high:.4f}; {pairs.added_us_per_step(clock):+.0f} us/step median")
    print(f"  opening + closing a run (not in the steps): {statistics.median(pairs.open_close_s) * 1e3:.0f} ms")
    memory = pairs.memory_added()
    print(f"  memory added ({memory['memory_measured']}, captured minus bare, median): "
          f"{memory['peak_memory_added_bytes'] / 2**20:+.1f} MiB, {memory['peak_memory_added_pct']:+.3f}% of "
          f"{memory['memory_total_bytes'] / 2**30:.1f} GiB")


def print_cold_table(rows: dict[str, tuple[float, float]], rounds: int) -> None:
    print(f"\nfirst call after a training step against the call repeated at once (median of {rounds}, us):")
    for name, (first_us, repeated_us) in rows.items():
        print(f"  {name:<40} {first_us:8.1f} {repeated_us:8.1f}   x{first_us / repeated_us:.1f}")


def print_ops_table(added: dict[str, float], steps: int) -> None:
    print(f"\naten ops a captured step calls beyond a bare one (per step, over {steps} steps of each): "
          f"{sum(added.values()):+.1f} in all")
    for name, count in sorted(added.items(), key=lambda item: -abs(item[1])):
        print(f"  {name:<40} {count:+7.2f}")


def print_hook_table(parts: dict[str, float], step_s: float, clock: str) -> None:
    what = "wall time" if clock == "wall" else "each thread's CPU time"
    print(f"\nper-hook timer, self time in us per step on {what} (one captured block, {step_s * 1e3:.2f} ms/step "
          f"{'of wall time' if clock == 'wall' else 'of CPU on the training thread'}):")
    main = {name: us for name, us in parts.items() if not name.endswith("(own thread)")}
    for name, us in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"  {name:<40} {us:9.1f}  {us / (step_s * 1e6) * 100:6.2f}% of a step")
    print(f"  {'total on the training thread':<40} {sum(main.values()):9.1f}  "
          f"{sum(main.values()) / (step_s * 1e6) * 100:6.2f}% of a step")


def print_switch_table(results: dict[str, Pairs], patched_out: dict[str, Pairs]) -> None:
    print("\nparts switched on one at a time (wall time, interleaved pairs against bare, us per step):")
    previous = 0.0
    for label, pairs in results.items():
        added = pairs.added_us_per_step()
        print(f"  {label:<40} +{added:8.0f} total, {added - previous:+8.0f} for this part; "
              f"ratio x{pairs.median_ratio():.4f}")
        previous = added
    for label, pairs in patched_out.items():
        added = pairs.added_us_per_step()
        print(f"  all defaults but the {label}: +{added:.0f} total, so it costs {previous - added:.0f}; "
              f"ratio x{pairs.median_ratio():.4f}")


def print_entries_table(entries: Pairs, headline: Pairs) -> None:
    print(f"\nempty hooks at gpuprof's entry points against bare ({len(entries.bare)} interleaved pairs), "
          f"beside all defaults (the headline's pairs), added us per step, median:")
    for clock, label in (("wall", "wall time"), ("cpu", "process CPU time"), ("thread", "training thread's CPU time")):
        print(f"  {label:<28} entries alone {entries.added_us_per_step(clock):+7.0f} "
              f"(x{entries.median_ratio(clock):.4f}); all defaults {headline.added_us_per_step(clock):+7.0f} "
              f"(x{headline.median_ratio(clock):.4f})")


def print_stacks_table(pairs: Pairs, sample_us: dict[str, float], samples: int, between_s: float,
                       interval_s: float) -> None:
    low, high = pairs.spread()
    step_s = pairs.step_s("bare")
    per_step_us = sample_us["wall"] * step_s / between_s
    print(f"\nstack sampler every {interval_s:g} s ({len(pairs.bare)} interleaved pairs, every other default on):")
    print(f"  wall time: off {step_s * 1e3:.2f} ms/step, on {pairs.step_s('capture') * 1e3:.2f} ms/step; "
          f"ratio x{pairs.median_ratio():.4f} median, p10-p90 x{low:.4f}-x{high:.4f}; "
          f"{pairs.added_us_per_step():+.0f} us/step median; process CPU {pairs.added_us_per_step('cpu'):+.0f} us/step")
    print(f"  samples taken one every {between_s:.3f} s (the sampler waits longer after a sample over its budget)")
    print(f"  one sample: {sample_us['wall']:.1f} us on the training thread (median of {samples}); at this rate "
          f"{per_step_us:.1f} us per {step_s * 1e3:.2f} ms step = {100 * per_step_us / (step_s * 1e6):.3f} % of a step")
    print(f"  one sample's CPU time on the training thread: {sample_us['thread']:.1f} us; at this rate "
          f"{100 * sample_us['thread'] * 1e-6 / between_s:.3f} % of a core")


@contextlib.contextmanager
def no_op(owner: type, attribute: str):
    original = owner.__dict__[attribute]
    setattr(owner, attribute, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        setattr(owner, attribute, original)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per block")
    parser.add_argument("--pairs", type=int, default=15, help="bare/captured block pairs")
    parser.add_argument("--phases", action="store_true", help="mark data/forward/backward/optimizer with prof.phase")
    parser.add_argument("--loss", choices=("labels", "outside"), default="labels",
                        help="the model computes the loss from labels=, or the loop does from the logits")
    parser.add_argument("--no-clip", action="store_true",
                        help="the loop does not clip: gpuprof computes the gradient norm itself")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--components", nargs="*", default=(),
                        choices=("timer", "switch", "cold", "ops", "entries", "stacks"),
                        help="add the per-part table(s) in us per step")
    parser.add_argument("--timer-steps", type=int, default=100, help="captured steps under the hook timer")
    parser.add_argument("--timer-clock", choices=("wall", "thread"), default="wall",
                        help="the hook timer's clock: wall time, or each thread's CPU time (holds on a loaded machine)")
    parser.add_argument("--switch-pairs", type=int, default=10, help="pairs per configuration for `switch`")
    parser.add_argument("--cold-rounds", type=int, default=30, help="training steps per probe for `cold`")
    parser.add_argument("--ops-steps", type=int, default=20, help="steps of each, bare and captured, for `ops`")
    parser.add_argument("--stacks-pairs", type=int, default=15, help="off/on pairs for `stacks`")
    parser.add_argument("--stack-interval-s", type=float, default=STACK_INTERVAL_S,
                        help="the stack sampler's period for `stacks`")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()

    print(f"load average before: {' '.join(f'{load:.2f}' for load in os.getloadavg())} ({os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(args, Path(tmp))
        headline = bench.pairs({}, args.pairs, "all defaults", verbose=True)
        if "timer" in args.components:
            parts, step_s = hook_table(bench, args.timer_steps, args.timer_clock)
        if "switch" in args.components:
            switched = {label: bench.pairs(options, args.switch_pairs, label)
                        for label, options in CONFIGURATIONS.items()}
            patched_out = {}
            for label, (owner, attribute) in PATCHED_OUT.items():
                with no_op(owner, attribute):
                    patched_out[label] = bench.pairs({}, args.switch_pairs, label)
        if "cold" in args.components:
            cold = cold_table(bench, args.cold_rounds)
        if "ops" in args.components:
            ops = ops_table(bench, args.ops_steps)
        if "entries" in args.components:
            entries = collect_pairs(args.pairs, bench.block,
                                    lambda rep: EmptyEntries(bench.model, bench.optimizer), bench.device)
        if "stacks" in args.components:
            stacks = stacks_costs(bench, args.stacks_pairs, args.stack_interval_s)
    print_headline(args, bench, headline)
    if "timer" in args.components:
        print_hook_table(parts, step_s, args.timer_clock)
    if "switch" in args.components:
        print_switch_table(switched, patched_out)
    if "cold" in args.components:
        print_cold_table(cold, args.cold_rounds)
    if "ops" in args.components:
        print_ops_table(ops, args.ops_steps)
    if "entries" in args.components:
        print_entries_table(entries, headline)
    if "stacks" in args.components:
        print_stacks_table(*stacks, args.stack_interval_s)
    print(f"load average after: {' '.join(f'{load:.2f}' for load in os.getloadavg())}")


if __name__ == "__main__":
    main()
