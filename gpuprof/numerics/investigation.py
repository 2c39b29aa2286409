"""The forensic re-run of a bad step, from the state kept for it, and the replay bundle it writes.

`investigate` never raises: when the re-run cannot run or fails, what the flags saw is the
answer, with the reason in the notes (a detection is never lost to a forensic failure).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable

import torch

from gpuprof.modules import eager_model, is_sharded
from gpuprof.numerics import bundle, construction
from gpuprof.numerics.blame import EVALUATION_TRIGGER, NOT_REPRODUCED, Blame, at_the_update
from gpuprof.numerics.detectors import PERSISTENT_OVERFLOW_STEPS, nonfinite_update, oversized_update
from gpuprof.numerics.evaluation import Evaluation, evaluation_loss
from gpuprof.numerics.forensics import default_loss, load_state, private_copy, reenact
from gpuprof.numerics.keeping import StepKeeping
from gpuprof.numerics.state import StepInputs
from gpuprof.numerics.tape import VERIFY_EVERY, TapeError, encode_micro_batch
from gpuprof.optimizers import members, params_of, params_without_optimizer
from gpuprof.torch_compat import tree_map

logger = logging.getLogger("gpuprof")


STEPPED_DESPITE_SCALER = (
    "the GradScaler skipped the optimizers whose gradients it found non-finite, but another one stepped with "
    "non-finite gradients: the loop changed them after scaler.unscale_() (a clip over every optimizer's "
    "parameters spreads a non-finite total norm into all of them); clip each optimizer's parameters apart, "
    "or skip every optimizer's step when the total norm is not finite")


class Investigator:
    def __init__(self, keeping: StepKeeping, *, loss_fn: Callable | None, gradients, builder: dict | None,
                 run_dir: str, rank: int, device_type: str):
        self.model, self.optimizer, self.scaler = keeping.model, keeping.optimizer, keeping.scaler
        self.loss_fn = loss_fn
        self._keeping, self._gradients, self._builder = keeping, gradients, builder
        self._run_dir, self._rank, self._device_type = run_dir, rank, device_type

    def investigate(self, step: int, trigger: str, history) -> Blame:
        """Re-runs `step` from its kept state in forensic mode; writes the replay bundle.

        Never raises: what the flags saw is the answer when the re-run cannot run or fails,
        with the reason in the notes (a detection is never lost to a forensic failure)."""
        blame = Blame(step=step, rank=self._rank, trigger=trigger)
        return _never_raising(blame, lambda: self._reenact(step, blame, history))

    def investigate_evaluation(self, evaluation: Evaluation, history) -> Blame:
        """Re-runs the evaluation forward whose output was not finite, on the weights it ran on (those the update
        of step `evaluation.after_step` left: no training step changed them since), and writes its replay bundle.
        Never raises, as investigate()."""
        blame = Blame(step=evaluation.after_step, rank=self._rank, trigger=EVALUATION_TRIGGER)
        return _never_raising(blame, lambda: self._reenact_evaluation(evaluation, blame, history))

    def discard(self, blame: Blame) -> None:
        """Removes the bundle (and model file) of a blame that will not be reported."""
        for path in (blame.bundle, f"{blame.bundle}.model") if blame.bundle else ():
            with contextlib.suppress(OSError):
                os.remove(path)

    def _reenact_evaluation(self, evaluation: Evaluation, blame: Blame, history) -> Blame:
        model, _, _ = private_copy(self.model, None, None)
        inputs = StepInputs(step=blame.step, rng=evaluation.rng, hyper=[], other_device={}, non_tensor={},
                            training=False, autocast=evaluation.autocast)
        # copies: the evaluation's own may be inference tensors (torch.inference_mode), which autograd refuses
        batch = tree_map(lambda value: value.clone() if isinstance(value, torch.Tensor) else value, evaluation.batch)
        contents = self._bundle_contents(model, None, None, inputs, [batch], EVALUATION_TRIGGER)
        found = reenact(model, None, None, evaluation_loss, [batch], inputs, rank=blame.rank)
        found.trigger = blame.trigger
        found.notes.append(f"an evaluation (a forward with gradients off) right after step {blame.step}'s update "
                           "went non-finite, with no training step after it: its forward was re-run on the weights "
                           "that update left")
        after = {"step": blame.step + 1, "param_absmax": self._keeping.weight_sample_absmax(), "lrs": None}
        found.cause = oversized_update([*history, after], blame.step + 1)
        if not found.reproduced:
            found.notes.append(NOT_REPRODUCED + "the re-run of the evaluation stayed finite (a non-deterministic "
                               "kernel, or state changed outside the model)")
        self._save_bundle(found, contents)
        return found

    def _reenact(self, step: int, blame: Blame, history) -> Blame:
        if is_sharded(self.model):
            origin = self._gradients.nonfinite_origin(step) if self._gradients is not None else None
            blame = _sharded_blame(blame, origin)
            blame.cause = oversized_update(history, step)  # from this rank's shards, which an update grows too
            return blame
        inputs = self._keeping.inputs_of(step)
        state = self._keeping.state_before(step)
        placement = self._keeping.placement_at(step)
        blame.kept_state = placement.describe() if placement is not None else None
        if state is None:
            why = f"over the memory budget: {placement.reason}" if placement is not None and not placement.kept \
                else "numerics keep_state off?"
            blame.notes.append(f"{NOT_REPRODUCED}the state before this step was not kept ({why})")
            return blame
        if placement is not None and placement.what == "parameters":
            blame.notes.append("the optimizer's state was not kept, only the parameters and buffers (over the memory "
                               f"budget: {placement.reason}): the re-run starts the optimizer afresh, so an "
                               "update's blame (phase 'optimizer') may differ")
        micro_batches, loss_fn, loss_kind, missing = self._replay_plan(inputs)
        blame.notes += missing
        model, optimizer, scaler = private_copy(self.model, self.optimizer, self.scaler)
        load_state(model, optimizer, scaler, state, inputs)
        contents = self._bundle_contents(model, optimizer, scaler, inputs, micro_batches, loss_kind)
        found = reenact(model, optimizer, scaler, loss_fn, micro_batches, inputs, rank=blame.rank)
        found.trigger, found.notes, found.kept_state = blame.trigger, blame.notes + found.notes, blame.kept_state
        found.cause = nonfinite_update(history, step) or oversized_update(history, step)
        self._explain(found, inputs)
        if at_the_update(found).step != step:
            found.notes.append(f"{found.tensor} was already non-finite as step {step} began; the weights were "
                               f"finite as step {found.step} began and not right after its update, its loss and "
                               "gradients finite: that update made them so (not re-run: the state before it was not "
                               "kept)")
        self._save_bundle(found, contents)
        return found

    def _save_bundle(self, blame: Blame, contents: dict[str, Any]) -> None:
        path = bundle.bundle_path(self._run_dir, blame.step, blame.rank)
        try:
            builder, model = contents["builder"], contents.pop("model")
            if builder is not None and builder["name"] == construction.SNIPPET:
                builder["config"]["model_file"] = construction.save_model(model, str(path) + ".model")
            blame.replay_with = replay_command(str(path), builder)
            bundle.save(path, {**contents, "blame": {**blame.details(), "bundle": str(path)}})
            blame.bundle = str(path)
        except Exception as error:  # noqa: BLE001 - the blame stands without its bundle
            blame.notes.append(f"no replay bundle: writing {path} failed ({error!r})")

    def _explain(self, blame: Blame, inputs: StepInputs) -> None:
        if blame.trigger == "scaler_overflow":
            blame.notes.append(f"GradScaler skipped {PERSISTENT_OVERFLOW_STEPS}+ steps in a row up to here (or its "
                               "scale fell below 1); skipped steps leave the weights as they were")
        if blame.trigger == "grads" and self.scaler is not None:  # with a scaler, only a step it did not skip
            blame.notes.append(STEPPED_DESPITE_SCALER)
        if inputs.updated_first:
            blame.notes.append("the state was kept after this step's update, since its gradients were finite "
                               "(numerics keep_state 'when_bad'): if the update itself overflowed it shows as "
                               "phase 'state'; keep_state='every_step' replays it exactly")
        outside = params_without_optimizer(self.model, self.optimizer) if self.optimizer is not None else []
        if outside:
            blame.notes.append(f"{len(outside)} trainable parameters ({outside[0]}, ...) are in none of the "
                               "optimizers gpuprof was given: if another optimizer updates them, the kept state "
                               "may already hold its update; pass every one (optimizer=[...])")
        if not blame.reproduced:
            blame.notes.append(NOT_REPRODUCED + "the re-run stayed finite (a non-deterministic kernel, or state "
                               "changed outside the model, optimizer and scaler)")

    def _replay_plan(self, inputs: StepInputs) -> tuple[list, Any, str, list[str]]:
        """(micro-batches, loss function, loss kind for the bundle, notes on what could not be kept)."""
        if inputs.batch is not None:
            batches = inputs.batch if isinstance(inputs.batch, list) else [inputs.batch]
            return batches, self.loss_fn or default_loss, "custom" if self.loss_fn else "default", []
        tape = inputs.tape
        if tape is not None and tape.replayable:
            assumed = [] if tape.assumed_from is None else [
                f"backward() was taken to run on the model's own output, as gpuprof saw it do at step "
                f"{tape.assumed_from} (checked every {VERIFY_EVERY} steps)"]
            return list(tape.micro_batches), default_loss, "program", assumed
        why = tape.error if tape is not None and tape.error else "no backward() was seen after the model's forward"
        return list(tape.calls if tape is not None else []), default_loss, "default", [
            f"the loss computation was not recorded ({why}): re-run as model(...).loss; "
            "pass loss_fn= and prof.step(batch=...) to replay a custom loss"]

    def _bundle_contents(self, model, optimizer, scaler, inputs, micro_batches, loss_kind) -> dict[str, Any]:
        names = {id(p): n for n, p in model.named_parameters()}
        if loss_kind == "program":
            try:
                micro_batches = [encode_micro_batch(micro) for micro in micro_batches]
            except TapeError as error:
                micro_batches, loss_kind = [], f"unavailable: {error}"
        return bundle.to_host({
            "step": inputs.step, "rank": self._rank, "device_type": self._device_type,
            "model_state": model.state_dict(),
            "optimizer": _optimizer_entry(optimizer, names),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": inputs.rng, "micro_batches": micro_batches, "loss": loss_kind,
            "inputs": {"training": inputs.training, "autocast": inputs.autocast},
            "builder": self._builder or bundle.builder_for(model) or construction.builder_for(eager_model(self.model)),
            "model": model,  # pickled beside the bundle where no builder can rebuild it; never in it
        })


def replay_command(path: str, builder: dict[str, Any] | None) -> str:
    """What re-runs the bundle at `path`: `gpuprof replay PATH` where the command line can rebuild its model, else
    the Python that replays it (construction.replay_snippet)."""
    if builder is not None and builder.get("name") != construction.SNIPPET:
        return f"gpuprof replay {path}"
    return construction.replay_snippet(path, (builder or {}).get("config") or {})


def _never_raising(blame: Blame, reenact_step: Callable[[], Blame]) -> Blame:
    """reenact_step(), or `blame` (what the flags saw) with the reason when it fails."""
    try:
        return reenact_step()
    except Exception as error:  # noqa: BLE001 - our failure, not the user's: report it, keep going
        logger.warning("gpuprof: forensic re-run of step %d failed: %r", blame.step, error)
        blame.notes.append(f"{NOT_REPRODUCED}the forensic re-run failed ({error!r})")
        return blame


def _optimizer_entry(optimizer, names: dict[int, str]) -> dict[str, Any] | list[dict[str, Any]] | None:
    """Each optimizer's class, state_dict and parameter names; a list when the loop steps several."""
    entries = [{"class": type(member).__name__, "state_dict": member.state_dict(),
                "params": [names[id(p)] for p in params_of(member)]}
               for member in members(optimizer)]
    return entries if len(entries) > 1 else entries[0] if entries else None


def _sharded_blame(blame: Blame, origin: tuple[int, str] | None) -> Blame:
    """A sharded model (FSDP2): the re-run needs every rank's shards in one process, so the flags answer."""
    if origin is not None:
        blame.rank, blame.tensor = origin
        blame.notes.append(f"rank {blame.rank} held the first non-finite gradient shard, of {blame.tensor}")
    blame.notes.append(NOT_REPRODUCED + "the model is sharded (DTensor parameters, e.g. FSDP2) and the forensic "
                       "re-run runs on one process with the whole model")
    return blame
