"""docs/ARCHITECTURE.md names every module's one job, as the modules' own docstrings say it."""

from __future__ import annotations

from pathlib import Path

from repo_scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "module_map.py"


def test_every_module_says_its_job_and_the_architecture_document_lists_it_as_it_says():
    module_map = load_script(SCRIPT, "module_map")
    silent = [path.relative_to(module_map.ROOT).as_posix() for path in module_map.modules() if not module_map.job(path)]
    assert silent == []  # a module without a docstring has no job written down
    documented = module_map.documented_map(module_map.DOCUMENT.read_text())
    assert documented == module_map.module_map(), "run: python scripts/module_map.py --write"
