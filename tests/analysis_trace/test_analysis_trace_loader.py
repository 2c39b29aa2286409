"""The loader: file forms, time units and rounding, ranks, and bad input (including fuzzing)."""

import gzip
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuprof.analysis.trace import TraceAnalysis, jsonstream
from gpuprof.analysis.trace.loader import load_trace
from gpuprof.analysis.trace.ranks import analysis_tables
from gpuprof.analysis.trace.tables import TABLE_TITLES as TABLES
from gpuprof.errors import TraceFormatError


def test_plain_gzip_and_bare_array_forms_load_the_same_events(tmp_path, builder):
    builder.step(1, 0, 100).launch("gemm_kernel", 10, 20)
    plain = builder.write(tmp_path / "a.json")
    packed = builder.write(tmp_path / "b.json.gz")
    bare = tmp_path / "c.json"
    bare.write_text(json.dumps(builder.events))
    frames = [load_trace(p).ranks[0].events for p in (plain, packed, bare)]
    assert all(f["name"].astype(str).tolist() == frames[0]["name"].astype(str).tolist() for f in frames)
    assert frames[0]["is_device"].sum() == 1


def test_nanosecond_fractions_are_rounded_inward_to_whole_microseconds(tmp_path, builder):
    builder.host("a", 1000.4, 2.2).host("b", 1002.6, 0.3)
    events = load_trace(builder.write(tmp_path / "t.json")).ranks[0].events
    # a: [1000.4, 1002.6) -> [1001, 1002); b: [1002.6, 1002.9) -> [1003, 1003), empty, never negative.
    assert events[["ts_us", "end_us", "dur_us"]].values.tolist() == [[0, 1, 1], [2, 2, 0]]


def test_directory_of_rank_files_aligns_ranks_on_a_common_time_base(tmp_path, builder):
    builder.host("op", 500, 10).write(tmp_path / "x.json", rank=1, world_size=2)
    builder.events.clear()
    builder.host("op", 400, 10).write(tmp_path / "y.json.gz", rank=0, world_size=2)
    trace = load_trace(tmp_path)
    assert list(trace.ranks) == [0, 1]
    assert trace.base_ts_us == 400
    assert trace.ranks[1].events["ts_us"].tolist() == [100]
    assert trace.ranks[1].world_size == 2


def test_rank_comes_from_the_file_name_without_distributed_info(tmp_path, builder):
    builder.host("op", 0, 1).write(tmp_path / "run_rank-3.json")
    builder.write(tmp_path / "run_rank-5.json")
    assert list(load_trace(tmp_path).ranks) == [3, 5]


def test_two_files_for_one_rank_is_an_error(tmp_path, builder):
    builder.host("op", 0, 1).write(tmp_path / "a.json", rank=0)
    builder.write(tmp_path / "b.json", rank=0)
    with pytest.raises(TraceFormatError, match="two trace files for rank 0"):
        load_trace(tmp_path)


@pytest.mark.parametrize(
    "content, message",
    [
        (b"this is not json", "not a JSON trace"),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1', "not valid JSON"),
        (b'{"foo": 1}', "no 'traceEvents'"),
        (b'{"traceEvents": []}', "empty trace"),
        (b'{"traceEvents": [{"ph": "M", "name": "process_name"}]}', "empty trace"),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1}]}', "lacks 'name', 'ts' or 'dur'"),
        (b'{"traceEvents": [{"ph": "X", "ts": 1, "dur": 2}]}', "lacks 'name', 'ts' or 'dur'"),
        (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": "soon", "dur": 2}]}', "not a torch.profiler trace"),
        (b'{"traceEvents": 5}', "not a torch.profiler trace"),
        (b"", "not a JSON trace"),
    ],
)
def test_bad_input_is_one_clear_trace_format_error(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError, match=message) as error:
        load_trace(path)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_truncated_gzip_and_missing_paths(tmp_path, builder):
    whole = gzip.compress(json.dumps(builder.host("op", 0, 1).document()).encode())
    path = tmp_path / "t.json.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceFormatError, match="truncated or corrupt gzip"):
        load_trace(path)
    with pytest.raises(TraceFormatError, match="no such trace file"):
        load_trace(tmp_path / "missing.json")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(TraceFormatError, match="no .json or .json.gz trace files"):
        load_trace(empty_dir)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["ph", "name", "ts", "dur", "cat", "args", "traceEvents", "stream", "x"]), children, max_size=5
    ),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=json_values)
def test_fuzzed_json_either_loads_or_raises_trace_format_error(tmp_path, document):
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps(document))
    try:
        load_trace(path)
    except TraceFormatError:
        pass


SMALL_TRACE = json.dumps(
    {
        "distributedInfo": {"rank": 0},
        "traceEvents": [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 50},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 5, "dur": 2,
             "args": {"correlation": 1}},
            {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 10.5, "dur": 5,
             "args": {"correlation": 1, "stream": 7}},
        ],
    }
).encode()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_bytes_of_a_real_trace_either_load_or_raise_trace_format_error(tmp_path, data):
    original = SMALL_TRACE
    cut = data.draw(st.integers(0, len(original)))
    flip = data.draw(st.integers(0, len(original) - 1))
    mutated = bytearray(original[:cut] if data.draw(st.booleans()) else original)
    if mutated and flip < len(mutated):
        mutated[flip] = data.draw(st.integers(0, 255))
    compress = data.draw(st.booleans())
    path = tmp_path / ("fuzz.json.gz" if compress else "fuzz.json")
    path.write_bytes(gzip.compress(bytes(mutated)) if compress else bytes(mutated))
    block_bytes = data.draw(st.sampled_from([8, 64, None]))  # small blocks: the streaming path
    defaults = jsonstream.BLOCK_BYTES, jsonstream.WHOLE_DOCUMENT_BYTES
    if block_bytes:
        jsonstream.BLOCK_BYTES = jsonstream.WHOLE_DOCUMENT_BYTES = block_bytes
    try:
        analysis = TraceAnalysis(path)
    except TraceFormatError:
        return
    finally:
        jsonstream.BLOCK_BYTES, jsonstream.WHOLE_DOCUMENT_BYTES = defaults
    analysis_tables(analysis, TABLES, top=5)  # whatever loads, every analysis runs without crashing


events_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "ph": st.just("X"),
            "name": st.sampled_from(["ProfilerStep#1", "ProfilerStep#2", "aten::mm", "cudaLaunchKernel",
                                     "cudaStreamSynchronize", "ncclKernel_X", "sm80_xmma_gemm", "Memcpy DtoH"]),
            "cat": st.sampled_from(["cpu_op", "user_annotation", "cuda_runtime", "kernel", "gpu_memcpy", "weird"]),
            "ts": st.floats(-1e6, 1e6) | st.integers(0, 10**6),
            "dur": st.floats(-10, 1e4) | st.integers(0, 10**4),
            "tid": st.integers(0, 3) | st.text(max_size=3),
            "args": st.fixed_dictionaries(
                {}, optional={"correlation": st.integers(-1, 5), "stream": st.integers(-1, 3) | st.just("x")}
            ),
        }
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(events=events_strategy)
def test_fuzzed_event_lists_run_every_analysis_or_raise_trace_format_error(tmp_path, events):
    path = tmp_path / "fuzz.json"
    path.write_text(json.dumps({"traceEvents": events}))
    try:
        analysis = TraceAnalysis(path)
    except TraceFormatError:
        return
    tables = analysis_tables(analysis, TABLES, top=5)
    steps = tables["step_breakdown"]
    parts = steps[[c for c in steps.columns if c.endswith("_us") and c not in ("start_us", "end_us", "step_time_us")]]
    assert (parts.sum(axis=1) == steps["step_time_us"]).all()


def stream_in_blocks(monkeypatch, block_bytes: int) -> None:
    """Make the loader stream tiny blocks instead of decoding small documents whole."""
    monkeypatch.setattr(jsonstream, "BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(jsonstream, "WHOLE_DOCUMENT_BYTES", block_bytes)


TRICKY_EVENTS = [
    {"ph": "X", "cat": "cpu_op", "name": 'weird "},{" name ]', "pid": 1, "tid": 1, "ts": 1, "dur": 2,
     "args": {"Input Dims": [[1, 2], []], "nested": [{"a": "},"}, {"b": "]"}]}},
    {"ph": "i", "name": "instant", "pid": 1, "tid": 1, "ts": 2},
    {"ph": "X", "cat": "kernel", "name": "k\\\"},", "pid": 0, "tid": 7, "ts": 3.5, "dur": 4,
     "args": {"stream": 7, "correlation": 9}},
] * 7


@pytest.mark.parametrize("block_bytes", [16, 64, 1000])
def test_small_blocks_cut_only_at_event_boundaries(tmp_path, monkeypatch, block_bytes):
    path = tmp_path / "tricky.json.gz"
    document = {"deviceProperties": [{"id": 0}], "traceEvents": TRICKY_EVENTS, "distributedInfo": {"rank": 4, "ranks": [0, 1]}}
    path.write_bytes(gzip.compress(json.dumps(document, indent=1).encode()))
    whole = load_trace(path).ranks[4].events
    stream_in_blocks(monkeypatch, block_bytes)
    chunked = load_trace(path)
    assert list(chunked.ranks) == [4] and chunked.ranks[4].device_properties == [{"id": 0}]
    assert chunked.ranks[4].events.astype(str).equals(whole.astype(str))
    assert set(chunked.ranks[4].events["name"].astype(str)) == {'weird "},{" name ]', 'k\\"},'}
    assert len(chunked.ranks[4].events) == 14


def test_type_errors_name_the_event_index_across_blocks(tmp_path, monkeypatch):
    events = [{"ph": "X", "name": "a", "ts": i, "dur": 1} for i in range(50)]
    events[37]["dur"] = "long"
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    stream_in_blocks(monkeypatch, 100)
    with pytest.raises(TraceFormatError, match=r"traceEvents\[37\]\.dur"):
        load_trace(path)


def test_multi_member_gzip_is_read_whole(tmp_path, monkeypatch):
    text = SMALL_TRACE.decode()
    half = text.index('{"ph": "X", "cat": "cuda_runtime"')
    path = tmp_path / "members.json.gz"
    path.write_bytes(gzip.compress(text[:half].encode()) + gzip.compress(text[half:].encode()))
    stream_in_blocks(monkeypatch, 32)
    assert len(load_trace(path).ranks[0].events) == 3
