"""`gpuprof trace`: terminal report, --json document, and one-line errors with exit code 2."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpuprof.cli import main
from gpuprof.analysis.trace.tables import TABLE_TITLES as TABLES
from gpuprof.report.trace_report import SCHEMA, SCHEMA_VERSION


@pytest.fixture
def trace_file(tmp_path, builder):
    builder.step(1, 0, 100).step(2, 100, 100).host("aten::mm", 2, 20)
    builder.launch("ampere_sgemm_128x64_nn", 20, 30).launch("ncclKernel_AllReduce", 40, 30, stream=20)
    return builder.write(tmp_path / "trace.json.gz", rank=0, world_size=1)


def test_json_document_is_stable_and_complete(trace_file, capsys):
    assert main(["trace", str(trace_file), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == SCHEMA and document["schema_version"] == SCHEMA_VERSION
    assert set(document["tables"]) == set(TABLES)
    assert document["ranks"] == [0] and document["has_device_activity"] is True
    temporal = document["tables"]["temporal_breakdown"][0]
    assert temporal["kernel_time_us"] == 50 and temporal["idle_time_us"] == 0


def test_terminal_report_shows_each_section(trace_file, capsys):
    assert main(["trace", str(trace_file)]) == 0
    out = capsys.readouterr().out
    for title in ("Temporal breakdown", "Step time breakdown", "Top kernels", "Computation/communication overlap"):
        assert title in out


def test_cpu_only_trace_says_there_is_no_device_activity(tmp_path, builder, capsys):
    path = builder.step(1, 0, 10).host("aten::add", 1, 5).write(tmp_path / "cpu.json")
    assert main(["trace", str(path)]) == 0
    out = capsys.readouterr().out
    assert "No device (GPU) activity" in out and "aten::add" in out


@pytest.mark.parametrize("content", [b"not json", b'{"traceEvents": []}', b'{"a": 1}'])
def test_bad_trace_is_one_line_and_exit_code_2(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    result = subprocess.run([sys.executable, "-m", "gpuprof", "trace", str(path)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("gpuprof trace: error:")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_a_gpuprof_run_given_to_trace_points_to_analyze(tmp_path, capsys):
    """A real recorded run (the sample one) is no torch.profiler trace: the one line says which command reads it."""
    run_dir = tmp_path / "run"
    shutil.copytree(Path(__file__).resolve().parents[2] / "sample_runs" / "baseline", run_dir)
    assert main(["trace", str(run_dir)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == (f"gpuprof trace: error: {run_dir} is a gpuprof run, not a torch.profiler trace: `gpuprof analyze "
                    f"{run_dir}` reports it, and its trace windows are the folders under {run_dir / 'traces'}")
