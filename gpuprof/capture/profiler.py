"""The Profiler: instruments a training loop and writes a run directory.

    with gpuprof.profile("runs/exp1", model=model, optimizer=optimizer, loader=loader) as prof:
        for batch in loader:
            loss = model(**batch).loss
            ...
            prof.step(loss=loss, tokens=batch_tokens)

Every part of capture is a collector (gpuprof.capture.collector); the Profiler owns the
step boundaries, the clock, the run writer, and the queue of step records whose device
values are fetched a few steps later without a host-device synchronization. Phases come
from hooks (gpuprof.capture.phases) and from prof.phase(), which wins per step and name.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from typing import Any, Iterable, Mapping, Sequence

import torch

from gpuprof.capture import environment, oom
from gpuprof.capture.backward import BackwardWatcher
from gpuprof.capture.builtin import builtin_collectors
from gpuprof.capture.collector import CollectorSet, StepState
from gpuprof.capture.losses import BackwardLosses, one_loss
from gpuprof.capture.modelinfo import ModelInfo
from gpuprof.capture.options import CaptureOptions
from gpuprof.capture.pending import PendingRecord, all_finite
from gpuprof.capture.phases import PhaseHooks
from gpuprof.capture.stack_sampler import STACK_INTERVAL_S
from gpuprof.capture.system import AUTO_INTERVAL
from gpuprof.capture.timing import HostClock, PhaseTimes, clock_for
from gpuprof.capture.trace import own_work
from gpuprof.capture.usercode import raised_at
from gpuprof.capture.watchdog import check_timeout
from gpuprof.errors import GpuprofError
from gpuprof.modules import initialized
from gpuprof.numerics.blame import NOT_REPRODUCED, Blame
from gpuprof.numerics.options import NumericsOptions, check_policy
from gpuprof.optimizers import one_optimizer
from gpuprof.run import schema
from gpuprof.run.writer import RunWriter

logger = logging.getLogger("gpuprof")

TRACEBACK_CHARS = 20_000  # the end of a failure's traceback kept in its event
SIGTERM_WRITE_S = 5.0  # what a rank stopped by SIGTERM spends writing where it was
# what still runs after capture is switched off (see Profiler._switch_off)
STILL_RUNNING = ("the step records (step time, loss, tokens)", "the loss taken at backward()",
                 "the non-finite loss flag and its event")


def profile(run_dir: str | os.PathLike, **options: Any) -> "Profiler":
    """A Profiler writing to `run_dir`; use it as a context manager (see Profiler for the options)."""
    return Profiler(run_dir, **options)


class Profiler:
    """Records one training run into `run_dir`.

    model, optimizer, scaler, lr_scheduler: optional; what needs them is skipped without them. Given the
    model and the optimizer, every step is split into phases by hooks (gpuprof.capture.phases).
    optimizer may be a list of the optimizers the loop steps (e.g. [muon, adamw]; gpuprof.optimizers).
    loader: the training DataLoader, optional; its settings are recorded in meta.json ("loop").
    config: the user's config dict, stored in meta.json.   name: display name (default: folder name).
    trace_steps: optimizer steps to record with torch.profiler (e.g. range(10, 14)); None for none.
    sample_interval_s: background device/host sampling period; "auto" (default): 0.1 s where this rank's GPU
        can be sampled (NVML), 1 s for the host alone; 0 or None turns the sampler off.
    stack_interval_s: the training thread's Python stack is sampled at most this often (seconds, from the
        sampler's thread; gpuprof.capture.stack_sampler) to name the user's functions where time goes; 0 turns it off.
    flops_per_token: training FLOPs per token; derived from a Hugging Face style model when None.
    grad_norms: per-step global grad norm; layer_interval: per-layer norms every N steps (0: never);
    update_ratio_interval: per-layer update-to-weight ratios every N steps (0: never).
    record_shapes, profile_memory, with_stack: passed to torch.profiler for trace windows.
    memory_history: record allocation stacks for the out-of-memory snapshot (CUDA; costs per allocation).
    collectors: extra collectors (see gpuprof.capture.collector).
    hang_timeout_s: seconds without a step before the hang watchdog writes a `hang` event (with every rank's
        stacks under torchrun; gpuprof.capture.watchdog); None (default): max(120 s, 20 median steps); 0: off.
    live_export: a folder to stream each step's figures to for TensorBoard while the loop trains (one run per
        rank, the tags of `gpuprof export`; gpuprof.capture.live_export); None (default): off.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scaler: Any = None,
        loader: Any = None,
        config: Mapping[str, Any] | None = None,
        name: str | None = None,
        trace_steps: Iterable[int] | None = None,
        sample_interval_s: float | str | None = "auto",
        stack_interval_s: float | None = STACK_INTERVAL_S,
        flops_per_token: float | None = None,
        lr_scheduler: Any = None,
        grad_norms: bool = True,
        layer_interval: int = 10,
        update_ratio_interval: int = 100,
        collectors: Iterable[Any] = (),
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        memory_history: bool = False,
        loss_fn: Any = None,
        on_nonfinite: str = "record",
        numerics: Mapping[str, Any] | NumericsOptions | bool = True,
        hang_timeout_s: float | None = None,
        live_export: str | os.PathLike | None = None,
    ):
        self.run_dir = os.fspath(run_dir)
        # a model that is not a Module (a plain function) is reported once by PhaseHooks, then ignored
        hookable_model = model if isinstance(model, torch.nn.Module) else None
        optimizer = one_optimizer(optimizer)
        self.model, self.optimizer, self.scaler, self.lr_scheduler = hookable_model, optimizer, scaler, lr_scheduler
        self.loader = loader
        self.config = dict(config or {})
        self.name = name or os.path.basename(os.path.abspath(self.run_dir))
        self.options = CaptureOptions(
            trace_steps=tuple(sorted(set(trace_steps))) if trace_steps is not None else (),
            sample_interval_s=_sample_interval(sample_interval_s), stack_interval_s=_stack_interval(stack_interval_s),
            grad_norms=grad_norms, layer_interval=layer_interval,
            update_ratio_interval=update_ratio_interval, record_shapes=record_shapes, profile_memory=profile_memory,
            with_stack=with_stack, memory_history=memory_history, numerics=NumericsOptions.given(numerics),
            on_nonfinite=check_policy(on_nonfinite), hang_timeout_s=check_timeout(hang_timeout_s),
            live_export=os.fspath(live_export) if live_export is not None else None,
        )
        self.loss_fn = loss_fn  # (model, batch) -> loss, for NaN forensics (gpuprof.numerics)
        self.ranks = environment.rank_info()
        self._grouped = False  # sticky: see _joined_group
        self.device = environment.resolve_device(self.model)
        self.clock = clock_for(self.device)
        self.model_info = ModelInfo(self.model, flops_per_token, self.config)
        self.phase_hooks = PhaseHooks(model, optimizer, self.clock)
        self.collectors = CollectorSet(self._collector_failed)
        self._extra_collectors = list(collectors)
        self.writer: RunWriter | None = None
        self.run_id = uuid.uuid4().hex
        self.step_index = 0
        self._pending: deque[tuple[PendingRecord, list]] = deque()
        self._started = self._closed = False
        self._broken = False
        self._bare = False  # broken, and still writing the bare step records (see _switch_off)
        self._bare_nonfinite_said = False
        self._broken_at, self._broken_by = None, ""  # the step and the error that switched capture off
        self._facts: dict[str, Any] = {}  # the collectors' run-level facts for meta.json, as last told
        self._backward = BackwardWatcher(self.model, self._after_backward) if self.model is not None else None
        self._losses = BackwardLosses()  # the step's loss when prof.step() is given none (gpuprof.capture.losses)
        self._joiners: list = []  # collectors with a per-step collective every rank must make
        self._start_unix_s = None
        self.final_status: str | None = None  # set by close(), before the collectors close
        self._step_phases: PhaseTimes | None = None
        self._sigterm_handler = None
        self.bookkeeping = False  # inside gpuprof's own step-end work, which is no step's time

    # ----------------------------------------------------------------- lifecycle
    def __enter__(self) -> "Profiler":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self.handle_exception(exc)
        self.close(error=exc)

    def start(self) -> "Profiler":
        """Starts recording. Never raises into the loop: what fails here switches capture off (an event, or where
        the run directory cannot be created, one warning line on stderr, says so)."""
        if self._started:
            return self
        self._started = True
        self._start_unix_s = time.time()
        self._guarded(self._start_recording)
        return self

    def _start_recording(self) -> None:
        self._open()
        if not self._active:
            return
        self.collectors.call("on_start", self)
        self._losses.listen()
        if self._backward is not None:
            self._backward.attach()
        self._write_meta("running")
        self._begin_step()
        self._record_termination()
        self._bare = True  # from here on a break leaves the bare step records running

    def _open(self) -> None:
        """The run directory, then the collectors. Without a directory capture is off, but the collectors with a
        per-step collective still make it (see _join_step_collectives), as on the ranks that have one."""
        try:
            self.writer = RunWriter(self.run_dir, self.ranks.rank)
        except OSError as error:
            logger.warning("gpuprof: cannot create run directory %s (%s): nothing of this run is recorded",
                           self.run_dir, error)
        for collector in [*builtin_collectors(self), *self._extra_collectors]:
            self.collectors.add(collector)
        self._joiners = [c for c in self.collectors if getattr(c, "has_step_collectives", False)]
        if self.writer is None:
            self._switch_off()

    def close(self, status: str | None = None, error: BaseException | None = None) -> None:
        """Writes everything and the rank's status: `finished`, or `failed` when an exception is leaving
        the loop (`error`, or the one in flight when close() runs in a `finally`), which becomes a
        `rank_failed` event with its traceback. Never raises into the loop."""
        if not self._started or self._closed:
            return
        self._closed = True
        error = error if error is not None else sys.exc_info()[1]
        if isinstance(error, SystemExit) and error.code in (0, None):
            error = None
        self.final_status = status or ("failed" if error is not None else "finished")
        if error is not None and self.final_status == "failed":
            self._record_failure(f"{type(error).__name__}: {error}",
                                 "".join(traceback.format_exception(type(error), error, error.__traceback__)),
                                 raised_at(error))
        self._guarded(self._drain, True)
        self._guarded(self._losses.stop)
        if self._backward is not None:
            self._guarded(self._backward.detach)
        self.collectors.close_all(self)
        if self.writer is not None:
            self._guarded(self._write_meta, self.final_status, time.time())
            self._guarded(self.writer.close)
        if self._sigterm_handler is not None and signal.getsignal(signal.SIGTERM) is self._sigterm_handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def current_phase(self) -> str | None:
        """The phase this rank is in now: a prof.phase() span begun and not ended, else the hooks'."""
        phases = self._step_phases
        if not self._active or phases is None:  # before the first step began
            return None
        return phases.open_phase() or self.phase_hooks.current

    def _record_failure(self, error: str, traceback_text: str, raised_from: str | None = None) -> None:
        """A `rank_failed` event; `raised_from`: the loop's own line an exception came from (none for a signal)."""
        with contextlib.suppress(Exception):
            self.event(schema.EventKind.RANK_FAILED, f"rank {self.ranks.rank} failed at step {self.step_index}: {error}",
                       severity="critical", step=self.step_index, error=error,
                       traceback=traceback_text[-TRACEBACK_CHARS:], raised_at=raised_from)

    def _record_termination(self) -> None:
        """On SIGTERM (torchrun stopping the other ranks when one failed) the rank still says where it
        was and that it failed, before the default action ends it; only where the loop set no handler."""
        if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
            return

        def terminated(signum, frame) -> None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else ""

            def record() -> None:  # on a thread: the signal may have come while the loop held a writer lock
                self._record_failure(schema.TERMINATED_ERROR, stack)
                self.writer.flush()
                self._write_meta("failed", time.time())

            if self._active:
                writer = threading.Thread(target=record, name="gpuprof-sigterm", daemon=True)
                writer.start()
                writer.join(timeout=SIGTERM_WRITE_S)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, terminated)
        self._sigterm_handler = terminated

    def join_at_backward(self, forward_start) -> None:
        """Called right after start() from inside the step's first backward() (gpuprof run finds the
        optimizer there): the step began at `forward_start`, a stamp of this Profiler's clock taken at
        the step's first forward, which no hook of this Profiler saw."""
        if self._active:
            self._step_start = forward_start
            self._guarded(self.phase_hooks.join_at_backward, forward_start)
            self.collectors.call("on_join_at_backward", self, self.step_index)

    # --------------------------------------------------------------- the loop API
    @contextlib.contextmanager
    def phase(self, name: str):
        """Times a part of the step; repeat it per micro-batch under gradient accumulation."""
        self.begin_phase(name)
        try:
            yield
        except BaseException as exc:
            self.handle_exception(exc)
            raise
        finally:
            self.end_phase(name)

    def begin_phase(self, name: str) -> None:
        if self._active:
            self._guarded(self._step_phases.begin, name)
            self.collectors.call("on_phase_begin", self, name)

    def end_phase(self, name: str) -> None:
        if self._active:
            self.collectors.call("on_phase_end", self, name)
            self._guarded(self._step_phases.end, name)

    def step(self, loss: torch.Tensor | float | None = None, tokens: torch.Tensor | int | None = None,
             batch: Any = None) -> None:
        """Marks the end of one optimizer step (call it once per step, skipped or not).

        loss: the step's loss; by default the sum of the tensors backward() was called on since the
        last step (gpuprof.capture.losses), so a loop need not pass it.

        batch: the step's batch (a list of them under gradient accumulation), kept by reference
        so that NaN forensics can re-run the step with `loss_fn` (docs/numerics.md).
        """
        if self._active or self._recording_bare:
            self.bookkeeping = True
            step = self.step_index
            with own_work():
                self._guarded(self._end_step, loss, tokens, batch)
            if self.step_index == step:  # its record failed: the counter still moves on, for the bare step records
                self.step_index += 1  # (see _switch_off); the collectors, switched off, are not told (a per-step
                self._begin_step(tell_collectors=False)  # collective is made once)
            self.bookkeeping = False
        if self._joiners and not self._closed:
            self._join_step_collectives()
        if self._active:
            for collector, error in self.collectors.stop_requests():  # raised on purpose, e.g. on_nonfinite="raise"
                collector.stop_training = None
                raise error

    def _join_step_collectives(self) -> None:
        """A collector with a per-step collective (sharded gradient norms) that is switched off on this
        rank, or the whole Profiler, still makes it, or the other ranks would wait for this one forever."""
        enabled = set(map(id, self.collectors))
        for collector in self._joiners:
            if self._broken or id(collector) not in enabled:
                with contextlib.suppress(Exception):
                    collector.join_step_collectives(self)

    def event(self, kind: str, message: str, *, severity: str = "info", step: int | None = None, **details: Any) -> None:
        """Records a discrete event (see docs/capture.md for the kinds gpuprof itself writes)."""
        if self.writer is None:
            return
        record = {
            "time_unix_s": time.time(), "rank": self.ranks.rank, "step": step, "kind": kind,
            "severity": severity if severity in schema.SEVERITIES else "info", "message": message,
            "details": details,
        }
        self.writer.write("events", [record])

    def memory_snapshot(self) -> "os.PathLike | None":
        """Writes a CUDA memory snapshot of this moment to `snapshots/` (shown on the dashboard's Memory
        page) and returns its path; without CUDA it records nothing and says so once. Never raises."""
        return oom.memory_snapshot(self)

    def add_collector(self, collector: Any) -> None:
        """Plugs in a collector; one added after start() gets on_start immediately."""
        self._extra_collectors.append(collector)
        if self._active:
            self.collectors.add(collector)
            self.collectors.call_one(collector, "on_start", self)

    def handle_exception(self, exc: BaseException) -> None:
        """Lets collectors react to an exception leaving the loop (e.g. out of memory); never raises."""
        if self._started and not getattr(exc, "_gpuprof_seen", False):
            with contextlib.suppress(Exception):
                exc._gpuprof_seen = True
            self.collectors.call("on_exception", self, exc)

    @property
    def _active(self) -> bool:
        return self._started and not self._closed and not self._broken

    @property
    def _recording_bare(self) -> bool:
        return self._broken and self._bare and not self._closed

    # ------------------------------------------------------------------ internals
    def _begin_step(self, tell_collectors: bool = True) -> None:
        """A step starts when gpuprof's own work in prof.step() is done: that work is not the loop's time."""
        self._step_start = self.clock.stamp()
        self._step_phases = PhaseTimes(self.clock)
        if tell_collectors:
            self.collectors.call("on_step_start", self, self.step_index)

    def _after_backward(self) -> None:
        if self._active:
            self.collectors.call("on_after_backward", self, self.step_index)

    def _end_step(self, loss, tokens, batch=None) -> None:
        end = self.clock.stamp()
        self._joined_group()
        own_work_started = time.perf_counter()
        own_work_s: list[float] = []
        automatic = self.collectors.call_one(self.phase_hooks, "finish_step")
        if self._backward is not None and not self._broken and self.phase_hooks.backward_unfinished:
            self._backward.attach()  # the parameters it kept watching were not reached this step
        backward_loss = self._losses.take(loss)
        given = loss is not None
        loss = loss if given else backward_loss
        state = StepState(step=self.step_index, loss=one_loss(loss), tokens=tokens, batch=batch,
                          backward_loss=one_loss(backward_loss) if given else None)
        fields = {
            "step": self.step_index, "rank": self.ranks.rank, "time_unix_s": time.time(),
            "loss": state.loss, "tokens": tokens,
            "_timing": _timing(self.clock, self._step_start, end, self._step_phases, automatic),
            "capture_time_s": lambda: own_work_s[0],
        }
        for extra in self.collectors.call("on_step_end", self, state):
            if extra:
                fields.update(extra)
        if "micro_batches" not in fields:  # the gradient collector counts backward passes where it runs
            fields["micro_batches"] = _micro_batches(self._step_phases) or _micro_batches(automatic)
        self._pending.append((PendingRecord(fields), self._stamps_to_wait_for(end, automatic)))
        own_work_s.append(time.perf_counter() - own_work_started)
        self._drain(False)
        self.step_index += 1
        self._begin_step()

    def _drain(self, final: bool) -> None:
        """Reads the records that are ready: values resolved, collectors' on_step_record, one write."""
        if final and self.device.type == "cuda" and self._pending:
            torch.cuda.synchronize(self.device)  # once, at close
        written = []
        while self._pending and self._ready(*self._pending[0]):
            record = self._pending.popleft()[0].resolve()
            self._complete(record)
            if self._broken:
                self._flag_nonfinite_loss(record)
            with self._losses.paused():  # the forensic re-run of a bad step runs its own backward
                self.collectors.call("on_step_record", self, record)
            written.append({k: v for k, v in record.items() if not k.startswith("_")})
        if written:
            self.writer.write("steps", written)

    def _stamps_to_wait_for(self, end, automatic: PhaseTimes | None) -> list:
        """Phases may run on other streams: a record waits for every stamp, not only its own copy.
        Host clock stamps are done when taken."""
        if self.clock.kind == HostClock.kind:
            return []
        return [end, *self._step_phases.stamps(), *(automatic.stamps() if automatic else ())]

    def _ready(self, pending: PendingRecord, stamps: list) -> bool:
        return pending.ready() and all(map(self.clock.done, stamps))

    def _complete(self, record: dict[str, Any]) -> None:
        """Adds the derived columns: phase times, throughput, FLOP/s and MFU."""
        timing = record.pop("_timing")
        record.update(timing)
        step_time_s, tokens = record["step_time_s"], record.get("tokens")
        flops_per_token, peak = self.model_info.flops_per_token, self.model_info.peak_flops_per_s
        usable = tokens is not None and step_time_s and step_time_s > 0
        record["tokens_per_s"] = tokens / step_time_s if usable else None
        record["flops_per_s"] = record["tokens_per_s"] * flops_per_token if usable and flops_per_token else None
        record["mfu"] = record["flops_per_s"] / peak if record["flops_per_s"] and peak else None
        record["loss_finite"] = all_finite(record["loss"])  # on the host: no device op per step

    def _write_meta(self, status: str, end_unix_s: float | None = None) -> None:
        meta = self._meta(status, end_unix_s)
        if self.ranks.rank == 0:
            self.writer.write_run_meta(meta)
        self.writer.write_rank_meta({
            "rank": self.ranks.rank, "local_rank": self.ranks.local_rank, "world_size": self.ranks.world_size,
            "run_id": self.run_id, "status": meta["status"], "start_unix_s": meta["start_unix_s"],
            "end_unix_s": meta["end_unix_s"], "device": meta["devices"][0], "clock": self.clock.kind,
            **environment.host_facts(),
        })

    def _joined_group(self) -> bool:
        """Whether the ranks joined a process group by now (asked at each meta write and step end): a loop may start
        the Profiler before init_process_group, and destroy the group before it closes."""
        self._grouped = self._grouped or initialized()
        return self._grouped

    def rewrite_meta(self) -> None:
        """Collectors call this when they learn run-level facts after start (e.g. sequence length)."""
        self._write_meta("running")

    def _meta(self, status: str, end_unix_s: float | None = None) -> dict[str, Any]:
        facts = dict(self._facts)  # a broken Profiler's collectors are gone: what they said stands
        for part in self.collectors.call("meta", self):
            facts.update(part or {})
        self._facts = dict(facts)
        return {
            "format": schema.FORMAT, "format_version": schema.FORMAT_VERSION,
            "run_id": self.run_id, "name": self.name, "status": status,
            "start_unix_s": self._start_unix_s, "end_unix_s": end_unix_s,
            "world_size": self.ranks.world_size, "process_group": self._joined_group(),
            "versions": environment.versions(facts.pop("driver", None)),
            "devices": [environment.device_facts(self.device)],
            "model": self.model_info.facts(), "config": self.config,
            "compute_dtype": self.model_info.dtype,
            "peak_flops_per_s": self.model_info.peak_flops_per_s,
            "options": self.options.for_meta(), "clock": self.clock.kind, **facts,
        }

    def _guarded(self, function, *args) -> None:
        """Runs profiler-internal work; the first failure switches the whole profiler off, but for the bare step
        records, which a second failure stops too."""
        try:
            function(*args)
        except Exception as error:  # noqa: BLE001 - gpuprof must never stop the training loop
            if self._recording_bare:
                self._stop_bare_records(error)
            elif self._broken:  # what fails after the first failure (closing) follows from it: said already
                logger.debug("gpuprof: after capture was switched off: %r", error, exc_info=True)
            else:
                logger.warning("gpuprof: internal error, capture switched off for this run: %r", error, exc_info=True)
                self._say_switched_off(error, self._switch_off())

    def _switch_off(self) -> list[str]:
        """Broken: every hook gpuprof put on the model, the optimizer, autograd and torch comes off now, but for the
        loss taken at backward(): each step still writes its record and a non-finite loss is still an event
        (STILL_RUNNING), so that a detection is never lost. Returns the names of the collectors switched off."""
        if self._broken:
            return []
        self._broken = True
        switched_off = [getattr(collector, "name", type(collector).__name__) for collector in self.collectors]
        with contextlib.suppress(Exception):
            if not self._bare:
                self._losses.stop()
            if self._backward is not None:
                self._backward.detach()
            self.collectors.stop_all(self)
        return switched_off

    def _say_switched_off(self, error: BaseException, switched_off: list[str]) -> None:
        still_running = list(STILL_RUNNING) if self._bare else []
        message = (f"capture switched off: {error!r}; off: {', '.join(switched_off) or 'nothing started'}"
                   f"; still running: {', '.join(still_running) or 'nothing'}")
        with contextlib.suppress(Exception):
            self.event(schema.EventKind.PROFILER_DISABLED, message, severity="warning", step=self.step_index,
                       error=repr(error), switched_off=switched_off, still_running=still_running)
        self._broken_at, self._broken_by = self.step_index, repr(error)

    def _stop_bare_records(self, error: BaseException) -> None:
        """The bare step records failed too: nothing of gpuprof runs in the loop from now on."""
        logger.warning("gpuprof: the step records kept after capture was switched off failed too: %r", error)
        self._bare = False
        with contextlib.suppress(Exception):
            self._losses.stop()
        with contextlib.suppress(Exception):
            self.event(schema.EventKind.PROFILER_DISABLED, f"step records switched off too: {error!r}; still running: "
                       "nothing", severity="warning", step=self.step_index, error=repr(error),
                       switched_off=list(STILL_RUNNING), still_running=[])

    def _flag_nonfinite_loss(self, record: dict[str, Any]) -> None:
        """After a break, the first non-finite loss is still a `nonfinite` event: unblamed (no state was kept to
        re-run the step), saying why."""
        if record.get("loss_finite") is not False or self._bare_nonfinite_said or self.options.numerics is None:
            return
        self._bare_nonfinite_said = True
        why = (f"{NOT_REPRODUCED}capture was switched off at step {self._broken_at} ({self._broken_by}); "
               "only the step records and the loss flag still ran, so no state was kept to re-run the step")
        blame = Blame(step=record["step"], rank=self.ranks.rank, trigger="loss", notes=[why])
        details = {key: value for key, value in blame.details().items() if key != "step"}
        self.event(schema.EventKind.NONFINITE, blame.message(), severity="critical", step=record["step"], **details)

    def _collector_failed(self, collector: Any, hook: str, error: BaseException) -> None:
        name = getattr(collector, "name", type(collector).__name__)
        still_running = [getattr(other, "name", type(other).__name__) for other in self.collectors]
        logger.warning("gpuprof: collector %r failed in %s and is switched off: %r", name, hook, error)
        with contextlib.suppress(Exception):
            self.event(schema.EventKind.COLLECTOR_DISABLED, f"collector {name} switched off after {hook} raised "
                       f"{error!r}; still running: {', '.join(still_running)}", severity="warning",
                       step=self.step_index, collector=name, hook=hook, error=repr(error), still_running=still_running)


def _sample_interval(value: Any) -> float | str:
    if value == AUTO_INTERVAL or not value:
        return value or 0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise GpuprofError(f"sample_interval_s must be \"{AUTO_INTERVAL}\", a number of seconds or 0, got {value!r}")
    return float(value)


def _stack_interval(value: Any) -> float:
    if not value:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise GpuprofError(f"stack_interval_s must be a number of seconds or 0, got {value!r}")
    return float(value)


def _micro_batches(phases: PhaseTimes | None) -> int | None:
    return (phases.count("backward") or phases.count("forward") or None) if phases is not None else None


def _timing(clock, start, end, explicit: PhaseTimes, automatic: PhaseTimes | None):
    """A callable giving the step's time columns once `end` has completed on the device.

    Per step, a phase the loop marked with prof.phase() replaces the automatic span of that name."""

    def resolve() -> dict[str, float | None]:
        step_time_s = clock.elapsed_s(start, end)
        totals = {**(automatic.totals_s() if automatic is not None else {}), **explicit.totals_s()}
        columns = {"step_time_s": step_time_s}
        for name in schema.TIMED_PHASES:
            columns[f"{name}_time_s"] = totals.get(name)
        for name, seconds in totals.items():
            columns.setdefault(f"{name}_time_s", seconds)
        columns["other_time_s"] = max(0.0, step_time_s - sum(totals.values()))
        return columns

    return resolve
