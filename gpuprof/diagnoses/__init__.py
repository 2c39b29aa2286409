"""Diagnoses: small rules that turn a run into ranked findings with evidence and a fix."""

from gpuprof.diagnoses.finding import CATEGORIES, CATEGORY_TITLES, SEVERITIES, Finding
from gpuprof.diagnoses.registry import RULES, all_rules, diagnose, rule

__all__ = ["CATEGORIES", "CATEGORY_TITLES", "SEVERITIES", "Finding", "RULES", "all_rules", "diagnose", "rule"]
