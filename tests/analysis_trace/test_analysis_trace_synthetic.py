"""Every analysis on a small hand-built trace whose figures are worked out in the comments."""

import pytest

from gpuprof.analysis.trace import TraceAnalysis


@pytest.fixture
def analysis(tmp_path, builder):
    b = builder
    b.step(1, 0, 100).step(2, 100, 100).step(3, 200, 100)
    # Step 1
    b.host("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 2, cat="user_annotation")
    b.host("aten::mm", 2, 28)
    b.launch("ampere_sgemm_128x64_nn", 20, 30, launch_ts=10, launch_dur=2)  # matmul, no tensor cores
    b.launch("sm80_xmma_gemm_f16f16_f16f32", 50, 10, launch_ts=15, launch_dur=2)  # tensor cores
    b.launch("ncclKernel_AllReduce_RING_LL_Sum_float", 40, 40, launch_ts=18, launch_dur=1, stream=20)
    b.host("aten::item", 83, 9).host("aten::_local_scalar_dense", 84, 8)
    b.launch("Memcpy DtoH (Device -> Pageable)", 85, 5, launch_ts=84, launch_dur=7, cat="gpu_memcpy", call="cudaMemcpyAsync")
    b.host("aten::to", 93, 3).host("cudaStreamSynchronize", 93, 2, cat="cuda_runtime")
    # Step 2: gaps before these on stream 7 are host wait (30), kernel wait (5), other (40)
    b.launch("elementwise_kernel", 120, 10, launch_ts=101)
    b.launch("elementwise_kernel", 135, 5, launch_ts=110)
    b.launch("elementwise_kernel", 180, 10, launch_ts=112)
    # Step 3, the last: left out by default
    b.launch("late_kernel", 210, 10, launch_ts=205)
    return TraceAnalysis(b.write(tmp_path / "trace.json", rank=0, world_size=1))


def test_temporal_breakdown(analysis):
    row = analysis.temporal_breakdown().iloc[0]
    # Device busy: [20,80) [85,90) [120,130) [135,140) [180,190) = 90 of the span 20..190 = 170.
    # Computation: [20,60) + 25 = 65; non-compute = 170 - 65 - 80 = 25 (NCCL alone 20, memcpy 5).
    assert row[["idle_time_us", "compute_time_us", "non_compute_time_us", "kernel_time_us"]].tolist() == [80, 65, 25, 170]
    assert row["idle_time_pct"] == round(100 * 80 / 170, 2)


def test_kernel_type_breakdown_and_overlap(analysis):
    split = dict(zip(analysis.kernel_type_breakdown()["kernel_type"], analysis.kernel_type_breakdown()["time_us"]))
    assert split == {
        "computation": 45,
        "computation overlapping communication": 20,
        "communication": 20,
        "memory": 5,
    }
    overlap = analysis.comm_comp_overlap().iloc[0]
    assert (overlap["communication_time_us"], overlap["overlapped_time_us"], overlap["comm_comp_overlap_pct"]) == (40, 20, 50.0)


def test_top_kernels(analysis):
    top = analysis.top_kernels().set_index("name")
    assert top.loc["elementwise_kernel", ["count", "total_us", "max_us", "min_us"]].tolist() == [3, 25, 10, 5]
    assert top.index[0] == "ncclKernel_AllReduce_RING_LL_Sum_float"
    assert "late_kernel" not in top.index


def test_idle_by_stream(analysis):
    idle = analysis.idle_by_stream()
    stream7 = dict(zip(idle[idle["stream"] == 7]["idle_category"], idle[idle["stream"] == 7]["idle_time_us"]))
    # gemm2 0 (kernel wait), memcpy 25 (host wait), ew1 30 (host wait), ew2 5 (kernel wait), ew3 40 (other)
    assert stream7 == {"host_wait": 55, "kernel_wait": 5, "other": 40}


def test_launch_statistics(analysis):
    launches = analysis.kernel_launches()
    assert sorted(launches["launch_delay_us"]) == sorted([10, 35, 22, 1, 19, 25, 68])
    summary = analysis.launch_summary().iloc[0]
    assert summary["launches"] == 7
    assert summary["short_kernels"] == 1  # the memcpy: 5 µs on the device, 7 µs launch call
    assert summary["launch_delay_max_us"] == 68


def test_host_device_syncs_with_their_cpu_op(analysis):
    syncs = analysis.host_device_syncs()
    assert syncs[["step", "sync_call", "sync_type", "cpu_op", "innermost_cpu_op"]].values.tolist() == [
        [1, "cudaMemcpyAsync", "device-to-host copy", "aten::item", "aten::_local_scalar_dense"],
        [1, "cudaStreamSynchronize", "stream sync", "aten::to", "aten::to"],
    ]


def test_tensor_core_share(analysis):
    row = analysis.tensor_core_share().iloc[0]
    assert (row["matmul_time_us"], row["tensor_core_time_us"], row["tensor_core_pct"]) == (40, 10, 25.0)
    assert row["top_non_tensor_core_kernel"] == "ampere_sgemm_128x64_nn"


def test_step_breakdown_is_priority_ordered_and_sums_to_wall_time(analysis):
    steps = analysis.step_breakdown().set_index("step")
    categories = ["kernel", "memcpy", "memset", "communication", "runtime", "dataloader", "cpu_exec", "other"]
    # Step 1: kernels [20,60); memcpy [85,90); NCCL past the kernels [60,80); runtime calls 2+2+1+2+2;
    # data loader [0,2); CPU ops not under anything above 8+3+1+1 + 1+1 + 1; the rest is other.
    assert steps.loc[1, [f"{c}_us" for c in categories]].tolist() == [40, 5, 0, 20, 9, 2, 16, 8]
    assert steps.loc[2, ["kernel_us", "runtime_us", "other_us"]].tolist() == [25, 3, 72]
    summed = steps[[f"{c}_us" for c in categories]].sum(axis=1)
    assert (summed == steps["step_time_us"]).all()
    assert steps.index.tolist() == [1, 2]


def test_include_last_step_keeps_the_last_step(tmp_path, analysis):
    kept = TraceAnalysis(analysis.trace.ranks[0].path, include_last_step=True)
    assert kept.step_breakdown()["step"].tolist() == [1, 2, 3]
    assert "late_kernel" in kept.top_kernels()["name"].tolist()


def test_stragglers_flag_only_the_slow_rank(tmp_path, builder):
    for rank, work in ((0, 30), (1, 60), (2, 30)):
        builder.events.clear()
        builder.step(1, 0, 100).launch("compute_kernel", 5, work).launch("ncclKernel_AllReduce", 5 + work, 90 - work)
        builder.write(tmp_path / f"rank{rank}.json", rank=rank, world_size=3)
    analysis = TraceAnalysis(tmp_path)
    stragglers = analysis.stragglers().set_index("rank")
    assert stragglers["straggler"].to_dict() == {0: False, 1: True, 2: False}
    spread = analysis.rank_spread()
    assert spread["rank"].tolist() == [0, 1, 2]


def test_trace_without_profiler_steps_is_one_window(tmp_path, builder):
    builder.host("aten::add", 0, 10).launch("elementwise_kernel", 20, 10)
    analysis = TraceAnalysis(builder.write(tmp_path / "t.json"))
    steps = analysis.step_breakdown()
    assert steps["step"].tolist() == [-1]
    assert steps["step_time_us"].iloc[0] == 30  # from the first host op start to the kernel end
