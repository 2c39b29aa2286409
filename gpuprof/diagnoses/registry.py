"""The rule registry: `@rule` registers a check, `diagnose(run)` runs them all and ranks the findings.

A rule is a function `check(ctx: RunContext) -> Finding | list[Finding] | None`, kept in
its own module under `gpuprof/diagnoses/rules/`, registered with its category (what bound of
the step it speaks to, `CATEGORIES`), which every finding it returns carries. A rule marked
`gpu_only` needs a fact only a GPU run records (tensor cores, NVML samples) and is not run on CPU runs.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from dataclasses import dataclass, replace
from typing import Callable

from gpuprof.diagnoses.context import RunContext
from gpuprof.diagnoses.finding import CATEGORIES, Finding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    id: str
    category: str
    check: Callable[[RunContext], "Finding | list[Finding] | None"]
    gpu_only: bool

    def findings(self, ctx: RunContext) -> list[Finding]:
        if self.gpu_only and not ctx.on_gpu:
            return []
        result = self.check(ctx)
        if result is None:
            return []
        found = [result] if isinstance(result, Finding) else list(result)
        return [replace(finding, category=self.category) for finding in found]


RULES: dict[str, Rule] = {}


def rule(rule_id: str, category: str, *, gpu_only: bool = False):
    """Register `check` under `rule_id` (kebab-case, stable: it appears in --json output) in `category`."""
    if category not in CATEGORIES:
        raise ValueError(f"rule {rule_id!r}: category must be one of {CATEGORIES}, got {category!r}")

    def register(check):
        if rule_id in RULES:
            raise ValueError(f"rule {rule_id!r} registered twice")
        RULES[rule_id] = Rule(rule_id, category, check, gpu_only)
        return check

    return register


def all_rules() -> list[Rule]:
    import gpuprof.diagnoses.rules as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    return [RULES[rule_id] for rule_id in sorted(RULES)]


def diagnose(run, *, strict: bool = False) -> list[Finding]:
    """Every finding about `run`, most severe first, then by expected gain.

    A rule that fails on an unexpected run is logged and skipped so one broken rule
    never hides the others; `strict=True` (tests) raises instead.
    """
    return diagnose_context(RunContext.of(run), strict=strict)


def diagnose_context(ctx: RunContext, *, strict: bool = False) -> list[Finding]:
    findings = []
    for registered in all_rules():
        try:
            findings.extend(registered.findings(ctx))
        except Exception:
            if strict:
                raise
            log.warning("rule %s failed on %s and was skipped", registered.id, ctx.summary.path, exc_info=True)
    return sorted(findings, key=lambda finding: finding.sort_key)
