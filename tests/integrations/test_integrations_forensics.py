"""NaN forensics through every way in: the Hugging Face Trainer and Lightning callbacks, an Accelerate
loop and `gpuprof run` on an unmodified script. Each gets the blame the same fault gets in a plain loop
(tests/numerics): the step, pass, module, op and first value."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from accelerate import Accelerator
from lightning_gpt2 import TinyGpt2Module, quiet_trainer
from numerics.numerics_helpers import events
from test_integrations_run import HERE, gpuprof_run
from tiny_gpt2 import BATCH, RandomTokens, muon_and_adamw, tiny_model
from transformers import Trainer, TrainerCallback, TrainingArguments

import gpuprof
from gpuprof.integrations.lightning import GpuprofCallback as LightningCallback
from gpuprof.integrations.transformers import GpuprofCallback as TrainerGpuprofCallback
from gpuprof.workloads.gpt2.faults import Injector, parse

FAULT_STEP = 2
# sqrt-zero: the last block's MLP gate turns its input to 0, so only the backward pass goes non-finite
SQRT_ZERO = (FAULT_STEP, "backward", "transformer.h.1.mlp", "aten::div", "inf")


def blame(run_dir) -> tuple:
    [event] = events(run_dir, "nonfinite")
    return event["step"], event["phase"], event["module"], event["op"], event["first"]


def test_a_trainer_run_gets_the_blame(tmp_path):
    injector = Injector([parse(f"sqrt-zero@{FAULT_STEP}")])
    model = injector.prepare_model(tiny_model())

    class Fault(TrainerCallback):  # the user's own code, breaking the model at a step
        def on_step_begin(self, args, state, control, **kwargs):
            injector.before_step(state.global_step, model)

    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=2, max_steps=FAULT_STEP + 1, report_to=[], use_cpu=True,
                             save_strategy="no", max_grad_norm=1.0, learning_rate=1e-3)
    Trainer(model=model, args=args, train_dataset=RandomTokens(),
            callbacks=[Fault(), TrainerGpuprofCallback(sample_interval_s=0)]).train()
    assert blame(tmp_path / "out" / "gpuprof") == SQRT_ZERO


def faulty_lightning_fit(tmp_path, steps: int, accumulation: int, **callback_options) -> TinyGpt2Module:
    """A Lightning fit whose own callback breaks the model's MLP gate (sqrt-zero) at FAULT_STEP."""
    injector = Injector([parse(f"sqrt-zero@{FAULT_STEP}")])
    module = TinyGpt2Module()
    injector.prepare_model(module.model)

    class Fault(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            injector.before_step(trainer.global_step, pl_module.model)

    loader = torch.utils.data.DataLoader(RandomTokens(), batch_size=BATCH)
    callback = LightningCallback(tmp_path / "run", sample_interval_s=0, **callback_options)
    quiet_trainer(max_steps=steps, accumulate_grad_batches=accumulation, default_root_dir=tmp_path,
                  callbacks=[Fault(), callback]).fit(module, loader)
    return module


def test_a_lightning_fit_gets_the_blame(tmp_path):
    faulty_lightning_fit(tmp_path, steps=FAULT_STEP + 1, accumulation=2)
    step, phase, module_name, op, first = SQRT_ZERO  # the module as the LightningModule holds it
    assert blame(tmp_path / "run") == (step, phase, f"model.{module_name}", op, first)


def test_an_accelerate_loop_gets_the_blame(tmp_path):
    injector = Injector([parse(f"sqrt-zero@{FAULT_STEP}")])
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = injector.prepare_model(tiny_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(RandomTokens(n_items=2 * (FAULT_STEP + 1) * BATCH), batch_size=BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, loader=loader,
                         sample_interval_s=0) as prof:
        for batch in loader:
            injector.before_step(prof.step_index, model)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                prof.step(loss=loss.detach())
    assert blame(tmp_path / "run") == SQRT_ZERO


def test_an_unmodified_script_under_gpuprof_run_gets_the_blame(tmp_path):
    """The script writes a NaN into its embedding before its step 3, which is the run's step 3 (the
    run records from the script's first iteration)."""
    done = gpuprof_run("--run-dir", tmp_path / "run", HERE / "tiny_gpt2.py", "--steps", "4",
                       "--nan-embedding-at", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert blame(tmp_path / "run") == (3, "state", "transformer.wte", None, "nan")


def test_the_skip_policy_undoes_lightnings_bad_updates(tmp_path):
    """Lightning's optimizer step runs forward and backward inside step(closure): the bad gradients are
    only there after it, and the update they made is undone then."""
    module = faulty_lightning_fit(tmp_path, steps=FAULT_STEP + 2, accumulation=1, on_nonfinite="skip")
    assert all(torch.isfinite(param).all() for param in module.parameters())  # every bad update undone
    assert blame(tmp_path / "run")[:2] == (FAULT_STEP, "backward")


class ManualMuonAdamW(TinyGpt2Module):
    """Manual optimization, the only way Lightning steps two optimizers: Muon beside AdamW, the
    closure form for the first (as Lightning's docs show it) and a plain step for the second."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        muon, adamw = self.optimizers()

        def closure():
            loss = self.model(**batch).loss
            muon.zero_grad()
            adamw.zero_grad()
            self.manual_backward(loss)
            self.step_losses.append(loss.item())
            return loss

        muon.step(closure=closure)
        adamw.step()

    def configure_optimizers(self):
        return muon_and_adamw(self.model)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")
def test_a_lightning_fit_with_manual_optimization_and_two_optimizers_gets_the_blame(tmp_path):
    injector = Injector([parse(f"sqrt-zero@{FAULT_STEP}")])
    module = ManualMuonAdamW()
    injector.prepare_model(module.model)

    class Fault(L.Callback):  # by batch: each of the two optimizers' steps counts in global_step
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            injector.before_step(batch_idx, pl_module.model)

    loader = torch.utils.data.DataLoader(RandomTokens(), batch_size=BATCH)
    callback = LightningCallback(tmp_path / "run", sample_interval_s=0)
    quiet_trainer(max_steps=2 * (FAULT_STEP + 1), default_root_dir=tmp_path,
                  callbacks=[Fault(), callback]).fit(module, loader)
    step, phase, module_name, op, first = SQRT_ZERO
    assert blame(tmp_path / "run") == (step, phase, f"model.{module_name}", op, first)
    run = gpuprof.load_run(tmp_path / "run")
    assert [member["class"] for member in run.meta["loop"]["optimizer"]["members"]] == ["Muon", "AdamW"]
    assert run.steps["step"].tolist() == list(range(FAULT_STEP + 1))
