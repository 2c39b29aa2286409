"""Data drawn by name from an iterator is data, wherever the item is made: a generator that tokenizes on the fly,
an itertools chain, an IterableDataset without a DataLoader (tests/loops/generator_loops.py, unmodified under
`gpuprof run`; x-transformers' `cycle()` over a DataLoader is tests/scripts/test_scripts_x_transformers.py). The
iterator gpuprof rebinds gives the loop what the original gives, and is put back at close."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from capture_loop import batch, tiny_model

import gpuprof
from gpuprof.capture.phases import MAX_PROBED_CALLS
from gpuprof.capture.producers import Drawn, DrawnIterator, Place, Span
from gpuprof.report import build_report

LOOPS = Path(__file__).parents[1] / "loops" / "generator_loops.py"
DELAY_S = 0.1  # an item's extra time: several times the tiny model's step on a loaded machine
MICRO_BATCHES = 2  # a step's: its later draws come after its first model call
SHAPES = {  # shape -> what the run names as the data's source
    "tokenizing": "tokenized_batches",
    "chain": "stream (chain)",
    "iterable_dataset": "TokenStream.__iter__",
}


def script(*args, gpuprof_run=()) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *gpuprof_run, str(LOOPS), *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow  # a script run bare and under gpuprof run, in child processes
@pytest.mark.parametrize("shape", SHAPES)
def test_time_inside_an_iterator_the_loop_draws_from_is_data(tmp_path, shape):
    bare = script(shape, DELAY_S, MICRO_BATCHES)
    recorded = script(shape, DELAY_S, MICRO_BATCHES,
                      gpuprof_run=("-m", "gpuprof", "run", "--run-dir", tmp_path / "run"))
    assert recorded.stdout.splitlines()[0] == bare.stdout.strip()  # the same items, to the end (StopIteration)
    report = build_report(tmp_path / "run")
    assert [source["function"] for source in report.meta["phase_sources"]] == [SHAPES[shape]]
    # the iterator is told at the training call after the one that finds it: timed whole from step 2 on
    steps = report.run.steps[report.run.steps["step"] >= 2]
    assert (steps["data_time_s"] >= MICRO_BATCHES * DELAY_S).all(), steps["data_time_s"]
    assert (steps["other_time_s"] < DELAY_S).all(), steps["other_time_s"]
    assert report.verdict.bound == "input", report.verdict.why


def test_a_local_generator_is_rebound_while_recording_and_put_back_at_close(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = numbered_batches(4)
    original = batches
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for _ in range(3):
            inputs = next(batches)
            model(input_ids=inputs, labels=inputs).loss.backward()
            optimizer.step()
            prof.step()
        assert isinstance(batches, DrawnIterator)  # the local itself, rebound in this frame
    assert batches is original and next(batches).equal(batch(3))
    assert [source["function"] for source in gpuprof.load_run(tmp_path / "run").meta["phase_sources"]] == [
        "numbered_batches"]


def numbered_batches(count: int):
    for step in range(count):
        yield batch(step)


def echo():
    received = yield "first"
    while True:
        received = yield f"got {received}"


def test_the_rebound_iterator_forwards_send_throw_close_and_stop_iteration():
    scope = {"stream": echo(), "done": iter([1])}
    frame = sys._getframe()
    span = Span(lambda: None, lambda: None)
    stream, done = (Drawn(Place(scope, name, frame), span) for name in ("stream", "done"))
    proxy = scope["stream"]
    assert next(proxy) == "first" and proxy.send(3) == "got 3" and proxy.gi_frame is not None
    stream.state = "timed"
    assert proxy.send("x") == "got x" and not span.open
    with pytest.raises(KeyError):
        proxy.throw(KeyError("from the loop"))
    assert next(scope["done"]) == 1
    with pytest.raises(StopIteration):
        next(scope["done"])
    proxy.close()
    assert stream.original.gi_frame is None  # closed
    stream.restore()
    done.restore()
    assert scope["stream"] is stream.original and scope["done"] is done.original


def test_an_iterator_that_never_feeds_the_model_is_put_back(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    counter = iter(range(100))
    with gpuprof.profile(tmp_path / "run", model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(MAX_PROBED_CALLS + 2):
            next(counter)
            inputs = batch(step)
            model(input_ids=inputs, labels=inputs).loss.backward()
            optimizer.step()
            prof.step()
        assert not isinstance(counter, DrawnIterator)
    sources = gpuprof.load_run(tmp_path / "run").meta["phase_sources"]
    assert [source["function"] for source in sources] == ["batch"]  # the function the inputs came from alone
