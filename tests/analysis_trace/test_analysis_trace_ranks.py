"""Rank-parallel trace analysis (gpuprof/analysis/trace/ranks.py, `gpuprof trace --jobs/--scheduler`)
on a world of 16 ranks made from the two real ranks of a 128-rank job (shared/traces/sampled_world128),
their rank ids and world size rewritten: every rank's tables are the ones its source file gives alone,
the cross-rank tables are computed over all 16, and damaged or missing ranks are reported. (More ranks
only take longer: each is the same task on its own file; the time at scale is a benchmark's, not a test's.)"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from gpuprof.analysis.trace import TraceAnalysis
from gpuprof.analysis.trace.ranks import LIMITED_TABLES, analyze_ranks
from gpuprof.analysis.trace.tables import TABLE_TITLES as TABLES

pytestmark = pytest.mark.slow  # multi-process

WORLD = 16  # ranks written: enough for several files per worker and two halves of each source
SOURCE_WORLD = 128  # sampled_world128's own world size
# Beside the checkout, or where GPUPROF_SHARED_TRACES says (a worktree), as conftest.py finds them.
SHARED_TRACES = Path(os.environ.get("GPUPROF_SHARED_TRACES") or Path(__file__).resolve().parents[2].parent / "shared" / "traces")
SHARED_WORLD = SHARED_TRACES / "sampled_world128"
DASK_RANKS = 8


def write_world(folder: Path, n_ranks: int, world_size: int) -> Path:
    """n_ranks files: rank r is source file r % 2 with distributedInfo.rank = r and .world_size = world_size."""
    folder.mkdir(parents=True)
    sources = [json.loads(gzip.decompress((SHARED_WORLD / f"sampled_rank-{i}.json.gz").read_bytes())) for i in (0, 1)]
    for rank in range(n_ranks):
        info = {**sources[rank % 2]["distributedInfo"], "rank": rank, "world_size": world_size}
        document = dict(sources[rank % 2], distributedInfo=info)
        (folder / f"trace_{rank:03d}.json.gz").write_bytes(gzip.compress(json.dumps(document).encode(), 1))
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    if not SHARED_WORLD.is_dir():
        pytest.skip(f"shared traces not found at {SHARED_WORLD}")
    return write_world(tmp_path_factory.mktemp("world") / "traces", WORLD, WORLD)


def per_rank_tables(source: int, rank: int) -> dict[str, pd.DataFrame]:
    analysis = TraceAnalysis(SHARED_WORLD / f"sampled_rank-{source}.json.gz")
    return {"temporal_breakdown": analysis.temporal_breakdown().assign(rank=rank),
            "kernel_type_breakdown": analysis.kernel_type_breakdown().assign(rank=rank)}


def test_every_rank_of_a_world_in_parallel_processes_through_the_cli(world):
    result = subprocess.run([sys.executable, "-m", "gpuprof", "trace", str(world), "--json", "--jobs", "2"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["ranks"] == list(range(WORLD)) and document["missing_ranks"] == []
    tables = {name: pd.DataFrame(rows) for name, rows in document["tables"].items()}
    for rank in (0, 1, WORLD // 2 + 1, WORLD - 1):
        for name, expected in per_rank_tables(rank % 2, rank).items():
            got = tables[name].loc[tables[name]["rank"] == rank, list(expected.columns)].reset_index(drop=True)
            pd.testing.assert_frame_equal(got, expected.reset_index(drop=True), check_dtype=False, atol=0.01)
    assert len(tables["rank_spread"]) == WORLD and len(tables["stragglers"]) == WORLD
    # two source ranks: WORLD / 2 copies of each, so the spread splits the world in two exact halves
    assert tables["rank_spread"]["step_time_mean_us"].nunique() == 2
    straggling = set(tables["stragglers"].loc[tables["stragglers"]["straggler"], "rank"])
    assert straggling in (set(), set(range(0, WORLD, 2)), set(range(1, WORLD, 2)))


def test_the_same_analysis_on_a_dask_cluster(world, tmp_path):
    distributed = pytest.importorskip("distributed")
    files = sorted(world.iterdir())[:DASK_RANKS]
    subset = tmp_path / "subset"
    subset.mkdir()
    for file in files:
        (subset / file.name).symlink_to(file)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp",
                                  dashboard_address=None) as cluster:
        on_dask = analyze_ranks(files, table_names=tuple(TABLES), scheduler=cluster.scheduler_address)
        cli = subprocess.run([sys.executable, "-m", "gpuprof", "trace", str(subset), "--json",
                              "--scheduler", cluster.scheduler_address], capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["ranks"] == list(range(DASK_RANKS))
    local = analyze_ranks(files, table_names=tuple(TABLES), jobs=1)
    assert on_dask.ranks == local.ranks == list(range(DASK_RANKS))
    for name in TABLES:
        pd.testing.assert_frame_equal(on_dask.tables[name], local.tables[name])


def test_whole_trace_and_rank_parallel_analyses_agree_to_the_microsecond():
    if not SHARED_WORLD.is_dir():
        pytest.skip(f"shared traces not found at {SHARED_WORLD}")
    whole = TraceAnalysis(SHARED_WORLD)
    parallel = analyze_ranks(SHARED_WORLD, table_names=tuple(TABLES), jobs=2)
    for name in TABLES:  # start/end times included: both on the clock of the earliest rank
        expected = getattr(whole, name)(10) if name in LIMITED_TABLES else getattr(whole, name)()
        pd.testing.assert_frame_equal(parallel.tables[name], expected, check_categorical=False)


def test_a_torn_and_a_missing_rank_are_reported_and_the_rest_analysed(tmp_path):
    if not SHARED_WORLD.is_dir():
        pytest.skip(f"shared traces not found at {SHARED_WORLD}")
    folder = write_world(tmp_path / "traces", 8, SOURCE_WORLD)
    torn = folder / "trace_003.json.gz"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 3])
    (folder / "trace_005.json.gz").unlink()
    result = subprocess.run([sys.executable, "-m", "gpuprof", "trace", str(folder), "--json", "--jobs", "2"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["ranks"] == [0, 1, 2, 4, 6, 7]
    assert document["unreadable_files"][0]["file"].endswith("trace_003.json.gz")
    assert document["missing_ranks"][:2] == [3, 5] and len(document["missing_ranks"]) == SOURCE_WORLD - 6
    assert any("trace_003.json.gz could not be read" in note for note in document["notes"])
    missing = document["missing_ranks"]  # named as every page names a long rank list (report.format.rank_list)
    assert f"no readable trace here: 3, 5, {missing[2]}" in " ".join(document["notes"])
    assert any(note.endswith(f" and {len(missing) - 20} more") for note in document["notes"]) == (len(missing) > 20)
    assert len(document["tables"]["stragglers"]) == 6


def test_every_rank_unreadable_is_one_line_and_exit_code_2(tmp_path):
    bad = tmp_path / "rank-0.json"
    bad.write_text("{not json")
    result = subprocess.run([sys.executable, "-m", "gpuprof", "trace", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
