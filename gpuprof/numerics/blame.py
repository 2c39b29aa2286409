"""The answer of a forensic re-run: where a value first went non-finite, as one event.

`Blame` is the one definition of the event's fields; the run's events stream, the
replay bundle and `gpuprof replay` all print or store it through this module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

NOT_REPRODUCED = "not reproduced: "  # how a note giving the reason for no blame starts
EVALUATION_TRIGGER = "evaluation"  # a Blame's trigger, and its bundle's loss kind (replayed with evaluation_loss)


@dataclass
class Blame:
    step: int
    rank: int
    phase: str | None = None  # one of run.schema.BLAME_PHASES; None when the re-run stayed finite
    module: str | None = None  # fully qualified module name; None outside any module
    op: str | None = None  # aten op, e.g. "aten::bmm"
    first: str | None = None  # "inf" or "nan"
    dtype: str | None = None
    shape: list[int] | None = None
    nonfinite_count: int | None = None
    input_absmax: float | None = None
    source: str | None = None  # "path.py:123 in function: code", the user's line
    library_source: str | None = None  # an installed library's line that ran the op, behind `source`
    micro_batch: int | None = None
    tensor: str | None = None  # the parameter / optimizer-state entry, for phase state/optimizer
    # what the always-on flags saw: "loss", "backward_loss" (a loss backward() ran on that the loop did not
    # pass to prof.step()), "grads", "params", "optimizer_state", "scaler_overflow", "evaluation" (the output of an
    # evaluation forward after the step's update: numerics.evaluation)
    trigger: str | None = None
    cause: dict[str, Any] | None = None  # an earlier step to look at, e.g. an oversized update
    bundle: str | None = None
    replay_with: str | None = None  # the command (or Python) that re-runs the bundle (investigation.replay_command)
    kept_state: str | None = None  # keep_state "when_bad": what of the state was kept where (numerics budget.py)
    notes: list[str] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        return self.phase is not None

    def details(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_details(cls, details: dict[str, Any]) -> "Blame":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in details.items() if key in known})

    def message(self) -> str:
        """One line for people: "step N: " and `what_and_where`."""
        return f"step {self.step}: {self.what_and_where()}"

    def what_and_where(self) -> str:
        """What went non-finite, where, and in which pass (and the cause found)."""
        if not self.reproduced:
            why = next((note.removeprefix(NOT_REPRODUCED) for note in self.notes if note.startswith(NOT_REPRODUCED)),
                       "no blame")
            return f"non-finite {self.trigger or 'value'}; not reproduced: {why}"
        where = self.module or "outside any module"
        what = f"first {self.first} from {self.op}" if self.op else f"{self.first} in {self.tensor}"
        line = f"{what} ({self.phase}, {where})"
        if self.cause:
            line += f"; {self.cause['summary']}"
        return line


def at_the_update(blame: Blame) -> Blame:
    """`blame`, moved to the update that wrote its value: a tensor of the weights or optimizer state found non-finite
    as the step began (phase "state"), which the previous step's update made so (its cause, kind "nonfinite_update",
    numerics.detectors) is blamed on that update (phase "optimizer"), where it first went non-finite. Neither the
    forensic re-run nor a replay runs that update again: the state before it was not kept."""
    cause = blame.cause or {}
    if blame.phase == "state" and blame.tensor not in (None, "batch") and cause.get("kind") == "nonfinite_update":
        blame.step, blame.phase = cause["step"], "optimizer"
    return blame


def format_blame(blame: Blame) -> str:
    """The multi-line report `gpuprof replay` and the docs show."""
    rows = [("step", blame.step), ("rank", blame.rank), ("trigger", blame.trigger),
            ("phase", blame.phase), ("module", blame.module or "(none: outside any module)"),
            ("op", blame.op), ("first", blame.first), ("tensor", blame.tensor),
            ("dtype", blame.dtype), ("shape", blame.shape), ("non-finite", blame.nonfinite_count),
            ("input abs-max", _number(blame.input_absmax)), ("micro-batch", blame.micro_batch),
            ("source", blame.source), ("in a library", blame.library_source), ("kept state", blame.kept_state)]
    lines = [f"non-finite value at step {blame.step}" if blame.reproduced else blame.message()]
    lines += [f"  {name:<14}{value}" for name, value in rows if value is not None]
    if blame.cause:
        lines.append(f"  {'cause':<14}{blame.cause['summary']}")
    lines += [f"  note: {note}" for note in blame.notes]
    return "\n".join(lines)


def _number(value: float | None) -> str | None:
    return None if value is None else f"{value:.4g}"
