"""Replay bundles are data only: a bundle that would run code, or holds no tensors, is refused in one line;
so is any bundle of another shape (hypothesis fuzzes a real one: wrong types, missing keys, newer versions)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numerics_helpers import VOCAB
from transformers import GPT2Config, GPT2LMHeadModel

import gpuprof
from gpuprof.cli import main
from gpuprof.numerics import bundle

# Each example may rebuild and re-run a model (seconds on a loaded CPU): few, and the same every run.
FUZZ = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# Fields `gpuprof replay` reads, as paths into the bundle (a number indexes a list).
BUNDLE_FIELDS = [("step",), ("rank",), ("model_state",), ("optimizer",), ("optimizer", "class"),
                 ("optimizer", "params"), ("optimizer", "state_dict"), ("optimizer", "state_dict", "state"),
                 ("optimizer", "state_dict", "param_groups"), ("optimizer", "state_dict", "param_groups", 0),
                 ("optimizer", "state_dict", "param_groups", 0, "params"),
                 ("optimizer", "state_dict", "param_groups", 0, "lr"), ("scaler",), ("rng",), ("rng", "cpu"),
                 ("micro_batches",), ("micro_batches", 0), ("loss",), ("inputs",), ("inputs", "training"),
                 ("inputs", "autocast"), ("builder",), ("builder", "name"), ("builder", "config"),
                 ("builder", "config", "class"), ("builder", "config", "model_config"),
                 ("builder", "config", "model_config", "n_layer"), ("blame",), ("format_version",),
                 ("device_type",)]
DELETE = "<delete>"
VALUES = st.one_of(st.just(DELETE), st.none(), st.booleans(), st.integers(-2, 3), st.text(max_size=4),
                   st.lists(st.integers(0, 2), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def minimal_bundle() -> dict:
    """The fewest fields a bundle has, each of the right type."""
    return {"format": bundle.FORMAT, "format_version": bundle.FORMAT_VERSION, "step": 1, "rank": 0,
            "model_state": {}, "optimizer": None, "rng": {}, "micro_batches": [], "inputs": {"training": True},
            "blame": {}}


@pytest.fixture(scope="module")
def real_bundle(tmp_path_factory) -> dict:
    """The bundle of a real run: a tiny GPT-2 whose embedding goes NaN at step 1."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_dir = tmp_path_factory.mktemp("bundle") / "run"
    with gpuprof.profile(run_dir, model=model, optimizer=optimizer, sample_interval_s=0) as prof:
        for step in range(3):
            if step == 1:
                with torch.no_grad():
                    model.transformer.wte.weight[3, 0] = float("nan")
            tokens = torch.full((2, 8), 3)
            model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    [path] = (run_dir / "numerics").glob("*.pt")
    return bundle.load(path)


def changed(contents: dict, path: tuple, value) -> dict:
    """A copy of the bundle with the field at `path` set to `value` (or removed); unchanged where absent."""
    import copy

    contents = copy.deepcopy(contents)
    node = contents
    for key in path[:-1]:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return contents
    if isinstance(node, dict) and value == DELETE:
        node.pop(path[-1], None)
    elif isinstance(node, dict) or (isinstance(node, list) and isinstance(path[-1], int) and path[-1] < len(node)):
        node[path[-1]] = value
    return contents


class _Payload:
    """Unpickling this would create `marker`: what a hostile bundle could do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _replay_error(path, capsys) -> str:
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    return err[0]


def test_code_in_a_bundle_is_refused_and_not_run(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": bundle.FORMAT, "model_state": _Payload(marker)}, path)
    assert "not a safe replay bundle" in _replay_error(path, capsys)
    assert not marker.exists()


@pytest.mark.parametrize("contents,message", [
    ({"weights": torch.ones(2)}, "not a gpuprof replay bundle"),
    ({"format": bundle.FORMAT, "step": 1}, "missing rank"),
    ({"format": bundle.FORMAT, "format_version": 99}, "newer gpuprof"),
])
def test_foreign_bundles_are_refused(tmp_path, capsys, contents, message):
    path = tmp_path / "foreign.pt"
    torch.save(contents, path)
    assert message in _replay_error(path, capsys)


def test_non_tensor_model_state_is_refused(tmp_path, capsys):
    path = tmp_path / "strings.pt"
    torch.save({**minimal_bundle(), "model_state": {"w": "not a tensor"}}, path)
    assert "model_state[...]: expected Tensor, got str" in _replay_error(path, capsys)


def test_not_a_file_at_all(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "not a replay bundle" in _replay_error(text, capsys)
    assert "does not exist" in _replay_error(tmp_path / "missing.pt", capsys)


def test_a_real_bundle_replays_with_its_blame(real_bundle, tmp_path, capsys):
    path = tmp_path / "real.pt"
    torch.save(real_bundle, path)
    assert main(["replay", str(path)]) == 0
    assert "transformer.wte" in capsys.readouterr().out


@pytest.mark.parametrize("path,value,said", [
    (("optimizer",), "AdamW", "optimizer: expected object | array, got str"),
    (("optimizer", "state_dict", "param_groups", 0, "params"), ["0"], "params[0]: expected int, got str"),
    (("inputs",), DELETE, "missing inputs"),
    (("micro_batches",), {"input_ids": 1}, "micro_batches: expected array, got object"),
    (("builder", "config", "model_config", "n_layer"), "two", "model config builds no model"),
    (("optimizer", "params"), ["nope"], "state does not fit the model"),
    (("blame",), {}, "missing blame.step"),
    (("blame", "notes"), "none", "blame.notes: expected array, got str"),
    (("micro_batches", 0), {}, "missing micro_batches[0].items"),
    (("micro_batches", 0, "items"), [{"function": "add"}], "recorded loss cannot be replayed"),
])
def test_a_bundle_of_another_shape_is_one_line(real_bundle, tmp_path, capsys, path, value, said):
    target = tmp_path / "bad.pt"
    torch.save(changed(real_bundle, path, value), target)
    assert said in _replay_error(target, capsys)


@pytest.mark.parametrize("path", [("scaler",), ("loss",), ("inputs", "autocast")])
def test_a_bundle_without_a_field_it_may_leave_out_replays(real_bundle, tmp_path, capsys, path):
    target = tmp_path / "lean.pt"
    torch.save(changed(real_bundle, path, DELETE), target)
    assert main(["replay", str(target)]) == 0, capsys.readouterr().err
    assert "transformer.wte" in capsys.readouterr().out


@FUZZ
@given(field=st.sampled_from(BUNDLE_FIELDS), value=VALUES)
def test_fuzzed_bundles_replay_or_are_refused_in_one_line(real_bundle, capsys, field, value):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "fuzzed.pt"
        torch.save(changed(real_bundle, field, value), path)
        code = main(["replay", str(path)])
        out, err = capsys.readouterr()
        assert code in (0, 1, 2), (field, value)  # 1: replayed, and the blame differs from the recorded one
        if code == 2:
            assert len(err.strip().splitlines()) == 1, err
