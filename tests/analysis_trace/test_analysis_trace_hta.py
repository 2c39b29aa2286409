"""gpuprof's figures on the shared real traces against HTA's own, as listed in their README."""

import re

import pytest

from gpuprof.analysis.trace import TraceAnalysis

TEMPORAL_COLUMNS = ["idle_time_us", "compute_time_us", "non_compute_time_us", "kernel_time_us",
                    "idle_time_pct", "compute_time_pct", "non_compute_time_pct"]


def hta_temporal_rows(readme: str) -> list[tuple[str, int, list[float]]]:
    """(trace folder, rank, figures) from the README's HTA temporal-breakdown table."""
    rows = []
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 9 and cells[1].isdigit():
            rows.append((cells[0], int(cells[1]), [float(c.replace(",", "")) for c in cells[2:]]))
    return rows


def test_temporal_breakdown_matches_hta_on_every_shared_trace(shared_traces):
    rows = hta_temporal_rows((shared_traces / "README.md").read_text())
    assert len(rows) >= 5
    for folder, rank, expected in rows:
        table = TraceAnalysis(shared_traces / folder).temporal_breakdown().set_index("rank")
        assert table.loc[rank, TEMPORAL_COLUMNS].tolist() == pytest.approx(expected, abs=0.006), folder


def test_kernel_split_and_overlap_match_hta_on_a100(shared_traces):
    readme = (shared_traces / "README.md").read_text()
    analysis = TraceAnalysis(shared_traces / "a100_2rank_nccl")
    overlap = float(re.search(r"overlap on `a100_2rank_nccl` rank 0: ([\d.]+) %", readme).group(1))
    assert analysis.comm_comp_overlap()["comm_comp_overlap_pct"].iloc[0] == pytest.approx(overlap, abs=0.006)
    split = re.search(r"kernel-type split there: (.*)", readme).group(1)
    expected = {
        name.strip().lower(): (float(us.replace(",", "")), float(pct))
        for name, us, pct in re.findall(r"([a-z ]+?) ([\d,]+) µs \(([\d.]+) %\)", split)
    }
    table = analysis.kernel_type_breakdown()
    actual = {t: (us, pct) for t, us, pct in zip(table["kernel_type"], table["time_us"], table["time_pct"])}
    assert len(expected) == 5
    assert actual == expected


def test_cpu_only_trace_reports_the_cpu_side(shared_traces):
    analysis = TraceAnalysis(shared_traces / "cpu_only")
    assert not analysis.has_device_activity
    assert analysis.temporal_breakdown().empty
    steps = analysis.step_breakdown()
    assert len(steps) == 1 and steps["step_time_us"].iloc[0] > 0
    assert not analysis.top_cpu_ops().empty


def test_v100_syncs_and_launches_are_found(shared_traces):
    analysis = TraceAnalysis(shared_traces / "v100_ns_timestamps")
    summary = analysis.launch_summary().iloc[0]
    assert summary["launches"] == (analysis.trace.ranks[0].events["is_device"]).sum()
    steps = analysis.step_breakdown()
    assert len(steps) == 4  # five profiler steps, the last left out
