"""The diagnoses on loops gpuprof did not write: each fault fires its rule on a nanoGPT-style
loop wrapped the documented way (no phase markup, no config), and nothing fires on the healthy one.

Step-time noise rules and the machine's own load are left out of the silence checks: on a loaded
machine any short live run can show erratic steps, and is told that other processes took its cores;
their thresholds are tested on written streams (tests/diagnoses/test_diagnoses_loop_rules.py) and
beside real busy processes (tests/diagnoses/test_diagnoses_host_load.py).
"""

from __future__ import annotations

import functools

import pytest

from gpuprof.diagnoses import diagnose
from loops import BATCH_SIZE, nanogpt_loop, one_thread

# 12.5 ms per sample, 50 ms per batch: several times a tiny-GPT-2 step, even on a loaded machine.
SLOW_SAMPLE_S = 0.0125
# The window ends with the run, so writing the trace delays no measured step.
TRACE_STEPS = range(3, 6)
LOOPS = {
    "healthy": {"trace_steps": TRACE_STEPS},
    "fp16_scaler": {"fp16": True},
    "slow_loader": {"loader_delay_s": SLOW_SAMPLE_S},
    "item_per_step": {"read_loss_every_step": True, "trace_steps": TRACE_STEPS},
    "eager_attention": {"attn_implementation": "eager"},
    # traced too: the for-loop AdamW reads its CPU step counters, which are not the loop's syncs
    "unfused_optimizer": {"optimizer_options": {"foreach": False}, "trace_steps": TRACE_STEPS},
}
FAULTS = {
    "slow_loader": "dataloader-bound",
    "item_per_step": "host-device-sync",
    "eager_attention": "attention-not-fused",
    "unfused_optimizer": "unfused-optimizer",
}
TIMING_NOISE = {"step-time-variance", "warmup-pollution", "host-contention"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """corpus(name) -> {rule id: finding} of the LOOPS loop `name`, recorded once per module."""
    root = tmp_path_factory.mktemp("corpus")

    @functools.cache
    def findings(name):
        with one_thread():
            run = nanogpt_loop(root / name, **LOOPS[name])
        return {finding.rule: finding for finding in diagnose(run, strict=True)}

    return findings


@pytest.mark.parametrize("loop", ["healthy", "fp16_scaler"])
def test_healthy_loops_get_no_finding(corpus, loop):
    assert set(corpus(loop)) - TIMING_NOISE == set()


@pytest.mark.parametrize("loop, rule_id", FAULTS.items())
def test_each_fault_fires_its_rule_and_only_it(corpus, loop, rule_id):
    assert set(corpus(loop)) - TIMING_NOISE == {rule_id}


def test_slow_loader_reads_the_dataloader(corpus):
    finding = corpus("slow_loader")["dataloader-bound"]
    assert finding.evidence["num_workers"] == 0
    assert finding.evidence["loader"]["batch_size"] == BATCH_SIZE
    # Sleeps only get longer under load: the first micro-batch's wait is at least its samples' sleeps.
    assert finding.evidence["data_time_p50_s"] >= BATCH_SIZE * SLOW_SAMPLE_S
    assert f"num_workers={finding.evidence['estimate_workers']}," in finding.fix and "pin_memory" not in finding.fix


def test_item_per_step_is_found_in_the_cpu_trace(corpus):
    finding = corpus("item_per_step")["host-device-sync"]
    assert finding.evidence["source"] == "cpu-trace"
    assert finding.evidence["syncs_per_step"] == pytest.approx(1.0)
    assert finding.severity == "info", "a CPU run pays nothing for a host read"
    assert finding.title.startswith("1.0 reads of tensor values on the host per step, mostly from aten::_local_scalar_dense")
    assert finding.title.endswith("each would be a host-device sync on a GPU")  # not called a sync where none is


def test_eager_attention_is_read_from_the_model(corpus):
    finding = corpus("eager_attention")["attention-not-fused"]
    assert finding.evidence["attention"] == "eager"
    assert finding.evidence["model_class"] == "GPT2LMHeadModel"


def test_unfused_optimizer_names_the_implementation(corpus):
    finding = corpus("unfused_optimizer")["unfused-optimizer"]
    assert (finding.evidence["class"], finding.evidence["implementation"]) == ("AdamW", "for-loop")
    assert finding.evidence["optimizer_share_pct"] > 0, "the optimizer phase is measured by hooks"
