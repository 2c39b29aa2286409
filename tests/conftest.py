"""Checks every test run: capture never switches itself off unless the test asks for it."""

from __future__ import annotations

import pytest

SWITCHED_OFF = ("collector_disabled", "profiler_disabled")


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
    without loader workers ("no_workers"), fed by 4 workers ("workers"), and two spans of one worker."""
    from gpt2_runs import record_plugin_trace

    root = tmp_path_factory.mktemp("plugin")
    return {
        "no_workers": record_plugin_trace(root / "no_workers", num_workers=0),
        "workers": record_plugin_trace(root / "workers", num_workers=4),
        "two_spans": record_plugin_trace(root / "two_spans", num_workers=4, spans=2),
    }
