"""The TensorBoard plugin's views from plain torch.profiler traces: operators (self and total time, by input
shape, by call stack), kernels (by op, tensor cores, occupancy), memory and modules. On a real CPU trace recorded
with every option (tests/views_model.py, one recording per session), on the shared GPU traces where they have
the fields, on a trace recorded without the options (each view then says what to record), and on built traces
where an allocation's op depends on its sub-µs time."""

from __future__ import annotations

import gzip
import json
import math
from collections import defaultdict

import numpy as np
import pytest
import views_model as model

from gpuprof.analysis.trace import TraceAnalysis
from gpuprof.analysis.trace.tables import VIEW_NEEDS
from gpuprof.cli import main
from gpuprof.report.trace_report import build_trace_report

WINDOW_STEPS = model.ACTIVE_STEPS - 1  # the last profiler step is left out, as HTA does


@pytest.fixture(scope="module")
def views(views_trace):
    return TraceAnalysis(views_trace)


def raw_events(path) -> list[dict]:
    data = path.read_bytes()
    document = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    return document["traceEvents"]


def test_operator_self_time_is_total_less_the_ops_directly_inside(views_trace):
    """Checked against a plain quadratic search for each op's children on the trace's own JSON (whole µs
    rounded inward, as the loader does; of two ops over the same span the earlier in the file encloses the
    other), over every op of the recorded steps."""
    analysis = TraceAnalysis(views_trace, include_last_step=True)
    events = raw_events(next(views_trace.iterdir()))
    window_end = max(math.floor(e["ts"] + e["dur"]) for e in events if str(e.get("name")).startswith("ProfilerStep#"))
    ops = [(math.ceil(e["ts"]), max(math.floor(e["ts"] + e["dur"]), math.ceil(e["ts"])), e["tid"], e["name"], index)
           for index, e in enumerate(events)
           if e.get("ph") == "X" and e.get("cat") == "cpu_op" and math.ceil(e["ts"]) <= window_end]

    def encloses(outer, inner) -> bool:
        return (outer[2] == inner[2] and outer[0] <= inner[0] and inner[1] <= outer[1]
                and (outer[0], -outer[1], outer[4]) < (inner[0], -inner[1], inner[4]))

    expected_self = defaultdict(int)
    for op in ops:
        inside = [other for other in ops if encloses(op, other)]
        direct = [child for child in inside if not any(encloses(other, child) for other in inside)]
        expected_self[op[3]] += op[1] - op[0] - sum(end - start for start, end, *_ in direct)
    table = analysis.top_cpu_ops(None).set_index("name")
    assert table["self_us"].to_dict() == dict(expected_self)
    assert (table["self_us"] <= table["total_us"]).all()
    assert table.loc["aten::linear", "self_us"] < table.loc["aten::linear", "total_us"]  # addmm runs inside it


def test_operators_by_input_shape_show_the_model_sizes(views):
    table = views.cpu_ops_by_shape(None)
    addmm = table[table["name"] == "aten::addmm"].set_index("input_dims")
    hidden = f"[[{model.HIDDEN}], [{model.BATCH}, {model.IN}], [{model.IN}, {model.HIDDEN}], [], []]"
    out = f"[[{model.OUT}], [{model.BATCH}, {model.HIDDEN}], [{model.HIDDEN}, {model.OUT}], [], []]"
    assert set(addmm.index) == {hidden, out}
    assert (addmm["count"] == WINDOW_STEPS).all()


def test_operators_by_call_stack_name_the_model_forward(views):
    table = views.cpu_ops_by_stack(None)
    addmm_stacks = table.loc[table["name"] == "aten::addmm", "stack"].tolist()
    assert addmm_stacks and all(stack.startswith("views_model.py(") and ": forward" in stack.split(" ← ")[0]
                                for stack in addmm_stacks)
    assert all("record_views_trace" in stack for stack in table["stack"])  # the loop's frame is outermost


def test_modules_are_the_model_tree_with_host_time(views):
    table = views.module_times().set_index("module")
    assert list(table.index) == ["ViewsModel_0", "ViewsModel_0.Linear_0", "ViewsModel_0.Linear_1"]
    assert (table["calls"] == WINDOW_STEPS).all()
    children = table.loc[["ViewsModel_0.Linear_0", "ViewsModel_0.Linear_1"], "total_us"].sum()
    assert table.loc["ViewsModel_0", "self_us"] == table.loc["ViewsModel_0", "total_us"] - children


def test_memory_over_time_and_allocations_by_op_match_the_allocator_events(views, views_trace):
    events = raw_events(next(views_trace.iterdir()))
    steps = sorted(e["ts"] for e in events if str(e.get("name")).startswith("ProfilerStep#"))
    memory = [e["args"] for e in events if e.get("name") == "[memory]" and math.ceil(e["ts"]) < math.ceil(steps[-1])]
    summary = views.memory_summary().iloc[0]
    assert summary["device"] == "cpu"
    assert summary["peak_allocated_bytes"] == max(args["Total Allocated"] for args in memory)
    assert summary["allocations"] == sum(args["Bytes"] > 0 for args in memory)
    timeline = views.memory_timeline()
    assert timeline["allocated_bytes"].max() == summary["peak_allocated_bytes"]
    assert timeline["ts_us"].is_monotonic_increasing
    by_op = views.memory_by_op(None).set_index("op")
    # Each step's two Linear outputs are addmm's allocations: batch x hidden and batch x out floats.
    assert by_op.loc["aten::addmm", "allocations"] == 2 * WINDOW_STEPS
    assert by_op.loc["aten::addmm", "allocated_bytes"] == (
        WINDOW_STEPS * model.BATCH * (model.HIDDEN + model.OUT) * model.FLOAT_BYTES)
    assert by_op["allocations"].sum() == summary["allocations"]


def test_an_allocation_belongs_to_the_op_it_was_recorded_in_not_to_its_rounded_microsecond(tmp_path, builder):
    """Events of a recorded views trace that failed the test above (names and times; pid, tid and arguments cut):
    addmm allocated 194.048, then expand started at 194.879 in the same µs; empty allocated 260.487 and ended
    at 260.767, in the last µs that rounding leaves out of it."""
    base = 5559150542000
    (builder.host("aten::linear", base + 184.905, 16.063).host("aten::addmm", base + 191.945, 8.903)
     .memory(base + 194.048, 32).host("aten::expand", base + 194.879, 1.332)
     .host("aten::as_strided", base + 195.761, 0.38)
     .host("aten::mse_loss", base + 240.437, 71.977).host("aten::empty", base + 259.375, 1.392)
     .memory(base + 260.487, 32))
    by_op = TraceAnalysis(builder.write(tmp_path / "trace.json")).memory_by_op(None)
    assert dict(zip(by_op["op"], by_op["allocations"])) == {"aten::addmm": 1, "aten::empty": 1}


def test_an_allocation_at_an_ops_start_is_the_ops_and_at_its_end_is_after_it(tmp_path, builder):
    """An op spans [start, end) of its recorded ns, as in the TensorBoard plugin: an event at the instant one op
    ends and the next starts counts once, in the next."""
    builder.host("outer", 1000, 10).host("inner", 1003.5, 2).host("next", 1010, 1)
    for ts, nbytes in ((1000, 1), (1003.5, 2), (1005.5, 4), (1010, 8), (1011, 16)):
        builder.memory(ts, nbytes)
    by_op = TraceAnalysis(builder.write(tmp_path / "trace.json")).memory_by_op(None)
    assert dict(zip(by_op["op"], by_op["allocated_bytes"])) == {"outer": 1 + 4, "inner": 2, "next": 8, "(no op)": 16}


def test_each_view_says_what_to_record_when_the_trace_lacks_it(cpu_profiler_trace, views_trace, capsys):
    assert build_trace_report(views_trace, jobs=1).missing_views == []
    bare = build_trace_report(cpu_profiler_trace, jobs=1)
    assert bare.missing_views == list(VIEW_NEEDS)
    assert main(["trace", str(cpu_profiler_trace)]) == 0
    out = capsys.readouterr().out
    for option in ("record_shapes=True", "with_stack=True", "profile_memory=True"):
        assert f"record it by passing {option} to torch.profiler.profile(...)" in out


def test_the_cli_prints_and_its_json_carries_every_view(views_trace, capsys):
    assert main(["trace", str(views_trace), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["missing_views"] == {}
    for name in ("cpu_ops_by_shape", "cpu_ops_by_stack", "memory_summary", "memory_timeline", "memory_by_op",
                 "module_times"):
        assert document["tables"][name], name
    assert main(["trace", str(views_trace)]) == 0
    out = capsys.readouterr().out
    for title in ("Operators: host and device time", "Operators by input shape", "Operators by call stack",
                  "Memory per device", "Memory allocated by operator", "Modules", "ViewsModel_0.Linear_0"):
        assert title in out


def test_kernel_occupancy_is_kinetos_fields_weighted_by_duration(shared_traces):
    path = shared_traces / "sampled_world128" / "sampled_rank-0.json.gz"
    analysis = TraceAnalysis(path, include_last_step=True)
    top = analysis.top_kernels(None)
    kernels = defaultdict(list)
    for event in raw_events(path):
        if event.get("cat") == "kernel":
            kernels[event["name"]].append((math.floor(event["ts"] + event["dur"]) - math.ceil(event["ts"]),
                                           event["args"]["est. achieved occupancy %"], event["args"]["blocks per SM"]))
    for row in top.head(5).itertuples():
        durations, occupancy, blocks = map(np.array, zip(*kernels[row.name]))
        assert row.est_achieved_occupancy_pct == pytest.approx(np.average(occupancy, weights=durations), abs=0.01)
        assert row.blocks_per_sm == pytest.approx(np.average(blocks, weights=durations), abs=0.01)


def test_kernels_by_op_and_ops_device_time_on_a_real_gpu_trace(shared_traces):
    analysis = TraceAnalysis(shared_traces / "v100_ns_timestamps")
    by_op = analysis.kernels_by_op(None)
    kernel_time = analysis.top_kernels(None)["total_us"].sum()
    assert 0.9 * kernel_time < by_op["total_us"].sum() <= kernel_time  # nearly every kernel has its op
    ops = analysis.top_cpu_ops(None)
    assert ops["device_self_us"].sum() == by_op["total_us"].sum()  # each attributed kernel counted once, at its op
    assert (ops["device_self_us"] <= ops["device_total_us"]).all()
    conv = by_op[by_op["op"] == "aten::cudnn_convolution"]
    assert not conv.empty and any(word in conv["name"].iloc[0] for word in ("cudnn", "gemm"))  # its most time
    assert analysis.module_times().empty and analysis.memory_summary().empty
