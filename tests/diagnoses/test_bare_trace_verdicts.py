"""Bare torch.profiler traces recorded here on the CPU, read by `gpuprof trace` as a user runs it (issue 50, point 4):
the verdict names the largest share of the step breakdown it prints beside it, a trace with no device gets no GPU
advice, a model with no attention no attention advice, and a trace without ProfilerStep markers (no schedule, then
export_chrome_trace) is not described in terms of the steps it lacks.
"""

from __future__ import annotations

import functools
import re
import time

import pytest
import torch
import torch.nn.functional as F
from loops import SEQ_LEN, VOCAB_SIZE, one_thread, tiny_gpt2
from processes import gpuprof_cli

TRACED_STEPS = 3
# Batches large enough that the GPT-2's ops outweigh the Python between them (transformers' module calls) even on a
# loaded machine: its verdict is compute, where its attention advice is given.
GPT2_BATCH = 16
# The MLP loop's own Python between its ops (bookkeeping), against its ops' time: about a third of the step, a host
# share the old verdict took for the bound (15 % and more of the step) while the ops stay the largest share.
BOOKKEEPING_SHARE = 0.5
# The step breakdown's rows on a CPU trace, and the bound a verdict reads from each.
BOUND_OF_ROW = {"cpu exec": "compute", "other": "host/launch", "dataloader": "input", "communication": "communication"}
GPU_ADVICE = ("cuda", "gpu", "pin_memory", "non_blocking", "nccl", "tf32", "bf16")
ATTENTION_ADVICE = ("attention", "sdpa")
# The analysis window's own words for a trace with steps, and an internal step number.
STEP_WINDOW_WORDS = ("The last profiler step is left out", "step -1")


def gpt2_step(model, optimizer):
    tokens = torch.randint(0, VOCAB_SIZE, (GPT2_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def step():
        logits = model(input_ids=tokens).logits
        F.cross_entropy(logits.view(-1, VOCAB_SIZE), tokens.view(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def mlp_step():
    """A plain MLP's step, then Python bookkeeping that takes BOOKKEEPING_SHARE of the step's time on this machine."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(256, 512), torch.randn(256, 1)

    def compute():
        F.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    compute_s = min(timed(compute) for _ in range(3))

    def step():
        compute()
        until = time.perf_counter() + BOOKKEEPING_SHARE * compute_s
        while time.perf_counter() < until:
            pass

    return step


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def record(path, step, scheduled: bool):
    """`step` traced for TRACED_STEPS steps on the CPU: with no schedule then export_chrome_trace, as a user does,
    or under a schedule that marks each step (ProfilerStep#N) and exports when it ends."""
    step()  # warm-up, outside the trace
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=TRACED_STEPS, repeat=1) if scheduled else None
    export = (lambda profiler: profiler.export_chrome_trace(str(path))) if scheduled else None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=export) as profiler:
        for _ in range(TRACED_STEPS + 1 if scheduled else TRACED_STEPS):  # the schedule warms up for a step
            step()
            if scheduled:
                profiler.step()
    if not scheduled:
        profiler.export_chrome_trace(str(path))
    return path


def gpt2(attn_implementation: str):
    model = tiny_gpt2(attn_implementation)
    return gpt2_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


TRACES = {
    "gpt2": (lambda: gpt2("sdpa"), False),
    "gpt2_eager": (lambda: gpt2("eager"), False),
    "mlp": (mlp_step, False),
    "gpt2_scheduled": (lambda: gpt2("sdpa"), True),
}


class Printed:
    """What `gpuprof trace FILE` printed, read as a user reads it."""

    def __init__(self, text: str):
        self.text = " ".join(text.split())  # the terminal's line wrapping undone
        verdict = re.search(r"Verdict: Bound by (\S+) \((\d+) %\)", self.text)
        assert verdict, self.text[:2000]
        self.bound, self.share_pct = verdict[1], float(verdict[2])
        rows = re.findall(r"│ ([a-z ]+?) +│ +[\d,.]+ \(([\d.]+) %\) │", self.text)
        self.breakdown = {row: float(share) for row, share in rows}
        self.next_step = re.search(r" next (.*?) (?:No findings\.|Findings \()", self.text)[1]
        self.fixes = re.findall(r" fix: (.*?)(?= \d+\. [A-Z]+ | rank \d+: )", self.text)
        self.notes = self.text[re.search(r" rank \d+: [\d,]+ events", self.text).start():]

    @property
    def advice(self) -> str:
        return " ".join([self.next_step, *self.fixes])

    @property
    def largest_row(self) -> str:
        return max(self.breakdown, key=self.breakdown.get)


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    """printed(name) -> what `gpuprof trace` printed for the TRACES trace `name`, recorded once per module."""
    root = tmp_path_factory.mktemp("bare-traces")

    @functools.cache
    def run(name: str) -> Printed:
        make_step, scheduled = TRACES[name]
        with one_thread():
            path = record(root / f"{name}.json", make_step(), scheduled)
        result = gpuprof_cli("trace", path)
        assert result.returncode == 0, result.stderr[-3000:]
        return Printed(result.stdout)

    return run


@pytest.mark.parametrize("name", list(TRACES))
def test_the_verdict_names_the_largest_share_of_the_breakdown_beside_it(printed, name):
    trace = printed(name)
    assert trace.bound == BOUND_OF_ROW[trace.largest_row], trace.breakdown
    assert trace.share_pct == pytest.approx(trace.breakdown[trace.largest_row], abs=1)


def test_the_mlps_host_share_is_one_the_verdict_could_have_taken(printed):
    """The MLP trace holds what made the old verdict say "Bound by host/launch (17 %)" beside "cpu exec 82 %":
    Python between the ops of at least 15 % of the step, the ops still the larger share."""
    breakdown = printed("mlp").breakdown
    assert 15 <= breakdown["other"] < breakdown["cpu exec"], breakdown


@pytest.mark.parametrize("name", list(TRACES))
def test_a_trace_without_a_device_gets_no_gpu_advice(printed, name):
    trace = printed(name)
    assert "0 on the device" in trace.notes
    assert not [word for word in GPU_ADVICE if word in trace.advice.lower()], trace.advice


def test_a_real_cpu_only_trace_gets_no_gpu_advice(shared_trace):
    """HTA's CPU-only trace of rank 34 of a 300-rank job (../shared/traces), bound by its communication."""
    (path,) = shared_trace("cpu_only")
    trace = Printed(gpuprof_cli("trace", path).stdout)
    assert trace.bound == BOUND_OF_ROW[trace.largest_row], trace.breakdown
    assert "0 on the device" in trace.notes
    assert not [word for word in GPU_ADVICE if word in trace.advice.lower()], trace.advice


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_no_attention_advice_where_the_trace_shows_none_to_fuse(printed, name):
    """The MLP has no attention; the GPT-2's already runs scaled_dot_product_attention."""
    advice = printed(name).advice.lower()
    assert not [word for word in ATTENTION_ADVICE if word in advice], advice


def test_eager_attention_in_the_trace_gets_the_fused_one(printed):
    assert "scaled_dot_product_attention" in printed("gpt2_eager").next_step


@pytest.mark.parametrize("name", ["gpt2", "mlp"])
def test_a_trace_without_step_markers_is_one_whole_step(printed, name):
    trace = printed(name)
    assert "0 profiler steps" in trace.notes
    assert "No ProfilerStep markers" in trace.notes and "analysed as one step" in trace.notes
    assert not [words for words in STEP_WINDOW_WORDS if words in trace.text]


def test_a_scheduled_trace_says_which_of_its_steps_it_analyses(printed):
    trace = printed("gpt2_scheduled")
    steps = int(re.search(r"rank 0: [\d,]+ events, 0 on the device, (\d+) profiler steps", trace.notes)[1])
    assert steps == TRACED_STEPS - 1, "the last of the traced steps is left out, as HTA does"
    assert "The last profiler step is left out" in trace.notes and "No ProfilerStep markers" not in trace.notes
    assert f"rank 0 ({steps} steps)" in trace.text
