"""Checks every test run (capture never switches itself off unless the test asks for it), and orders
the test files for two workers."""

from __future__ import annotations

import pytest

SWITCHED_OFF = ("collector_disabled", "profiler_disabled")


def pytest_collection_modifyitems(items):
    """Files holding a `slow` test come first, each file kept whole. scripts/test.sh hands whole files
    to two workers in collection order (--dist loadfile --no-loadscope-reorder; xdist would otherwise
    order them by their number of tests, which puts the few-test, longest files last), so a long file
    never starts when the other worker is nearly done."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: the order within each group stays


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A run a test recorded under its tmp_path holds no switched-off event, unless the test is marked
    `capture_may_switch_off` (it breaks a collector on purpose)."""
    result = yield
    tmp_path = item.funcargs.get("tmp_path")
    if tmp_path is not None and not item.get_closest_marker("capture_may_switch_off"):
        switched_off = [f"{meta.parent}: {message}" for meta in tmp_path.rglob("meta.json")
                        for message in _switched_off(meta.parent)]
        assert not switched_off, "capture switched itself off:\n" + "\n".join(switched_off)
    return result


def _switched_off(run_dir) -> list[str]:
    import gpuprof
    from gpuprof.errors import GpuprofError

    try:
        events = gpuprof.load_run(run_dir).events
    except GpuprofError:
        return []  # a run a bad-input test broke on purpose
    if events.empty or "kind" not in events.columns:
        return []
    return events[events["kind"].isin(SWITCHED_OFF)]["message"].tolist()


@pytest.fixture(scope="session")
def plugin_traces(tmp_path_factory) -> dict:
    """Real traces of the tiny GPT-2 on a slow Dataset, written by tensorboard_trace_handler: input-bound
    without loader workers ("no_workers"), fed by 8 workers ("workers": ahead of the loop by 3.2x, so also
    when the machine's load drops after the step was timed and the step gets that much faster), and two
    spans of one worker."""
    from gpt2_runs import record_plugin_trace

    root = tmp_path_factory.mktemp("plugin")
    return {
        "no_workers": record_plugin_trace(root / "no_workers", num_workers=0),
        "workers": record_plugin_trace(root / "workers", num_workers=8),
        "two_spans": record_plugin_trace(root / "two_spans", num_workers=4, spans=2),
    }



@pytest.fixture(scope="session")
def views_trace(tmp_path_factory):
    """A folder as tensorboard_trace_handler writes it: a real CPU torch.profiler trace of a small plain-torch
    model with every option the plugin's views need (views_model.record_views_trace)."""
    from views_model import record_views_trace

    return record_views_trace(tmp_path_factory.mktemp("views") / "views")
