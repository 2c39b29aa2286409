"""Automatic phases: a loop wrapped in three lines, no prof.phase(), still gets data/forward/backward/optimizer.

Live timings are only checked from below (a phase holds at least the sleep put into it) and
by the sum identity; the merge arithmetic is checked on synthetic stamps.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from capture_loop import BATCH, SEQ, VOCAB, batch, tiny_model
from numerics.numerics_helpers import events

import gpuprof
from gpuprof.capture import phases
from gpuprof.capture.producers import Span
from gpuprof.capture.profiler import _timing
from gpuprof.capture.timing import HostClock, PhaseTimes

PHASES = ["data_time_s", "forward_time_s", "backward_time_s", "optimizer_time_s", "eval_time_s"]
SLEEP_S = 0.03


class SlowDataset(torch.utils.data.Dataset):
    """Token rows that take `delay_s` each to load, like a loader doing work in __getitem__."""

    def __init__(self, rows: int, delay_s: float):
        self.rows = torch.cat([batch(step) for step in range(rows // BATCH + 1)])[:rows]
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.rows[index]


def assert_parts_add_up(steps):
    """Phases plus other equal the step time within 5%, and the phases alone never exceed it."""
    phases = steps[PHASES].fillna(0.0).sum(axis=1)
    assert (phases <= steps["step_time_s"] * 1.05).all()
    np.testing.assert_allclose(phases + steps["other_time_s"], steps["step_time_s"], rtol=0.05)


def plain_loop(prof, model, optimizer, loader, other_sleep_s=0.0) -> list[float]:
    losses = []
    for inputs in loader:
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        time.sleep(other_sleep_s)
        if prof is not None:
            prof.step(loss=loss, tokens=inputs.numel())
    return losses


def test_the_three_line_wrap_gives_every_phase(tmp_path):
    loader = torch.utils.data.DataLoader(SlowDataset(4 * BATCH, SLEEP_S / BATCH), batch_size=BATCH)
    model = tiny_model()
    bare = plain_loop(None, model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, loader=loader,
                         sample_interval_s=0) as prof:
        losses = plain_loop(prof, model, optimizer, loader, other_sleep_s=SLEEP_S)
    assert losses == bare  # the hooks leave the numerics alone
    run = gpuprof.load_run(tmp_path / "run")
    steps = run.steps
    assert len(steps) == 4 and steps["micro_batches"].tolist() == [1] * 4
    assert (steps["data_time_s"] >= SLEEP_S).all()  # __getitem__ sleeps, before the first forward
    assert (steps["other_time_s"] >= SLEEP_S).all()  # after optimizer.step(), before prof.step()
    assert (steps[["forward_time_s", "backward_time_s", "optimizer_time_s"]] > 0).all().all()
    assert_parts_add_up(steps)
    assert run.events.empty or "phase_unavailable" not in run.events["kind"].tolist()


def test_nanogpt_style_accumulation_loss_outside_the_model(tmp_path):
    """Logits from the model, the loss outside it, three micro-batches: one row, phases summed over them."""
    accumulation = 3
    model = tiny_model()
    model.transformer.ln_f.register_forward_hook(lambda module, args, output: time.sleep(SLEEP_S))
    model.transformer.h[0].register_full_backward_hook(lambda module, grad_in, grad_out: time.sleep(SLEEP_S))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(3):
            for micro in range(accumulation):
                inputs = batch(step, micro)
                logits = model(input_ids=inputs).logits
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), inputs[:, 1:].reshape(-1)) / accumulation
                time.sleep(SLEEP_S)  # between the model call and backward(): counts as forward
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            prof.step(loss=loss, tokens=accumulation * BATCH * SEQ)
    steps = gpuprof.load_run(tmp_path / "run").steps
    assert steps["micro_batches"].tolist() == [accumulation] * 3
    assert (steps["forward_time_s"] >= 2 * accumulation * SLEEP_S).all()
    assert (steps["backward_time_s"] >= accumulation * SLEEP_S).all()
    assert (steps[["data_time_s", "optimizer_time_s"]] > 0).all().all()
    assert_parts_add_up(steps)


def test_explicit_phases_win_per_step_and_name(tmp_path):
    """The loop marks only `data`; its span replaces the automatic one, the other phases stay automatic."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    before_data_s = 0.2
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(3):
            time.sleep(before_data_s)  # automatic data would hold this; the marked phase does not
            with prof.phase("data"):
                time.sleep(SLEEP_S)
                inputs = batch(step)
            model(input_ids=inputs, labels=inputs).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    steps = gpuprof.load_run(tmp_path / "run").steps
    assert (steps["data_time_s"] >= SLEEP_S).all() and (steps["data_time_s"] < before_data_s).all()
    assert (steps["other_time_s"] >= before_data_s).all()
    assert (steps[["forward_time_s", "backward_time_s", "optimizer_time_s"]] > 0).all().all()
    assert_parts_add_up(steps)


def evaluate(model, seconds: float) -> None:
    """An evaluation function of the loop's own, as nanoGPT's estimate_loss()."""
    model.eval()
    with torch.no_grad():
        model(input_ids=batch(100))
        time.sleep(seconds)
    model.train()


def test_evaluation_is_neither_data_nor_forward(tmp_path):
    """An evaluation at the top of the step ends the data span; it is eval: from its first model call to its
    last one, and once the function evaluating is known (at the first training call), the whole call."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    evaluation_s = 0.2
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(3):
            evaluate(model, evaluation_s)
            inputs = batch(step)
            model(input_ids=inputs, labels=inputs).loss.backward()
            optimizer.step()
            prof.step()
    run = gpuprof.load_run(tmp_path / "run")
    steps = run.steps
    assert (steps["data_time_s"] < evaluation_s).all() and (steps["eval_time_s"] > 0).all()
    assert (steps["eval_time_s"][1:] >= evaluation_s).all() and (steps["other_time_s"][1:] < evaluation_s).all()
    assert steps["micro_batches"].tolist() == [1, 1, 1]
    assert {"role": "eval", "function": "evaluate"}.items() <= run.meta["phase_sources"][-1].items()
    assert_parts_add_up(steps)


def test_an_evaluation_the_loop_runs_itself_is_eval_from_its_first_model_call_to_its_last(tmp_path):
    """The Accelerate example's shape: the loop calls the model in evaluation itself, over a DataLoader; that
    loader's batches between the evaluation calls are evaluation, not data."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    eval_batches = 8
    eval_loader = torch.utils.data.DataLoader(SlowDataset(eval_batches * BATCH, SLEEP_S / BATCH), batch_size=BATCH)
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(3):
            inputs = batch(step)
            model(input_ids=inputs, labels=inputs).loss.backward()
            optimizer.step()
            prof.step()
            model.eval()
            for eval_inputs in eval_loader:
                with torch.no_grad():
                    model(input_ids=eval_inputs)
            model.train()
    steps = gpuprof.load_run(tmp_path / "run").steps
    # the first evaluation batch is fetched before the first evaluation call: data; the 7 after it: eval
    assert (steps["eval_time_s"][1:] >= (eval_batches - 1) * SLEEP_S).all()
    assert (steps["data_time_s"][1:] < steps["eval_time_s"][1:] / 2).all()
    assert_parts_add_up(steps)


def get_batch(step: int, delay_s: float) -> torch.Tensor:
    time.sleep(delay_s)
    return batch(step)


def test_a_batch_fetched_between_forward_and_backward_is_data(tmp_path):
    """nanoGPT's order: the next batch is fetched after the model call, before backward(); a DataLoader
    iterated after the optimizer is data too."""
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = iter(torch.utils.data.DataLoader(SlowDataset(8 * BATCH, SLEEP_S / BATCH), batch_size=BATCH))
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        inputs = get_batch(0, SLEEP_S)
        for step in range(3):
            logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), inputs[:, 1:].reshape(-1))
            inputs = get_batch(step + 1, 2 * SLEEP_S)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            next(loader)
            prof.step()
    run = gpuprof.load_run(tmp_path / "run")
    steps = run.steps
    assert (steps["data_time_s"] >= 3 * SLEEP_S).all()
    assert [source["function"] for source in run.meta["phase_sources"]] == ["get_batch"]
    assert_parts_add_up(steps)


class ManualClock(HostClock):
    """The host clock at times the test sets: the phase hooks' arithmetic on known stamps."""

    now_s = 0.0

    def stamp(self) -> float:
        return self.now_s


def test_a_batch_fetched_between_forward_and_backward_is_taken_out_of_the_forward(monkeypatch):
    clock = ManualClock()
    monkeypatch.setattr(phases.time, "perf_counter", lambda: clock.now_s)
    model = tiny_model()
    hooks = phases.PhaseHooks(model, None, clock)
    hooks._data = Span(hooks._data_begins, hooks._data_ends)
    hooks._eval = Span(hooks._eval_begins, hooks._eval_ends)
    hooks.on_step_start(None, 0)
    for now_s, event in [(1.0, lambda: hooks._forward_begins(model, (), {})),
                         (2.0, lambda: hooks._forward_ends(model, (), torch.zeros(1))),
                         (2.5, hooks._data.__enter__), (4.0, hooks._data.__exit__),
                         (4.5, lambda: hooks._backward_begins()), (5.0, lambda: hooks.on_after_backward(None, 0))]:
        clock.now_s = now_s
        event()
    clock.now_s = 6.0
    totals = hooks.finish_step().totals_s()
    assert totals == {"forward": 1.5 + 0.5, "data": 1.5, "backward": 0.5}


def test_merge_arithmetic_on_synthetic_stamps():
    """Host-clock stamps in seconds: explicit `forward` replaces the automatic one, other is the rest."""
    clock = HostClock()
    explicit, automatic = PhaseTimes(clock), PhaseTimes(clock)
    automatic.add_host("data", 0.5)
    automatic.add("forward", 0.5, 2.0)
    automatic.add("forward", 4.0, 4.5)  # a second micro-batch
    automatic.add("backward", 2.0, 4.0)
    automatic.add("optimizer", 5.0, 5.5)
    explicit.add("forward", 0.5, 1.0)
    columns = _timing(clock, 0.0, 6.0, explicit, automatic)()
    assert columns == {"step_time_s": 6.0, "data_time_s": 0.5, "forward_time_s": 0.5, "backward_time_s": 2.0,
                       "optimizer_time_s": 0.5, "eval_time_s": None, "other_time_s": 2.5}
    columns = _timing(clock, 0.0, 6.0, PhaseTimes(clock), automatic)()
    assert columns["forward_time_s"] == 2.0 and columns["other_time_s"] == 1.0


def test_compiled_model_gets_phases(tmp_path):
    model = tiny_model()
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gpuprof.profile(tmp_path / "run", model=compiled, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(3):
            inputs = batch(step)
            compiled(input_ids=inputs, labels=inputs).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    run = gpuprof.load_run(tmp_path / "run")
    assert (run.steps[["forward_time_s", "backward_time_s", "optimizer_time_s"]] > 0).all().all()
    assert run.meta["loop"]["model"]["compiled"] is True
    assert run.meta["loop"]["model"]["class"] == "GPT2LMHeadModel"


@pytest.mark.parametrize("runs", ["eager", "compiled module", "compiled function"])
def test_the_plain_model_handed_over_is_seen_run_compiled(tmp_path, runs):
    """A loop may give gpuprof the plain model and run torch.compile(model), or compile its step: the
    loop facts the rules read say compiled from how the first forward ran, not from the object."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model, backend="eager") if runs == "compiled module" else model

    def loss_of(inputs):
        return forward(input_ids=inputs, labels=inputs).loss

    loss_of = torch.compile(loss_of, backend="eager") if runs == "compiled function" else loss_of
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(2):
            loss_of(batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    assert gpuprof.load_run(tmp_path / "run").meta["loop"]["model"]["compiled"] is (runs != "eager")


@pytest.fixture
def fresh_dynamo():
    """Code compiled by other tests (the same transformers model, other arguments) is not this test's recompile."""
    torch._dynamo.reset()


def test_a_compiled_optimizer_step_is_not_recompiled_by_capture(tmp_path, fresh_dynamo):
    """PyTorch's "compiling the optimizer" recipe: gpuprof's optimizer hooks run inside the compiled
    step, eagerly. Traced, they would recompile it as gpuprof's state changes (update-ratio steps, a
    bad step's kept state), which `error_on_recompile` turns into an error in the loop."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))  # a tensor lr: no recompile on change

    @torch.compile(backend="eager")
    def optimizer_step():
        optimizer.step()

    with torch._dynamo.config.patch(error_on_recompile=True), \
            gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(4):
            optimizer.param_groups[0]["lr"].fill_(1e30 if step == 1 else 1e-3)  # step 2 then overflows
            inputs = batch(step)
            logits = model(input_ids=inputs).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs[:, 1:].flatten()).backward()
            optimizer_step()
            optimizer.zero_grad()
            prof.step()
    run = gpuprof.load_run(tmp_path / "run")
    assert (run.steps["optimizer_time_s"] > 0).all()
    assert run.events[run.events["kind"] == "nonfinite"]["step"].tolist() == [2]


def test_a_compiled_training_step_keeps_its_norms_and_blames(tmp_path, fresh_dynamo):
    """Forward, loss, backward, clip and update in one compiled function: the clip runs inside a graph,
    so gpuprof takes the norm before it from the second step on (the first records none rather than
    the clipped norm), its loss window is not recompiled by the compiled code's calls, and a bad
    update is still blamed on the next step's forward."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))

    @torch.compile(backend="eager")
    def train_step(inputs):
        logits = model(input_ids=inputs).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs[:, 1:].flatten()).backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        return total

    with torch._dynamo.config.patch(error_on_recompile=True), \
            gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        totals = []
        for step in range(4):
            optimizer.param_groups[0]["lr"].fill_(1e30 if step == 2 else 1e-3)
            totals.append(float(train_step(batch(step))))
            prof.step()
    run = gpuprof.load_run(tmp_path / "run")
    norms = run.steps["grad_norm"].tolist()
    assert math.isnan(norms[0]) and norms[1:3] == pytest.approx(totals[1:3], rel=1e-5)
    [event] = events(tmp_path / "run", "nonfinite")
    assert (event["step"], event["phase"]) == (3, "forward")
    assert event["cause"]["step"] == 2 and event["cause"]["lr"] == pytest.approx(1e30)  # read from the tensor lr


class HooklessSGD:
    """An optimizer-like object the loop steps, without torch.optim's step hooks."""

    def __init__(self, params, lr: float):
        self.param_groups = [{"params": list(params), "lr": lr}]

    @torch.no_grad()
    def step(self):
        for param in self.param_groups[0]["params"]:
            param.add_(param.grad, alpha=-self.param_groups[0]["lr"])

    def zero_grad(self):
        for param in self.param_groups[0]["params"]:
            param.grad = None


@pytest.mark.parametrize("bad", ["model", "optimizer"])
def test_what_cannot_be_hooked_is_said_once_and_capture_goes_on(tmp_path, bad):
    model = tiny_model()
    optimizer = HooklessSGD(model.parameters(), lr=1e-3) if bad == "optimizer" else torch.optim.SGD(
        model.parameters(), lr=1e-3)

    def forward(inputs):  # a plain function standing for the model
        return model(input_ids=inputs, labels=inputs).loss

    given = forward if bad == "model" else model
    with gpuprof.profile(tmp_path / "run", model=given, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(3):
            loss = forward(batch(step))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss)
    run = gpuprof.load_run(tmp_path / "run")
    assert run.steps["step"].tolist() == [0, 1, 2] and run.steps["loss"].notna().all()
    assert run.events["kind"].tolist() == ["phase_unavailable"]
    lost = {"model": ["data", "forward", "backward"], "optimizer": ["optimizer"]}[bad]
    assert run.events["details"].iloc[0]["phases"] == lost
    kept = [f"{name}_time_s" for name in ("data", "forward", "backward", "optimizer") if name not in lost]
    assert run.steps[[f"{name}_time_s" for name in lost]].isna().all().all()
    assert (run.steps[kept] > 0).all().all()
    assert run.meta["status"] == "finished"


class TwoBranches(torch.nn.Module):
    """Steps before `switch_at` go through branch a only, later ones through branch b only."""

    def __init__(self, switch_at: int):
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        self.b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        self.switch_at, self.calls = switch_at, 0

    def forward(self, x):
        self.calls += 1
        return (self.a if self.calls <= self.switch_at else self.b)(x).sum()


def test_a_backward_pass_that_leaves_the_watched_parameters_is_seen_again_a_step_later(tmp_path):
    """After the first pass only two parameters keep an end-of-backward hook. A pass that reaches none of
    them loses that step's backward end (and gradient norms); the next step is seen again."""
    model = TwoBranches(switch_at=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for _ in range(6):
            model(torch.randn(4, 8)).backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    steps = gpuprof.load_run(tmp_path / "run").steps
    seen = steps["grad_norm"].notna().tolist()
    assert seen == [True, True, True, False, True, True]
    assert steps["backward_time_s"].notna().tolist() == seen
