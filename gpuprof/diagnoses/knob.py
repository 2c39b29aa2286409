"""Knobs: a rule's fix, declared as a small patch that `gpuprof run --knob NAME` applies from outside
the script, so that `gpuprof tune` can measure what the fix is worth.

A knob lives next to the rule that recommends it (gpuprof/diagnoses/rules/), registered with

    @knob("loader-workers", rule="dataloader-bound", train_flags=("--num-workers", "2"))
    def loader_workers(patch):
        \"\"\"What it changes, for people (the docstring is its documentation).\"\"\"
        patch.keywords(...)          # or patch.setting / patch.environment / patch.model

`patch` is the child process's `gpuprof.integrations.knobs.KnobPatch`: every change goes through it,
so that each one is undone when the script ends and recorded as the edit a user would make to their
own script (`gpuprof.tune.edits`). `train_flags` are the same change made through `gpuprof train`'s
flags, for the reference workload; a knob without them has no flag there. Nothing here imports torch:
a knob's function imports what it patches when it runs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Knob:
    name: str
    rule: str
    apply: Callable
    train_flags: tuple[str, ...] = ()

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.apply) or ""

    @property
    def summary(self) -> str:
        """The first sentence of its documentation."""
        return self.doc.split("\n\n")[0].replace("\n", " ")


KNOBS: dict[str, Knob] = {}


def knob(name: str, *, rule: str, train_flags: tuple[str, ...] = ()):
    """Register `apply(patch)` as knob `name` (kebab-case, stable: `--only NAME`, --json), the fix of `rule`."""

    def register(apply):
        if name in KNOBS:
            raise ValueError(f"knob {name!r} registered twice")
        KNOBS[name] = Knob(name, rule, apply, tuple(train_flags))
        return apply

    return register


def all_knobs() -> dict[str, Knob]:
    """Every knob, by name (importing the rules registers them)."""
    from gpuprof.diagnoses.registry import all_rules

    all_rules()
    return dict(sorted(KNOBS.items()))


def knobs_of(rule_id: str) -> list[Knob]:
    return [found for found in all_knobs().values() if found.rule == rule_id]
