"""Fixtures for the trace analyzer tests: synthetic Chrome traces built in the test,
the shared real traces (skipped when absent), and a real CPU torch.profiler trace."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

# Beside the checkout (/work/main -> /work/shared/traces), or where GPUPROF_SHARED_TRACES says (a worktree).
SHARED_TRACES = Path(os.environ.get("GPUPROF_SHARED_TRACES") or Path(__file__).resolve().parents[2].parent / "shared" / "traces")


@pytest.fixture
def shared_traces() -> Path:
    if not (SHARED_TRACES / "README.md").is_file():
        pytest.skip(f"shared traces not found at {SHARED_TRACES}")
    return SHARED_TRACES


class TraceBuilder:
    """Builds Kineto-style events: host ops, runtime launch calls and the device work they launch."""

    def __init__(self):
        self.events: list[dict] = []
        self._correlation = 0

    def host(self, name, ts, dur, cat="cpu_op", tid=1, **args):
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, "args": args})
        return self

    def step(self, number, ts, dur):
        return self.host(f"ProfilerStep#{number}", ts, dur, cat="user_annotation")

    def memory(self, ts, nbytes, tid=1):
        """A profile_memory=True allocator event on the CPU: an allocation of `nbytes`, a free when negative."""
        self.events.append({"ph": "i", "s": "t", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": tid,
                            "ts": ts, "args": {"Bytes": nbytes, "Device Type": 0, "Device Id": -1}})
        return self

    def launch(self, name, ts, dur, launch_ts=None, launch_dur=1, stream=7, cat="kernel", call="cudaLaunchKernel", tid=1):
        """A device event on `stream` and the runtime call that launched it."""
        self._correlation += 1
        launch_ts = ts - 5 if launch_ts is None else launch_ts
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": call, "pid": 1, "tid": tid, "ts": launch_ts,
                            "dur": launch_dur, "args": {"correlation": self._correlation}})
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                            "args": {"correlation": self._correlation, "stream": stream, "device": 0}})
        return self

    def document(self, rank=None, world_size=None) -> dict:
        doc = {"schemaVersion": 1, "traceEvents": list(self.events)}
        if rank is not None:
            doc["distributedInfo"] = {"rank": rank, "world_size": world_size or rank + 1, "backend": "nccl"}
        return doc

    def write(self, path: Path, rank=None, world_size=None) -> Path:
        data = json.dumps(self.document(rank, world_size)).encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
        return path


@pytest.fixture
def builder() -> TraceBuilder:
    return TraceBuilder()


@pytest.fixture(scope="session")
def cpu_profiler_trace(tmp_path_factory) -> Path:
    """A real torch.profiler trace of a tiny CPU model, four scheduled steps."""
    import torch
    from views_model import train

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randn(64, 1)), batch_size=8)
    path = tmp_path_factory.mktemp("profiler") / "rank-0.pt.trace.json"
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=4, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=lambda prof: prof.export_chrome_trace(str(path))) as prof:
        train(model, optimizer, data, prof)
    return path

