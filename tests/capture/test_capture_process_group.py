"""`meta.json`'s `process_group`: whether the ranks joined one, whenever the loop made it while recording."""

from __future__ import annotations

import json

import torch
from capture_loop import optimizer_step, tiny_model

import gpuprof


def train_two_steps(run_dir, *, group_file=None) -> dict:
    """Two steps of the tiny model; with `group_file`, a one-rank gloo group made after the Profiler started and
    destroyed before it closes (a loop may do either)."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, numerics=False) as prof:
        if group_file is not None:
            torch.distributed.init_process_group("gloo", init_method=f"file://{group_file}", rank=0, world_size=1)
        for step in range(2):
            optimizer_step(model, optimizer, step)
            prof.step()
        if group_file is not None:
            torch.distributed.destroy_process_group()
    return json.loads((run_dir / "meta.json").read_text())


def test_a_group_joined_after_the_profiler_started_and_left_before_it_closed_is_recorded(tmp_path):
    assert train_two_steps(tmp_path / "alone")["process_group"] is False
    assert train_two_steps(tmp_path / "grouped", group_file=tmp_path / "group")["process_group"] is True
