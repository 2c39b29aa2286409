"""Replay bundles are data only: a bundle that would run code, or holds no tensors, is refused in one line."""

from __future__ import annotations

import pytest
import torch

from gpuprof.cli import main
from gpuprof.numerics import bundle


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
    ({"format": bundle.FORMAT, "step": 1}, "incomplete"),
    ({"format": bundle.FORMAT, "format_version": 99}, "newer gpuprof"),
])
def test_foreign_bundles_are_refused(tmp_path, capsys, contents, message):
    path = tmp_path / "foreign.pt"
    torch.save(contents, path)
    assert message in _replay_error(path, capsys)


def test_non_tensor_model_state_is_refused(tmp_path, capsys):
    path = tmp_path / "strings.pt"
    fields = {key: {} for key in bundle._REQUIRED}
    torch.save({**fields, "format": bundle.FORMAT, "model_state": {"w": "not a tensor"}}, path)
    assert "not all tensors" in _replay_error(path, capsys)


def test_not_a_file_at_all(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert "not a replay bundle" in _replay_error(text, capsys)
    assert "does not exist" in _replay_error(tmp_path / "missing.pt", capsys)
