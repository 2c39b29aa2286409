"""Rules that read what the loop hands to gpuprof (meta.json "loop") and its measured phases,
on runs written through the real RunWriter: thresholds on written phase streams, facts as
capture writes them. The live loops are in tests/loops (the corpus)."""

from __future__ import annotations

import pytest
from diagnoses_helpers import fired

from gpuprof.diagnoses import diagnose
from gpuprof.diagnoses.registry import all_rules
from gpuprof.diagnoses.rules import dataloader, optimizer

all_rules()
STEP_S = 0.2  # conftest.healthy_step: data 0.002, forward 0.06, backward 0.12, optimizer 0.015, other 0.003
LOADER = {"class": "DataLoader", "num_workers": 0, "pin_memory": False, "prefetch_factor": None,
          "persistent_workers": False, "batch_size": 8}
FUSED_ADAMW = {"class": "AdamW", "fused": True, "foreach": None, "param_groups": 2, "fused_supported": True}
TORCH_DEFAULTS = {"float32_matmul_precision": "highest", "cuda_matmul_allow_tf32": False,
                  "cudnn_allow_tf32": True, "cudnn_benchmark": False}


def loop(**parts) -> dict:
    """meta.json's "loop" of a healthy loop (sdpa GPT-2, fused AdamW, a DataLoader), with `parts` changed."""
    facts = {"model": {"class": "GPT2LMHeadModel", "attn_implementation": "sdpa", "compiled": False,
                       "module_types": {"GPT2Block": 2}},
             "optimizer": FUSED_ADAMW, "loader": LOADER, "torch": TORCH_DEFAULTS, "autocast_dtype": "bf16"}
    return {"loop": {**facts, **parts}}


def with_data_share(share: float):
    """Step overrides: the data phase takes `share` of a STEP_S step, the model's phases give up the time in
    proportion (data 0.002 of a healthy step's 0.2 s)."""
    data_s = share * STEP_S
    kept = (STEP_S - data_s) / (STEP_S - 0.002)
    return lambda i: {"data_time_s": data_s, "forward_time_s": 0.06 * kept, "backward_time_s": 0.12 * kept,
                      "optimizer_time_s": 0.015 * kept, "other_time_s": 0.003 * kept}


@pytest.mark.parametrize("device_run", ["write_cpu_run", "write_gpu_run"])
def test_healthy_loop_has_no_finding(request, device_run):
    assert diagnose(request.getfixturevalue(device_run)(meta=loop()), strict=True) == []


def test_dataloader_bound_thresholds_on_written_phases(write_cpu_run):
    below = dataloader.DATA_SHARE_WARNING_PCT / 100 - 0.01
    assert not fired(write_cpu_run(meta=loop(), step=with_data_share(below)), "dataloader-bound")
    (warning,) = fired(write_cpu_run(meta=loop(), step=with_data_share(below + 0.02)), "dataloader-bound")
    assert warning.severity == "warning"
    critical_share = dataloader.DATA_SHARE_CRITICAL_PCT / 100 + 0.01
    (critical,) = fired(write_cpu_run(meta=loop(), step=with_data_share(critical_share)), "dataloader-bound")
    assert critical.severity == "critical"
    assert critical.evidence["data_share_pct"] == pytest.approx(100 * critical_share)
    assert critical.evidence["data_time_p50_s"] == pytest.approx(critical_share * STEP_S)


def test_dataloader_fix_follows_the_loader(write_cpu_run, write_gpu_run):
    (no_workers,) = fired(write_cpu_run(meta=loop(), step=with_data_share(0.5)), "dataloader-bound")
    assert no_workers.evidence["loader"] == LOADER and "num_workers=4" in no_workers.fix
    busy_workers = loop(loader={**LOADER, "num_workers": 8, "pin_memory": True})
    (workers,) = fired(write_cpu_run(meta=busy_workers, step=with_data_share(0.5)), "dataloader-bound")
    assert workers.evidence["num_workers"] == 8 and "8 loader workers do not keep up" in workers.fix
    (on_gpu,) = fired(write_gpu_run(meta=loop(), step=with_data_share(0.5)), "dataloader-bound")
    assert on_gpu.fix.endswith(dataloader.PIN_MEMORY_FIX)


def test_attention_read_from_the_model(write_cpu_run):
    eager = loop(model={"class": "GPT2LMHeadModel", "attn_implementation": "eager", "compiled": False})
    (finding,) = fired(write_cpu_run(meta=eager), "attention-not-fused")
    assert (finding.evidence["attention"], finding.severity) == ("eager", "info")
    hand_written = loop(model={"class": "NanoGPT", "attn_implementation": None, "compiled": False})
    assert not fired(write_cpu_run(meta=hand_written), "attention-not-fused")


@pytest.mark.parametrize("facts, implementation", [
    ({"foreach": False}, "for-loop"),
    ({"fused": None}, "foreach"),  # torch's default on CUDA
    ({"fused": False, "foreach": True}, "foreach"),
])
def test_unfused_optimizer_names_what_torch_runs(write_gpu_run, facts, implementation):
    unfused = loop(optimizer={**FUSED_ADAMW, "fused": None, **facts})
    (finding,) = fired(write_gpu_run(meta=unfused), "unfused-optimizer")
    assert finding.evidence["implementation"] == implementation


def test_unfused_optimizer_severity_follows_the_optimizer_phase(write_cpu_run):
    unfused = loop(optimizer={**FUSED_ADAMW, "fused": None})
    (small,) = fired(write_cpu_run(meta=unfused), "unfused-optimizer")  # 0.015 s of 0.2 s: 7.5%
    assert small.severity == "warning" and small.evidence["implementation"] == "for-loop"
    share_below = optimizer.OPTIMIZER_SHARE_WARNING_PCT / 100 / 2
    light = write_cpu_run(meta=unfused, step=lambda i: {"optimizer_time_s": share_below * STEP_S})
    (info,) = fired(light, "unfused-optimizer")
    assert info.severity == "info"


def test_unfused_optimizer_needs_a_fused_kernel(write_cpu_run):
    no_kernel = loop(optimizer={**FUSED_ADAMW, "class": "RMSprop", "fused": None, "fused_supported": False})
    assert not fired(write_cpu_run(meta=no_kernel), "unfused-optimizer")


MUON = {"class": "Muon", "fused": None, "foreach": None, "param_groups": 1, "fused_supported": False}


def test_unfused_optimizer_of_several_names_the_one_with_a_kernel(write_cpu_run):
    def chain(adamw: dict) -> dict:
        return loop(optimizer={"class": "Muon+AdamW", "param_groups": 3, "members": [MUON, adamw]})

    (finding,) = fired(write_cpu_run(meta=chain({**FUSED_ADAMW, "fused": None})), "unfused-optimizer")
    assert finding.evidence["class"] == "AdamW"
    assert not fired(write_cpu_run(meta=chain(FUSED_ADAMW)), "unfused-optimizer")  # Muon has no fused kernel


def test_params_without_optimizer_from_the_loop_facts(write_cpu_run):
    names = ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_fc.weight"]
    missed = loop(optimizer={**FUSED_ADAMW, "params_without_optimizer": 8, "params_without_optimizer_names": names})
    (finding,) = fired(write_cpu_run(meta=missed), "params-without-optimizer")
    assert finding.evidence["params_without_optimizer"] == 8 and finding.evidence["first_names"] == names
    assert finding.severity == "warning" and names[0] in finding.title
    covered = loop(optimizer={**FUSED_ADAMW, "params_without_optimizer": 0, "params_without_optimizer_names": []})
    assert not fired(write_cpu_run(meta=covered), "params-without-optimizer")


def test_fp32_matmul_from_torch_settings(write_gpu_run):
    fp32 = {"compute_dtype": "fp32", **loop(autocast_dtype=None)}
    (finding,) = fired(write_gpu_run(meta=fp32), "fp32-matmul")
    assert finding.evidence["tf32"] is False
    tf32 = {"compute_dtype": "fp32", **loop(autocast_dtype=None, torch={**TORCH_DEFAULTS, "float32_matmul_precision": "high"})}
    assert not fired(write_gpu_run(meta=tf32), "fp32-matmul")
    assert not fired(write_gpu_run(meta={"compute_dtype": "fp32", **loop(autocast_dtype="bf16")}), "fp32-matmul")


def test_the_workload_config_alone_never_fires(write_cpu_run, write_gpu_run):
    """A config naming every bad knob of the reference workload, on a healthy loop: no finding."""
    config = {"attention": "eager", "fused_adamw": False, "host_sync": True, "tf32": False, "precision": "fp32",
              "num_workers": 0, "backend": "gloo", "grad_accum": 4}
    for write in (write_cpu_run, write_gpu_run):
        assert diagnose(write(meta={"config": config, "world_size": 2, **loop()}), strict=True) == []
