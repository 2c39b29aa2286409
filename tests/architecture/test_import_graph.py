"""docs/ARCHITECTURE.md's promise, read from the code: the data flows one way, and presenters only render."""

from __future__ import annotations

import ast
import graphlib
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpuprof"
PRESENTERS = ("gpuprof.cli", "gpuprof.dashboard")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imported(path: Path) -> set[str]:
    """The gpuprof modules `path` imports anywhere in it (lazy imports inside functions too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gpuprof"):
            names |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module
                      for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names if alias.name.startswith("gpuprof")}
    return names & MODULES.keys()


def test_no_presenter_imports_the_analysis_layer():
    """The CLI and the dashboard read runs through the report (or the run reader), never the analyzers."""
    reaching = {name: sorted(module for module in imported(path) if module.startswith("gpuprof.analysis"))
                for name, path in MODULES.items() if name.startswith(PRESENTERS)}
    assert {name: modules for name, modules in reaching.items() if modules} == {}


def test_the_import_graph_has_no_circle():
    graph = {name: imported(path) - {name} for name, path in MODULES.items()}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the circle


def test_reading_a_run_imports_no_torch():
    """`gpuprof analyze`, `report` and the dashboard read runs without torch: importing it (dynamo included)
    took 2.8 s of a 4.6 s `gpuprof analyze` when a numerics rule reached it for a constant."""
    program = ("import sys; from gpuprof.cli import main; main(['analyze', sys.argv[1]]);"
               "from gpuprof.report import build_report; from gpuprof.dashboard.charts import run_panels;"
               "run_panels(build_report(sys.argv[1]).run, 0);"
               "sys.exit('torch imported' if 'torch' in sys.modules else 0)")
    done = subprocess.run([sys.executable, "-c", program, str(PACKAGE.parent / "sample_runs" / "nan")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# Calls that read a file (`open(` alone: the built-in, not `Popen(` nor `urlopen(`).
READING_CALLS = re.compile(r"\.read_bytes\(|\.read_text\(|read_parquet\(|read_table\(|json\.load\(|pickle\.load\("
                           r"|torch\.load\(|(?<![\w.])open\(")


def test_no_presenter_reads_a_file_itself():
    """What the CLI and the dashboard show comes through the report or the run reader, which read the files."""
    reading = {name: READING_CALLS.findall(path.read_text()) for name, path in MODULES.items()
               if name.startswith(PRESENTERS)}
    assert {name: calls for name, calls in reading.items() if calls} == {"gpuprof.cli": ["open("]}  # os.devnull, written
