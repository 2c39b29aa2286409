"""The private torch names gpuprof uses (gpuprof/torch_compat.py): the installed torch has every one, every one
gpuprof's code uses is listed, and a torch without them still has its loop recorded, NaN blame included."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import capture_loop
import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import gpuprof
from gpuprof import torch_compat

pytestmark = pytest.mark.newest_torch  # run again on the newest torch tested (scripts/test.sh)
GPUPROF_DIR = Path(gpuprof.__file__).parent
DOTTED = re.compile(r"torch(?:\.\w+)+")
IMPORTED = re.compile(r"^\s*from (torch[\w.]*) import \(?([^)\n]+)", re.MULTILINE)
STEPS, NAN_AT = 5, 3


def is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_names_in(source: str) -> set[str]:
    """Every dotted torch name with a private part, attribute chains and imports alike."""
    dotted = [*DOTTED.findall(source), *(f"{module}.{name.split(' as ')[0].strip()}"
                                        for module, names in IMPORTED.findall(source) for name in names.split(","))]
    return {name for name in dotted if any(map(is_private, name.split(".")))}


def is_listed(name: str, listed: list[str]) -> bool:
    """A listed name, an attribute of one (`..._execution_engine.queue_callback`), or a module that holds one."""
    return any(name == entry or name.startswith(entry + ".") or entry.startswith(name + ".") for entry in listed)


def test_the_installed_torch_has_every_private_name_gpuprof_uses():
    missing = torch_compat.missing()
    assert not missing, (f"torch {torch.__version__} lacks private names gpuprof uses; list each one's fallback "
                         "in gpuprof/torch_compat.py and check it: "
                         + "; ".join(f"{name}: {torch_compat.MODULE_NAMES.get(name, 'build-only')}" for name in missing))


def test_every_private_torch_name_in_gpuprof_is_listed():
    listed = [*torch_compat.MODULE_NAMES, *torch_compat.BUILD_ONLY, *torch_compat.ATTRIBUTES]
    unlisted = {}
    for path in GPUPROF_DIR.rglob("*.py"):
        for name in private_names_in(path.read_text()):
            if not is_listed(name, listed):
                unlisted.setdefault(name, []).append(str(path.relative_to(GPUPROF_DIR)))
    assert not unlisted, f"private torch names used but not in gpuprof/torch_compat.py: {unlisted}"


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def objects_of_each_class() -> dict[str, object]:
    """A live object of each class torch_compat.ATTRIBUTES names, each past the point where torch sets them."""
    model = capture_loop.tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    ddp = torch.nn.parallel.DistributedDataParallel(capture_loop.tiny_model())
    sharded = fully_shard(capture_loop.tiny_model())
    tokens = capture_loop.batch(0)
    sharded(input_ids=tokens, labels=tokens).loss.backward()
    state = sharded._get_fsdp_state()
    return {"torch.amp.GradScaler": scaler, "torch.optim.Optimizer": optimizer, "torch.nn.Module": model,
            "torch._dynamo.eval_frame.OptimizedModule": torch.compile(model),
            "torch._ops.OpOverload": torch.ops.aten.add.Tensor,
            "torch.nn.parallel.DistributedDataParallel": ddp, "torch.distributed.fsdp.FSDPModule": sharded,
            "torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState": state,
            "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam": state._fsdp_param_group.fsdp_params[0]}


def test_torch_objects_have_every_private_attribute_gpuprof_reads(one_rank_group):
    objects = objects_of_each_class()
    assert set(objects) == set(torch_compat.ATTRIBUTES)
    lacking = [f"{cls}.{attribute}: {lost}" for cls, attributes in torch_compat.ATTRIBUTES.items()
               for attribute, lost in attributes.items() if not hasattr(objects[cls], attribute)]
    for cls, found in objects.items():
        assert isinstance(found, torch_compat.resolve(cls)), cls
    assert not lacking, f"torch {torch.__version__} lacks attributes gpuprof reads: {lacking}"


def test_without_them_the_loop_is_recorded_and_its_nan_blamed(tmp_path):
    """gpuprof takes every listed name to be missing (GPUPROF_HIDE_TORCH_INTERNALS=all: removing them from torch
    itself would break torch's own code): the real tiny loop runs to its end with every step recorded, meta.json
    names what is missing, the log says each once, and the NaN is still blamed on the poisoned weight."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, capture_loop.__file__, str(run_dir), "--steps", str(STEPS),
                           "--nan-at", str(NAN_AT)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, torch_compat.HIDE_ENV: "all", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    run = gpuprof.load_run(run_dir)
    assert run.steps["step"].tolist() == list(range(STEPS)) and run.steps["loss"].iloc[:NAN_AT].notna().all()
    assert run.meta["versions"]["torch_internals_missing"].split(", ") == list(torch_compat.MODULE_NAMES)
    for name in torch_compat.MODULE_NAMES:
        assert done.stderr.count(f"this torch has no {name}:") <= 1, name
    [nonfinite] = run.events[run.events["kind"] == "nonfinite"].to_dict("records")
    assert nonfinite["step"] == NAN_AT
    assert (nonfinite["details"]["phase"], nonfinite["details"]["tensor"]) == ("state", capture_loop.POISONED)
