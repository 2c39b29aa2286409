"""`gpuprof trace` as the TensorBoard plugin's successor: the verdict and the trace-based findings of
plain torch.profiler traces (recorded here with tensorboard_trace_handler, and from other projects),
before the tables; old and new formats; a bad trace is one line and exit 2."""

import gzip
import json
import subprocess
import sys

import pytest

from gpuprof.analysis.trace.loader import trace_files, trace_spans
from gpuprof.cli import main
from gpuprof.report.trace_report import build_trace_report


def trace_json_args(argv, capsys) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def trace_json(path, capsys) -> dict:
    return trace_json_args(["trace", str(path), "--json"], capsys)


def test_an_input_bound_loop_gets_the_input_verdict_and_the_data_loader_finding(plugin_traces, capsys):
    document = trace_json(plugin_traces["no_workers"], capsys)
    assert document["verdict"]["bound"] == "input"
    assert document["verdict"]["share_pct"] >= 30  # a batch takes 1.5 steps to prepare
    finding = next(f for f in document["findings"] if f["rule"] == "dataloader-bound")
    assert finding["evidence"]["source"] == "trace" and finding["category"] == "input"
    assert "num_workers" in finding["fix"] and "(finding dataloader-bound, est. gain " in document["verdict"]["next_step"]
    assert {"tables", "notes", "ranks"} <= set(document) and document["ranks"] == [0]


def test_the_same_loop_with_workers_is_not_input_bound(plugin_traces, capsys):
    document = trace_json(plugin_traces["workers"], capsys)
    assert document["verdict"]["bound"] not in ("input", None)
    assert "dataloader-bound" not in [f["rule"] for f in document["findings"]]
    steps = document["tables"]["step_breakdown"]
    assert sum(s["dataloader_us"] for s in steps) < 0.15 * sum(s["step_time_us"] for s in steps)


def test_terminal_report_prints_the_verdict_then_the_findings_then_the_tables(plugin_traces, capsys):
    assert main(["trace", str(plugin_traces["no_workers"])]) == 0
    out = capsys.readouterr().out
    positions = [out.index(text) for text in ("Verdict: Bound by input", "dataloader-bound", "Step time breakdown")]
    assert positions == sorted(positions)


def test_spans_of_one_worker_are_trace_windows_not_ranks(plugin_traces):
    files = trace_files(plugin_traces["two_spans"])
    spans = trace_spans(files)
    assert len(files) == 2 and [len(span) for span in spans] == [1, 1]
    report = build_trace_report(plugin_traces["two_spans"])
    assert report.ranks == [0] and report.files == spans[-1]
    assert any("2 trace windows" in note for note in report.notes)


def test_plugin_file_names_group_into_workers_and_spans(tmp_path):
    names = ["host_1.100.pt.trace.json", "host_1.300.pt.trace.json.gz", "host_2.105.pt.trace.json",
             "host_2.290.pt.trace.json"]
    spans = trace_spans([tmp_path / name for name in names])
    assert [[file.name for file in span] for span in spans] == [[names[0], names[2]], [names[1], names[3]]]
    assert trace_spans([tmp_path / "rank-0.json", tmp_path / "rank-1.json"]) == [[tmp_path / "rank-0.json",
                                                                                  tmp_path / "rank-1.json"]]


def test_several_workers_of_one_span_are_ranks(tmp_path, builder):
    builder.step(1, 0, 100).step(2, 100, 100).host("aten::mm", 2, 20).launch("ampere_sgemm_128x64_nn", 20, 30)
    for worker in ("node_11", "node_12"):
        builder.write(tmp_path / f"{worker}.1796156491115050024.pt.trace.json")
    report = build_trace_report(tmp_path)
    assert report.ranks == [0, 1] and report.verdict.bound is not None


SHARED = ["a100_2rank_nccl", "v100_ns_timestamps", "sampled_world128", "cpu_only", "rocm_mi250"]


@pytest.mark.parametrize("folder", SHARED)
def test_traces_from_other_projects_get_a_verdict(shared_traces, folder):
    report = build_trace_report(shared_traces / folder, jobs=1)
    assert report.verdict.bound is not None, report.verdict
    assert report.summary.n_steps >= 1


def test_findings_on_gpu_traces_from_other_projects(shared_traces):
    a100 = build_trace_report(shared_traces / "a100_2rank_nccl", jobs=1)
    assert a100.verdict.bound == "host"  # HTA: the GPU idles 77.78 % of the time
    idle = next(f for f in a100.findings if f.rule == "low-gpu-utilization")
    assert idle.evidence["source"] == "trace" and idle.evidence["idle_mostly"] in ("host_wait", "kernel_wait", "other")
    v100 = build_trace_report(shared_traces / "v100_ns_timestamps", jobs=1)
    assert v100.verdict.bound == "compute"  # HTA: computing 96.75 % of the kernel time
    assert "fp32-matmul" in [f.rule for f in v100.findings]  # a V100 has tensor cores, its sgemms skip them
    world = build_trace_report(shared_traces / "sampled_world128", jobs=1)
    rules = {f.rule: f for f in world.findings}
    assert {"communication-bound", "host-device-sync"} <= set(rules)
    assert world.ranks == [0, 1]


def test_a_trace_with_no_device_activity_reads_every_share_from_the_host(cpu_profiler_trace):
    report = build_trace_report(cpu_profiler_trace)
    assert not report.has_device_activity and "CPU trace" in report.verdict.why


def test_torch_1_8_era_trace_loads(tmp_path):
    """torch 1.8's Kineto wrote no distributedInfo, no deviceProperties, categories in upper case
    ("Operator", "Kernel", "Runtime"), and names as the only args."""
    events = [
        {"ph": "X", "cat": "Operator", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "Operator", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 10, "dur": 40},
        {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 15, "dur": 5,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "Kernel", "name": "volta_sgemm_128x64_nn", "pid": 0, "tid": "stream 7", "ts": 30, "dur": 50,
         "args": {"correlation": 1, "stream": 7, "device": 0}},
    ]
    path = tmp_path / "worker0.1616000000000.pt.trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": events}).encode()))
    report = build_trace_report(path)
    assert report.has_device_activity and report.verdict.bound is not None


@pytest.mark.parametrize("content", [b"not json", b'{"traceEvents": []}', b"\x1f\x8b\x08truncated"])
def test_an_unreadable_trace_folder_is_one_line_and_exit_2(tmp_path, content):
    (tmp_path / "worker.1.pt.trace.json").write_bytes(content)
    result = subprocess.run([sys.executable, "-m", "gpuprof", "trace", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_diff_of_two_traces_by_kernel_and_op(tmp_path, builder, capsys):
    a = builder.step(1, 0, 100).step(2, 100, 100).host("aten::mm", 2, 20).launch("ampere_sgemm_128x64_nn", 20, 30)
    path_a = a.write(tmp_path / "a.json")
    b = type(builder)().step(1, 0, 100).step(2, 100, 100).host("aten::mm", 2, 20).host("aten::add", 30, 5)
    path_b = b.launch("sm80_xmma_gemm_bf16", 20, 10).write(tmp_path / "b.json")
    document = trace_json_args(["trace", str(path_a), "--diff", str(path_b), "--json"], capsys)
    rows = {(row["kind"], row["name"]): row for row in document["diff"]["rows"]}
    assert rows[("kernel", "ampere_sgemm_128x64_nn")]["count_b"] == 0
    assert rows[("kernel", "sm80_xmma_gemm_bf16")]["total_us_diff"] == 10
    assert rows[("cpu_op", "aten::mm")]["count_diff"] == 0 and rows[("cpu_op", "aten::add")]["count_a"] == 0


def test_the_same_loop_with_and_without_workers_runs_the_same_ops(plugin_traces, capsys):
    document = trace_json_args(["trace", str(plugin_traces["no_workers"]), "--diff", str(plugin_traces["workers"]),
                                "--json"], capsys)
    ops = {row["name"]: row for row in document["diff"]["rows"] if row["kind"] == "cpu_op"}
    assert ops["aten::mm"]["count_a"] > 0 and ops["aten::mm"]["count_diff"] == 0  # two profiled steps each


def test_the_next_step_is_the_finding_worth_the_most_and_findings_rank_by_worth(shared_traces, capsys):
    """The shared 128-rank trace: communication-bound is worth 28 % of the step, the host-device syncs 0.01 %;
    the next step was the syncs' fix, and a 0 %-gain warning ranked above findings worth more."""
    document = trace_json(shared_traces / "sampled_world128", capsys)
    findings = document["findings"]
    worth = [f["est_gain_pct"] if (f["est_gain_pct"] or 0) > 1 else 0 for f in findings]
    best = findings[worth.index(max(worth))]
    assert best["rule"] == "communication-bound" and best["est_gain_pct"] > 20
    assert f"(finding {best['rule']}, est. gain " in document["verdict"]["next_step"]
    assert worth == sorted(worth, reverse=True)  # no critical finding here: worth alone orders them
    syncs = next(f for f in findings if f["rule"] == "host-device-sync")
    assert syncs["est_gain_pct"] < 1 and findings.index(syncs) > findings.index(best)
