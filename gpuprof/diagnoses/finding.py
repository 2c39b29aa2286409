"""What a rule returns: one diagnosis with the numbers behind it and what to change."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gpuprof.run.jsonable import json_safe
from gpuprof.run.schema import SEVERITIES

# What bounds a step, and so what a rule speaks to: each rule has one category (the report's
# verdict names one of them). Title for people: "host" is the host and the launches it makes.
CATEGORY_TITLES = {
    "input": "input",
    "host": "host/launch",
    "compute": "compute",
    "communication": "communication",
    "memory": "memory",
    "numerics": "numerics",
    # not a bound: the run stopped (a hang, a rank that failed or died); the verdict says so first
    "failure": "a hang or a dead rank",
}
CATEGORIES = tuple(CATEGORY_TITLES)


# An expected gain this small (percent of step time) is no reason to act.
NEGLIGIBLE_GAIN_PCT = 1.0


@dataclass(frozen=True)
class Finding:
    """One diagnosis of a run.

    `evidence` holds the measured values that made the rule fire (units in the keys);
    `est_gain_pct` is the share of step time the fix is expected to save, or None when
    the rule cannot estimate it. `category` is its rule's (set by the registry).
    """

    rule: str
    severity: str
    title: str
    evidence: dict = field(default_factory=dict)
    fix: str = ""
    est_gain_pct: float | None = None
    category: str | None = None

    def __post_init__(self):
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")
        if self.category is not None and self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {self.category!r}")

    @property
    def worth_pct(self) -> float:
        """What acting on it is expected to save, in percent of step time: its estimated gain, 0 when negligible
        (at most NEGLIGIBLE_GAIN_PCT) or not estimated."""
        gain = self.est_gain_pct
        return gain if gain is not None and gain > NEGLIGIBLE_GAIN_PCT else 0.0

    @property
    def sort_key(self) -> tuple:
        """What it is worth: critical first (a run that stopped or went non-finite), then the largest expected gain,
        then severity, then rule id for a stable order."""
        critical = self.severity == SEVERITIES[0]
        return (not critical, -self.worth_pct, SEVERITIES.index(self.severity), self.rule)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["evidence"] = {key: json_safe(value) for key, value in self.evidence.items()}
        data["est_gain_pct"] = json_safe(self.est_gain_pct)
        return data

