"""NaN forensics on loops written the way users write them: the loss computed outside the model,
no `loss_fn`, no `prof.step(batch=...)`. Every fault the workload can inject gets the same blame
as in the workload, and a detection is never lost when the re-run cannot blame anything."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from numerics_helpers import FAULT_CASES, VOCAB, events, started_tape
from transformers import GPT2Config, GPT2LMHeadModel

import gpuprof
from gpuprof.cli import main
from gpuprof.workloads.gpt2.faults import SPIKED_LR, Injector, parse

pytestmark = pytest.mark.newest_torch  # run again on the newest torch tested (scripts/test.sh)

SEQ, BATCH = 16, 2
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
REPLAYED_FROM_BUNDLE = {("attn-overflow@1", "fp16"), ("ignored-labels@1", "fp32"), ("lr-spike@1", "fp32"),
                        ("embedding-nan@1", "bf16")}


def user_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                        eos_token_id=0, attn_implementation="eager")
    return GPT2LMHeadModel(config)


def nanogpt_loop(run_dir, *, steps: int, precision: str = "fp32", accumulation: int = 1, fault: str | None = None,
                 model=None, lr_before_update: bool = False, **profile_options) -> list[float]:
    """A nanoGPT-style loop: logits from the model, F.cross_entropy outside it, GradScaler for fp16.
    `fault` is one of the workload's faults (FAULT@STEP), applied to this loop's own model. The step's lr is
    set before its forward, as nanoGPT does, or with `lr_before_update` after its backward, as llm.c does."""
    injector = Injector([parse(fault)] if fault else [])
    model = injector.prepare_model(model if model is not None else user_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=precision == "fp16")
    dtype = DTYPES[precision]
    generator = torch.Generator().manual_seed(1)
    losses = []
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, scaler=scaler, sample_interval_s=0,
                         **profile_options) as prof:
        def set_lr(step):
            for group in optimizer.param_groups:
                group["lr"] = injector.lr(step, 1e-3)

        for step in range(steps):
            if not lr_before_update:
                set_lr(step)
            injector.before_step(step, model)
            for _ in range(accumulation):
                x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
                y = injector.targets(step, x.roll(-1, 1))
                with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                    logits = model(x).logits
                    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
                scaler.scale(loss / accumulation).backward()
            if lr_before_update:
                set_lr(step)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach(), tokens=x.numel() * accumulation)
            losses.append(float(loss.detach()))
    return losses


def zero_weight_loss(model, bad_step: int):
    """`loss_at(step)` for plain_loop: a class-weighted cross entropy of an 8 -> 4 model, every class weighted 0 at
    `bad_step` (a weighted mean over zero weight: 0/0, NaN in the loss op itself)."""
    def loss_at(step):
        weights = torch.zeros(4) if step == bad_step else torch.ones(4)
        return F.cross_entropy(model(torch.randn(4, 8)), torch.randint(0, 4, (4,)), weight=weights)

    return loss_at


def plain_loop(run_dir, model, steps: int, loss_at) -> None:
    """The plainest loop: `loss_at(step)` computes the step's loss the user's way; SGD steps on it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(steps):
            loss = loss_at(step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss.detach())


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


@pytest.mark.parametrize("fault,precision,step,phase,module,op,first", FAULT_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in FAULT_CASES])
def test_fault_in_a_user_loop_is_blamed_exactly(tmp_path, capsys, fault, precision, step, phase, module, op, first):
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=step + 1, precision=precision, fault=fault)

    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == \
        (step, phase, module, op, first)
    if phase == "loss":
        assert "F.cross_entropy" in event["source"]  # the user's own line, not gpuprof's
    if (fault, precision) in REPLAYED_FROM_BUNDLE:  # a Hugging Face model: the CLI rebuilds it from the bundle
        capsys.readouterr()
        assert main(["replay", event["bundle"]]) == 0
        assert "same blame as recorded during training" in capsys.readouterr().out


@pytest.mark.parametrize("fault,precision,step,phase,module,op,first",
                         [case for case in FAULT_CASES if case[:2] in {("attn-overflow@1", "fp16"),
                                                                        ("sqrt-zero@1", "fp32")}],
                         ids=["forward-fault", "backward-fault"])
def test_activation_checkpointing_keeps_the_blame(tmp_path, fault, precision, step, phase, module, op, first):
    """Activation checkpointing (Hugging Face's switch): the forward of each block runs again inside
    backward, so the forensic re-run sees every block's forward twice; the blame still names the pass
    it failed in."""
    model = user_model()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()  # the name since transformers 5.x; the older one before
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=step + 1, precision=precision, fault=fault, model=model)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == \
        (step, phase, module, op, first)


def test_an_lr_set_after_the_backward_is_the_lr_the_cause_names(tmp_path):
    """The lr the cause names is the one the update ran with, read after it, not the one the step began with."""
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=3, fault="lr-spike@1", lr_before_update=True)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"]) == (2, "forward")
    assert (event["cause"]["step"], event["cause"]["lr"], event["cause"]["median_lr"]) == (1, SPIKED_LR, 1e-3)


def test_the_recorded_loss_is_the_one_before_grad_scaling():
    """At the first scaler.scale() the scale is made inside the recorded window; later it is a constant.
    Either way the micro-batch ends at the loss, not at loss * scale (the re-run scales it itself)."""
    from gpuprof.numerics.tape import LossCall

    model = user_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    tape = started_tape(model, optimizer, scaler)
    try:
        for _ in range(2):
            x = tokens()
            loss = F.cross_entropy(model(x).logits.flatten(0, 1), x.flatten())
            scaler.scale(loss).backward()
            [micro] = tape.take().micro_batches
            loss_call = micro.items[micro.target.item]
            assert isinstance(loss_call, LossCall) and loss_call.func is F.cross_entropy
    finally:
        tape.on_close(None)


def test_gradient_accumulation_blames_the_micro_batch(tmp_path):
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=2, accumulation=2, fault="ignored-labels@1")
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["op"], event["micro_batch"]) == \
        (1, "loss", "aten::nll_loss_forward", 0)


def test_an_overflowing_loss_scale_outside_the_model_is_a_loss_blame(tmp_path):
    """The loss itself overflows (x 1e39 in fp32) after the model's forward: phase loss, op mul."""
    model = user_model()

    def weighted_loss(step):
        x = tokens()
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), x.roll(-1, 1).flatten())
        weighted = loss * (1e39 if step == 2 else 1.0)
        return weighted  # noqa: RET504 - the test reads this line as the blamed source

    run_dir = tmp_path / "run"
    plain_loop(run_dir, model, 3, weighted_loss)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == \
        (2, "loss", None, "aten::mul", "inf")
    assert "weighted = loss *" in event["source"]


class Wrapper(torch.nn.Module):
    """Runs its child, then an op of its own: that op is the wrapper's, not the child's."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.register_buffer("gain", torch.ones(()))

    def forward(self, hidden):
        return torch.log(self.inner(hidden).abs() * self.gain + 1) - torch.log(self.gain)


def test_a_wrappers_own_op_is_blamed_on_the_wrapper(tmp_path):
    model = user_model()
    block = model.transformer.h[0]
    block.mlp = Wrapper(block.mlp)

    def loss_at(step):
        with torch.no_grad():
            block.mlp.gain.fill_(0.0 if step == 1 else 1.0)  # log(0) = -inf in the wrapper's own code
        x = tokens()
        return F.cross_entropy(model(x).logits.flatten(0, 1), x.flatten())

    run_dir = tmp_path / "run"
    plain_loop(run_dir, model, 2, loss_at)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["module"], event["op"], event["first"]) == \
        (1, "forward", "transformer.h.0.mlp", "aten::log", "inf")


class GoesBadOnce(torch.nn.Module):
    """Python-side state the re-run cannot restore: the NaN comes on one call only."""

    def __init__(self, inner: torch.nn.Module, bad_call: int):
        super().__init__()
        self.inner, self.calls, self.bad_call = inner, 0, bad_call

    def forward(self, hidden):
        self.calls += 1
        out = self.inner(hidden)
        return out * float("nan") if self.calls == self.bad_call else out


def test_a_fault_the_re_run_cannot_reproduce_is_still_an_event(tmp_path):
    model = user_model()
    block = model.transformer.h[1]
    block.mlp = GoesBadOnce(block.mlp, bad_call=2)
    run_dir = tmp_path / "run"
    nanogpt_loop(run_dir, steps=4, model=model)

    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["trigger"], event["phase"]) == (1, "loss", None)
    assert event["severity"] == "critical" and "not reproduced" in event["message"]
    assert any(note.startswith("not reproduced: the re-run stayed finite") for note in event["notes"])
    [later] = events(run_dir, "nonfinite_steps")  # the NaN reached the weights: later steps are counted
    assert later["count"] >= 1


class Uncopyable(torch.nn.Module):
    """A module the forensic copy cannot deep-copy: the re-run fails before it starts."""

    def __deepcopy__(self, memo):
        raise TypeError("this module cannot be copied")


def test_a_failed_re_run_is_a_note_and_switches_nothing_off(tmp_path):
    model = user_model()
    model.transformer.extra = Uncopyable()
    run_dir = tmp_path / "run"
    losses = nanogpt_loop(run_dir, steps=4, fault="ignored-labels@1", model=model)

    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["trigger"], event["phase"]) == (1, "loss", None)
    assert any("the forensic re-run failed" in note and "cannot be copied" in note for note in event["notes"])
    assert events(run_dir, "collector_disabled") == [] and events(run_dir, "profiler_disabled") == []
    assert losses[1] != losses[1] and all(loss == loss for loss in losses[2:])  # the NaN step, then training on


def test_recording_leaves_the_loop_untouched(tmp_path):
    """Same losses with and without NaN forensics, and no torch function mode left on the stack."""
    recorded = nanogpt_loop(tmp_path / "a", steps=3, accumulation=2)
    unrecorded = nanogpt_loop(tmp_path / "b", steps=3, accumulation=2, numerics=False)
    assert recorded == unrecorded
    assert torch._C._len_torch_function_stack() == 0


class WithPenalty(torch.nn.Module):
    """Keeps an auxiliary loss as an attribute (as mixture-of-experts models do), outside its output."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        logits = self.model(x).logits
        self.penalty = logits.pow(2).mean()
        return logits


def test_a_loss_gpuprof_cannot_see_still_gives_the_event_and_says_why(tmp_path):
    model = WithPenalty(user_model())

    def loss_at(step):
        x = tokens()
        logits = model(x)
        targets = torch.full_like(x, -100) if step == 1 else x
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) + 1e-3 * model.penalty

    run_dir = tmp_path / "run"
    plain_loop(run_dir, model, 2, loss_at)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["trigger"], event["phase"]) == (1, "loss", None)
    assert any("the loss computation was not recorded" in note and "computed by a call gpuprof cannot record"
               in note for note in event["notes"])
    assert any(note.startswith("not reproduced: the forensic re-run failed") for note in event["notes"])
    assert torch._C._len_torch_function_stack() == 0


@torch.compile(backend="aot_eager")
def compiled_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_compiled_loss_function_is_replayed(tmp_path):
    model = user_model()

    def loss_at(step):
        x = tokens()
        return compiled_loss(model(x).logits, torch.full_like(x, -100) if step == 1 else x)

    run_dir = tmp_path / "run"
    plain_loop(run_dir, model, 2, loss_at)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["op"]) == (1, "loss", "aten::nll_loss_forward")


def test_a_model_gpuprof_cannot_build_replays_from_python_with_its_recorded_loss(tmp_path, capsys):
    from gpuprof.numerics.replay import replay, same_blame

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))

    model = mlp()

    run_dir = tmp_path / "run"
    plain_loop(run_dir, model, 3, zero_weight_loss(model, bad_step=2))
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["op"]) == (2, "loss", "aten::nll_loss_forward")

    assert main(["replay", event["bundle"]]) == 2
    assert "cannot be rebuilt from the command line" in capsys.readouterr().err
    replayed, recorded = replay(event["bundle"], model=mlp())  # no loss_fn: the bundle holds the loss calls
    assert same_blame(replayed, recorded)


def labels_loop(run_dir, steps: int, *, bad_step: int, outside_from: int | None = None) -> None:
    """A Hugging Face loop: the model computes its loss from `labels=`; from step `outside_from` on, the
    loop computes it outside instead. At `bad_step` every target is ignored, so the loss is 0/0."""
    model = user_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(steps):
            x = tokens()
            y = torch.full_like(x, -100) if step == bad_step else x
            if outside_from is not None and step >= outside_from:
                logits = model(x).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), y[:, 1:].flatten())
            else:
                loss = model(x, labels=y).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss.detach())


def test_a_loss_the_model_computes_is_replayed_with_the_window_shut(tmp_path):
    """After DIRECT_AFTER steps of backward() on the model's own loss the tape stops recording calls
    after the forward (none pass through a mode), and the re-run still blames the loss exactly."""
    from gpuprof.numerics.tape import DIRECT_AFTER

    run_dir = tmp_path / "run"
    labels_loop(run_dir, steps=DIRECT_AFTER + 4, bad_step=DIRECT_AFTER + 3)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["op"], event["first"]) == \
        (DIRECT_AFTER + 3, "loss", "aten::nll_loss_forward", "nan")
    assert any(f"as gpuprof saw it do at step {DIRECT_AFTER - 1}" in note for note in event["notes"])


def test_a_loop_that_starts_computing_its_loss_outside_is_recorded_again(tmp_path):
    """The window opens again every VERIFY_EVERY steps: a loss moved outside the model is learned there,
    and a later bad step is blamed on the user's own line, with no assumption in its notes."""
    from gpuprof.numerics.tape import DIRECT_AFTER, VERIFY_EVERY

    run_dir = tmp_path / "run"
    bad_step = DIRECT_AFTER + VERIFY_EVERY + 2
    labels_loop(run_dir, steps=bad_step + 1, bad_step=bad_step, outside_from=DIRECT_AFTER + 1)
    [event] = events(run_dir, "nonfinite")
    assert (event["step"], event["phase"], event["op"]) == (bad_step, "loss", "aten::nll_loss_forward")
    assert "F.cross_entropy" in event["source"] and not any("as gpuprof saw it do" in n for n in event["notes"])


def test_the_loss_window_is_off_the_mode_stack_once_backward_returns(tmp_path):
    """Calls after backward() (clipping, logging) do not pass through gpuprof's mode."""
    model = user_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    depths = []
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for _ in range(3):
            x = tokens()
            loss = F.cross_entropy(model(x).logits.flatten(0, 1), x.flatten())
            depths.append(torch._C._len_torch_function_stack())
            loss.backward()
            depths.append(torch._C._len_torch_function_stack())
            optimizer.step()
            optimizer.zero_grad()
            prof.step(loss=loss.detach())
    assert depths == [1, 0] * 3
