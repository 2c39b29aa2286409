"""What the hang watchdog costs: the training thread's share per step, the watchdog thread's per beat,
and the DDP arrival hooks' per backward.

In one process with a 1-rank gloo group (so the collective count and the Flight Recorder are read
as under torchrun), a real gpuprof.profile on a tiny model:
  on_step_start   what the training thread pays per step (a clock reading, a tuple, the group's
                  collective count), timed over many calls
  beat            one heartbeat built on the watchdog thread (the main thread's stack walked, each
                  process group's last enqueued and completed collective read from the Flight
                  Recorder, which holds --collectives entries), timed over many calls; it runs every 5 s
  hang read       the Flight Recorder's entries read, as a hang event does once
  arrival hooks   DDP's backward of one bucket with gpuprof's gradient hooks on that bucket's parameters
                  (a Python call per parameter, a timestamp per bucket) against DDP without them

    .venv/bin/python benchmarks/watchdog_cost.py [--calls 200000] [--beats 200] [--collectives 2000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import gpuprof
from gpuprof.capture import flight
from gpuprof.capture.watchdog import HangWatchdog


def per_call_us(function, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return 1e6 * (time.perf_counter() - start) / calls


def ddp_backward_us(ddp: bool, hooked: bool, repeats: int) -> float:
    """Median time of one backward (one bucket: a small model) of a DDP model, with or without the hooks."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256), bucket_cap_mb=25)
    if hooked:
        from types import SimpleNamespace

        from gpuprof.capture.collector import CollectorSet
        from gpuprof.capture.ddp import DdpCollector

        collector, host = DdpCollector(model), SimpleNamespace(collectors=CollectorSet(print), bookkeeping=False)
        host.collectors.add(collector)
        collector.on_start(host)
    inputs = torch.randn(8, 256)
    times = []
    for _ in range(repeats):
        loss = model(inputs).sum()
        start = time.perf_counter()
        loss.backward()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--beats", type=int, default=200)
    parser.add_argument("--collectives", type=int, default=2000, help="entries in the Flight Recorder")
    parser.add_argument("--repeats", type=int, default=400)
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.Linear(8, 8)
    with tempfile.TemporaryDirectory() as folder, gpuprof.profile(folder, model=model, sample_interval_s=0) as prof:
        for _ in range(args.collectives):
            dist.all_reduce(torch.ones(1))
        watchdog = next(c for c in prof.collectors if isinstance(c, HangWatchdog))
        step_us = per_call_us(lambda: watchdog.on_step_start(prof, prof.step_index), args.calls)
        beat_us = per_call_us(watchdog._beat, args.beats)
        read_us = per_call_us(lambda: flight.read("gloo"), 5)
    bare_us, hooked_us = (ddp_backward_us(True, hooked, args.repeats) for hooked in (False, True))
    dist.destroy_process_group()
    print(f"on_step_start (training thread, per step): {step_us:.2f} us")
    print(f"one heartbeat (watchdog thread, every 5 s), {args.collectives} Flight Recorder entries: {beat_us / 1000:.2f} ms")
    print(f"the Flight Recorder's {args.collectives} entries read (once per hang event): {read_us / 1000:.0f} ms")
    print(f"DDP backward of one bucket, median of {args.repeats}: {bare_us:.0f} us without gpuprof's arrival hooks, "
          f"{hooked_us:.0f} us with it ({hooked_us - bare_us:+.0f} us)")


if __name__ == "__main__":
    main()
