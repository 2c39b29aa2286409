"""DistributedDataParallel's own communication timing, and when each rank reaches its step's collectives.

DDP measures, on a sample of iterations (the first ten, then every hundredth), the backward compute time,
the gradient all-reduce time and their overlap. These averages are read from DDP's logging data (host-side,
no sync) and added to the step record.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from gpuprof import module_hooks
from gpuprof.modules import distributed_facts
from gpuprof.torch_compat import private

# The collectives a loop calls itself, looked up on torch.distributed at each call (Accelerate's gather, broadcast
# and reduce do): wrapped there, each call is an arrival of the step.
LOOP_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
                    "gather_object", "scatter", "all_to_all", "all_to_all_single", "barrier")
MAX_ARRIVALS = 8

_DDP_TIMES_NS = {
    "avg_forward_compute_time": "ddp_forward_time_s",
    "avg_backward_compute_time": "ddp_backward_compute_time_s",
    "avg_backward_comm_time": "ddp_backward_comm_time_s",
    "avg_backward_compute_comm_overlap_time": "ddp_comm_overlap_time_s",
}



class DdpCollector:
    """DDP's timing averages per step, and each step's arrivals at its collectives.

    The arrivals (`collective_arrivals_unix_s`: the first MAX_ARRIVALS of the step, in order) are the wall
    clock each time the step calls a collective on the host: a `torch.distributed` collective of the loop's
    own (a loss all-reduced for logging, `accelerator.gather` before the forward; wrapped while the run
    records), and DDP launching the all-reduce of its first gradient bucket. That launch is observed, not
    made: a hook on the gradient of each parameter of DDP's first bucket (`register_post_accumulate_grad_hook`,
    run just before DDP's own hook for that parameter) notes when the bucket's last one is ready, the moment
    DDP hands the bucket to its reduction. DDP's reduction and its one comm hook stay the loop's, and nothing
    of gpuprof stays on the model after close. Timestamps on the host, no sync. Every rank makes the same
    collectives in the same order, so at each the rank arriving last is the one the others wait for there."""

    name = "ddp"

    def __init__(self, model: torch.nn.parallel.DistributedDataParallel):
        self._model = model
        self.arrivals_unix_s: list[float] = []  # this step's
        self._bucket: list[torch.nn.Parameter] = []  # DDP's first bucket, as DDP last said it is
        self._bucket_layout = None  # what DDP's logging data said it from
        self._rebuilt = False  # ... after DDP rebuilt its buckets
        self._ready: set[int] = set()  # ids of the first bucket's parameters with their gradient this backward
        self._syncing = True  # the last forward prepared DDP's reduction (not under no_sync())
        self._bucket_arrived = False
        self._handles: list = []
        self._forward_hooks: list = []
        self._wrapped: dict[str, Any] = {}
        self._prof = None

    @property
    def arrival_unix_s(self) -> float | None:
        """When this step first reached a collective, read by the hang watchdog."""
        return self.arrivals_unix_s[0] if self.arrivals_unix_s else None

    def on_start(self, prof) -> None:
        self._prof = prof
        self._forward_hooks = [
            prof.collectors.hook(self, self._model, "forward_pre", self._forward_begins),
            module_hooks.register(self._model, "forward", prof.collectors.guard(self, "forward", self._forward_ended))]
        self._watch_first_bucket(self._model._get_ddp_logging_data())
        for name in LOOP_COLLECTIVES:
            original = getattr(torch.distributed, name, None)
            if original is not None:
                self._wrapped[name] = original
                setattr(torch.distributed, name, self._arriving(original))

    def on_close(self, prof) -> None:
        for name, original in self._wrapped.items():
            setattr(torch.distributed, name, original)
        self._wrapped.clear()
        self._unhook_bucket()
        for handle in self._forward_hooks:
            handle.remove()
        self._forward_hooks = []

    def _arriving(self, collective):
        @functools.wraps(collective)
        def arriving(*args, **kwargs):
            # traced by torch.compile, only the collective: dynamo maps it to its functional collective
            if not torch.compiler.is_compiling() and not self._prof.bookkeeping and not _in_backward():
                self._arrive()
            return collective(*args, **kwargs)

        return arriving

    def _arrive(self) -> None:
        if len(self.arrivals_unix_s) < MAX_ARRIVALS:
            self.arrivals_unix_s.append(time.time())

    def meta(self, prof) -> dict:
        return {"distributed": {**distributed_facts(), "arrivals": bool(self._bucket)}}

    def on_step_end(self, prof, state) -> dict:
        logging_data = self._model._get_ddp_logging_data()
        columns = {column: logging_data[key] / 1e9 if logging_data.get(key) else None
                   for key, column in _DDP_TIMES_NS.items()}
        columns["collective_arrivals_unix_s"], self.arrivals_unix_s = self.arrivals_unix_s or None, []
        self._bucket_arrived = False
        self._ready.clear()
        self._watch_first_bucket(logging_data)
        return columns

    def _forward_begins(self, module, args, kwargs) -> None:
        # DDP prepares its reduction in the forward: a backward after a forward under no_sync() reduces nothing
        self._syncing = torch.is_grad_enabled() and self._model.require_backward_grad_sync

    def _forward_ended(self, module, args, output) -> None:
        # DDP rebuilds its buckets in the second iteration's forward, and tells how in its logging data from the
        # third's on: read right after that forward, the third step's arrival is at the rebuilt first bucket already
        if not self._rebuilt and getattr(self._model, "_has_rebuilt_buckets", False):
            self._watch_first_bucket(self._model._get_ddp_logging_data())

    def _watch_first_bucket(self, logging_data: dict) -> None:
        """Hooks the parameters of DDP's first bucket: as built, then as rebuilt after the first iteration
        (in the order gradients became ready)."""
        rebuilt = logging_data.get("rebuilt_per_bucket_param_indices")
        layout = rebuilt or logging_data.get("bucket_sizes")
        if layout == self._bucket_layout:
            return
        self._bucket_layout, self._rebuilt = layout, bool(rebuilt)
        self._unhook_bucket()
        self._ready.clear()
        self._bucket = first_bucket(self._model, logging_data)
        guarded = self._prof.collectors.guard(self, "gradient_ready", self._gradient_ready)
        self._handles = [param.register_post_accumulate_grad_hook(guarded) for param in self._bucket]

    def _unhook_bucket(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _gradient_ready(self, param) -> None:
        if self._bucket_arrived or not self._syncing:
            return
        self._ready.add(id(param))
        if len(self._ready) == len(self._bucket):  # DDP launches the bucket's all-reduce right after this
            self._bucket_arrived = True
            self._ready.clear()
            self._arrive()


def _in_backward() -> bool:
    """On a thread running a backward pass, where DDP calls its comm hook: a collective there is DDP's reduction."""
    return private("torch._C._current_graph_task_id", lambda: -1)() != -1


def reducer_params(model: torch.nn.parallel.DistributedDataParallel) -> list[torch.nn.Parameter]:
    """The parameters DDP's reducer indexes, in its order: those requiring gradients, not ignored, once each."""
    ignored = getattr(model, "parameters_to_ignore", ())
    return [param for name, param in model.module.named_parameters() if param.requires_grad and name not in ignored]


def first_bucket(model: torch.nn.parallel.DistributedDataParallel, logging_data: dict) -> list[torch.nn.Parameter]:
    """The parameters of DDP's first bucket (the first to be reduced), from its logging data: the rebuilt
    buckets' parameter indices, else the built buckets' sizes. DDP builds them from the last parameters (the
    first to get gradients, in the reverse of registration order), one dtype and device to a bucket."""
    params = reducer_params(model)
    rebuilt = logging_data.get("rebuilt_per_bucket_param_indices")
    if rebuilt:
        return [params[int(index)] for index in rebuilt.split(",")[0].split()]
    sizes = str(logging_data.get("bucket_sizes", "")).split(",")
    size = int(sizes[0]) if sizes[0].strip().isdigit() else 0
    bucket, filled = [], 0
    for param in reversed(params):
        if bucket and (filled >= size or (param.dtype, param.device) != (bucket[0].dtype, bucket[0].device)):
            break
        bucket.append(param)
        filled += param.numel() * param.element_size()
    return bucket
