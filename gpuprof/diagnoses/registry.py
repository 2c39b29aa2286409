"""The rule registry: `@rule` registers a check, `diagnose(run)` runs them all and ranks the findings.

A rule is a function `check(ctx: RunContext) -> Finding | list[Finding] | None`, kept in
its own module under `gpuprof/diagnoses/rules/`, registered with its category (what bound of
the step it speaks to, `CATEGORIES`), which every finding it returns carries. A rule marked
`gpu_only` needs a fact only a GPU run records (tensor cores, NVML samples) and is not run on CPU runs.
A rule marked `on_trace` reads only what a bare torch.profiler trace records (`TraceContext`): it
runs on runs and on traces alike, written once; the others run on gpuprof runs only.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import warnings
from dataclasses import dataclass, replace
from typing import Callable

from gpuprof.diagnoses.context import Context, RunContext
from gpuprof.diagnoses.finding import CATEGORIES, Finding

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rule:
    id: str
    category: str
    check: Callable[[Context], "Finding | list[Finding] | None"]
    gpu_only: bool
    on_trace: bool = False

    def findings(self, ctx: Context) -> list[Finding]:
        if (self.gpu_only and not ctx.on_gpu) or (ctx.bare_trace and not self.on_trace):
            return []
        result = self.check(ctx)
        if result is None:
            return []
        found = [result] if isinstance(result, Finding) else list(result)
        return [replace(finding, category=self.category) for finding in found]


RULES: dict[str, Rule] = {}


def rule(rule_id: str, category: str, *, gpu_only: bool = False, on_trace: bool = False):
    """Register `check` under `rule_id` (kebab-case, stable: it appears in --json output) in `category`;
    `on_trace`: it also runs on a bare trace."""
    if category not in CATEGORIES:
        raise ValueError(f"rule {rule_id!r}: category must be one of {CATEGORIES}, got {category!r}")

    def register(check):
        if rule_id in RULES:
            raise ValueError(f"rule {rule_id!r} registered twice")
        RULES[rule_id] = Rule(rule_id, category, check, gpu_only, on_trace)
        return check

    return register


def all_rules() -> list[Rule]:
    import gpuprof.diagnoses.rules as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    return [RULES[rule_id] for rule_id in sorted(RULES)]


def diagnose(run, *, strict: bool = False) -> list[Finding]:
    """Every finding about `run`, worth the most first (Finding.sort_key).

    A rule that fails on an unexpected run is skipped so one broken rule never hides the others,
    and said: a warning "gpuprof: rule X failed: ..."; `strict=True` (tests) raises instead.
    """
    failures: list[str] = []
    findings = diagnose_context(RunContext.of(run), strict=strict, failures=failures)
    for failure in failures:
        warnings.warn(f"gpuprof: {failure}", stacklevel=2)
    return findings


def diagnose_context(ctx: Context, *, strict: bool = False, failures: list[str]) -> list[Finding]:
    """The ranked findings; each rule that raised adds "rule X failed: ..." to `failures` (the report
    shows them in its notes and its verdict)."""
    findings = []
    for registered in all_rules():
        try:
            findings.extend(registered.findings(ctx))
        except Exception as error:  # noqa: BLE001 - one broken rule must not hide the others
            if strict:
                raise
            log.warning("rule %s failed on %s and was skipped", registered.id, ctx.summary.path, exc_info=True)
            failures.append(f"rule {registered.id} failed: {type(error).__name__}: {error}")
    return sorted(findings, key=lambda finding: finding.sort_key)
