"""CUDA memory snapshots: `prof.memory_snapshot()` where there is no CUDA (a real loop, in its own
process), and the analysis of torch's snapshot format: snapshots torch itself made from a profiled
GPT-2 step, and hand-built ones in the CUDA allocator's format with known answers."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from gpt2_runs import tiny_gpt2, training_step_snapshot

from gpuprof.analysis.memory_snapshot import (
    allocation_timeline, load_snapshot, read_snapshot, top_allocations, top_user_frame,
)
from gpuprof.errors import SnapshotFormatError

LOOP = textwrap.dedent("""
    import sys, torch, gpuprof
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gpuprof.profile(sys.argv[1], model=model, optimizer=optimizer, sample_interval_s=None) as prof:
        for _ in range(5):
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            assert prof.memory_snapshot() is None
            prof.step()
    print("loop done")
""")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the snapshot would be written")
def test_memory_snapshot_without_cuda_records_nothing_and_says_so_once(tmp_path):
    result = subprocess.run([sys.executable, "-c", LOOP, str(tmp_path / "run")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "loop done"
    said = [line for line in result.stderr.splitlines() if "memory_snapshot()" in line]
    assert said == ["gpuprof: memory_snapshot() records nothing: no CUDA device in this run"]
    assert not (tmp_path / "run" / "snapshots").exists()
    import gpuprof

    run = gpuprof.load_run(tmp_path / "run")
    assert len(run.steps) == 5 and run.snapshot_files == []


@pytest.fixture(scope="module")
def gpt2_snapshot() -> dict:
    model, optimizer = tiny_gpt2()
    return training_step_snapshot(model, optimizer, torch.randint(0, 256, (4, 32)))


def test_gpt2_step_timeline_ends_at_what_the_segments_hold(gpt2_snapshot, tmp_path):
    path = tmp_path / "rank-0.step-1.pickle"
    path.write_bytes(pickle.dumps(gpt2_snapshot))
    snapshot = read_snapshot(path)
    live = sum(b["size"] for s in gpt2_snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    timeline = snapshot.timeline
    assert snapshot.has_history and snapshot.allocated_bytes == live
    actions = [e["action"] for entries in gpt2_snapshot["device_traces"] for e in entries]
    assert timeline["action"].tolist() == [action for action in actions if action != "free_requested"]
    assert timeline["allocated_bytes"].iloc[-1] == live
    assert timeline["allocated_bytes"].min() >= 0
    # AdamW's two state tensors per parameter appear in the step: the peak is above the end
    assert timeline["allocated_bytes"].max() > live
    frames = timeline.loc[timeline["action"] == "alloc", "top_frame"].dropna()
    assert frames.str.contains("modeling_gpt2.py").any()
    assert not frames.str.startswith("torch/").any()


def test_gpt2_step_top_allocations_are_the_largest_live_blocks(gpt2_snapshot):
    top = top_allocations(gpt2_snapshot, limit=5)
    sizes = sorted((b["size"] for s in gpt2_snapshot["segments"] for b in s["blocks"]
                    if b["state"] == "active_allocated"), reverse=True)
    assert top["size_bytes"].tolist() == sizes[:5]


def cuda_frames(*places: str) -> list[dict]:
    """Frames as the CUDA allocator records them, innermost first: `file:line:function`."""
    frames = []
    for place in places:
        filename, line, name = place.rsplit(":", 2)
        frames.append({"filename": filename, "line": int(line), "name": name})
    return frames


USER = cuda_frames("/opt/torch/lib/c10/cuda/CUDACachingAllocator.cpp:1200:malloc",
                   "/venv/lib/python3.11/site-packages/torch/nn/functional.py:2503:linear",
                   "/home/me/train.py:42:forward", "/home/me/train.py:90:main")


def cuda_snapshot() -> dict:
    """A CUDA snapshot whose history lost its oldest actions (a 64 MiB tensor allocated earlier)."""
    mib = 2**20
    trace = [
        {"action": "segment_alloc", "addr": 1 << 32, "size": 20 * mib, "stream": 0, "time_us": 10, "frames": USER},
        {"action": "alloc", "addr": 1 << 32, "size": 8 * mib, "stream": 0, "time_us": 11, "frames": USER},
        {"action": "alloc", "addr": (1 << 32) + 8 * mib, "size": 4 * mib, "stream": 0, "time_us": 12, "frames": USER},
        {"action": "free_requested", "addr": 1 << 32, "size": 8 * mib, "stream": 0, "time_us": 13, "frames": USER},
        {"action": "free_completed", "addr": 1 << 32, "size": 8 * mib, "stream": 0, "time_us": 14, "frames": USER},
        {"action": "oom", "size": 30 * mib, "device_free": 2 * mib, "stream": 0, "time_us": 15, "frames": USER},
    ]
    segments = [
        {"device": 0, "address": 1 << 31, "total_size": 64 * mib, "stream": 0, "segment_type": "large",
         "allocated_size": 64 * mib, "active_size": 64 * mib,
         "blocks": [{"address": 1 << 31, "size": 64 * mib, "requested_size": 64 * mib, "state": "active_allocated",
                     "frames": cuda_frames("/home/me/train.py:12:build_model")}]},
        {"device": 0, "address": 1 << 32, "total_size": 20 * mib, "stream": 0, "segment_type": "large",
         "allocated_size": 4 * mib, "active_size": 4 * mib,
         "blocks": [{"address": 1 << 32, "size": 8 * mib, "requested_size": 0, "state": "inactive", "frames": []},
                    {"address": (1 << 32) + 8 * mib, "size": 4 * mib, "requested_size": 4 * mib - 10,
                     "state": "active_allocated", "frames": USER},
                    {"address": (1 << 32) + 12 * mib, "size": 8 * mib, "requested_size": 0, "state": "inactive",
                     "frames": []}]},
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_cuda_snapshot_timeline_is_anchored_at_the_snapshot():
    timeline = allocation_timeline(cuda_snapshot())
    mib = 2**20
    assert timeline["action"].tolist() == ["segment_alloc", "alloc", "alloc", "free_completed", "oom"]
    assert timeline["time_us"].tolist() == [10, 11, 12, 14, 15]
    # 64 MiB were allocated before the history starts; reserved grows by the 20 MiB segment
    assert (timeline["allocated_bytes"] // mib).tolist() == [64, 72, 76, 68, 68]
    assert (timeline["reserved_bytes"] // mib).tolist() == [84, 84, 84, 84, 84]
    assert timeline["top_frame"].unique().tolist() == ["/home/me/train.py:42:forward"]
    assert timeline.loc[timeline["action"] == "oom", "size_bytes"].tolist() == [30 * mib]


def test_cuda_snapshot_top_allocations_name_the_users_frame():
    top = top_allocations(cuda_snapshot())
    assert top[["size_bytes", "requested_bytes", "top_frame"]].values.tolist() == [
        [64 * 2**20, 64 * 2**20, "/home/me/train.py:12:build_model"],
        [4 * 2**20, 4 * 2**20 - 10, "/home/me/train.py:42:forward"],
    ]
    assert top["stack"].iloc[1].startswith("/opt/torch/lib/c10/cuda/CUDACachingAllocator.cpp:1200:malloc ← ")


def test_only_torch_frames_have_no_user_frame():
    assert top_user_frame(cuda_frames("/x/torch/nn/modules/module.py:1:_call_impl", "??:0:PyEval_EvalFrame")) is None
    assert top_user_frame([{"filename": "none", "line": 0, "name": "torch/nn/functional.py(2503): linear"},
                           {"filename": "none", "line": 0, "name": "train.py(7): <module>"}]) == "train.py(7): <module>"


def test_snapshot_without_history_has_live_blocks_only(tmp_path):
    snapshot = cuda_snapshot()
    snapshot["device_traces"] = [[]]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    read = read_snapshot(path)
    assert not read.has_history and len(read.top_allocations) == 2
    assert (read.allocated_bytes, read.reserved_bytes, read.segments) == (68 * 2**20, 84 * 2**20, 2)


@pytest.mark.parametrize(("content", "message"), [
    (b"not a pickle", "not a readable memory snapshot"),
    (pickle.dumps([1, 2]), "no 'segments' list"),
    (pickle.dumps({"segments": [], "hook": print}), "not a memory snapshot (it references builtins.print)"),
])
def test_a_file_that_is_not_a_snapshot_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.pickle"
    path.write_bytes(content)
    with pytest.raises(SnapshotFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_snapshot(path)
