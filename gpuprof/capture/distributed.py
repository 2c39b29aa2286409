"""Distributed facts and DistributedDataParallel's own communication timing.

DDP measures, on a sample of iterations (the first ten, then every hundredth), the
backward compute time, the gradient all-reduce time and their overlap. These averages
are read from DDP's logging data (host-side, no sync) and added to the step record.
"""

from __future__ import annotations

import torch

_DDP_TIMES_NS = {
    "avg_forward_compute_time": "ddp_forward_time_s",
    "avg_backward_compute_time": "ddp_backward_compute_time_s",
    "avg_backward_comm_time": "ddp_backward_comm_time_s",
    "avg_backward_compute_comm_overlap_time": "ddp_comm_overlap_time_s",
}


def distributed_facts() -> dict:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return {}
    return {"backend": str(torch.distributed.get_backend()), "world_size": torch.distributed.get_world_size()}


class DdpCollector:
    name = "ddp"

    def __init__(self, model: torch.nn.parallel.DistributedDataParallel):
        self._model = model

    def meta(self, prof) -> dict:
        return {"distributed": distributed_facts()}

    def on_step_end(self, prof, state) -> dict:
        logging_data = self._model._get_ddp_logging_data()
        return {
            column: logging_data[key] / 1e9 if logging_data.get(key) else None
            for key, column in _DDP_TIMES_NS.items()
        }
