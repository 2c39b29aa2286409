"""Data sources become token files; bad data is a DataError naming the problem."""

from __future__ import annotations

import numpy as np
import pytest

from gpuprof.errors import DataError, GpuprofError
from gpuprof.workloads.gpt2 import prepare, token_file
from gpuprof.workloads.gpt2.data import END_OF_TEXT, TOKENIZER_VOCAB_SIZE, load_tokens


def test_default_corpus_is_tokenized_once_and_cached(token_cache):
    path = token_file(None, 50304)
    assert path.is_relative_to(token_cache) and (path.parent / "tokenizer.json").is_file()
    tokens = np.fromfile(path, dtype=np.uint16)
    assert len(tokens) > 500_000 and tokens.max() < TOKENIZER_VOCAB_SIZE
    written = path.stat().st_mtime_ns
    assert token_file(None, 50304) == path and path.stat().st_mtime_ns == written


def test_text_file_and_folder_round_trip_through_the_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    text = "def add(a, b):\n    return a + b\n" * 400
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_text(text)
    (tmp_path / "corpus" / "b.txt").write_text(text.upper())
    for source in (tmp_path / "corpus" / "a.py", tmp_path / "corpus"):
        path = token_file(str(source), 8192)
        tokenizer = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
        decoded = tokenizer.decode(np.fromfile(path, dtype=np.uint16).tolist(), skip_special_tokens=False)
        assert text in decoded and decoded.count(END_OF_TEXT) == (1 if source.is_file() else 2)


def test_bin_file_is_used_as_is(tmp_path, small):
    ids = np.arange(1000, dtype=np.uint16) % 100
    ids.tofile(tmp_path / "train.bin")
    session = prepare(small(data=str(tmp_path / "train.bin"), seq_len=16, batch_size=2))
    inputs, targets = session.batches.next()
    assert inputs.shape == (2, 16) and int(inputs.max()) < 100
    assert token_file(str(tmp_path / "train.bin"), 8192) == tmp_path / "train.bin"


def test_batches_cover_every_sequence_once_per_epoch_then_reshuffle(tmp_path, small):
    np.arange(16 * 10 + 1, dtype=np.uint16).tofile(tmp_path / "count.bin")  # 10 sequences of 16
    session = prepare(small(data=str(tmp_path / "count.bin"), seq_len=16, batch_size=2, vocab_size=512))
    epochs = [[int(first) // 16 for _ in range(5) for first in session.batches.next()[0][:, 0]]
              for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(10))
    assert epochs[0] != epochs[1]
    assert session.batches.position == {"epoch": 1, "index": 10}


@pytest.mark.parametrize(
    ("ids", "vocab", "message"),
    [([1, 2, 9000] * 50, 8192, "token id 9000, beyond the model vocabulary of 8192"),
     ([1, 2, 3], 8192, r"one sequence needs seq_len \+ 1")],
)
def test_unusable_token_files(tmp_path, ids, vocab, message):
    np.asarray(ids, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match=message):
        load_tokens(tmp_path / "t.bin", vocab, seq_len=16)


def test_missing_empty_and_too_small_data(tmp_path, small):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "small.bin")
    (tmp_path / "short.txt").write_text("print('hello')\n")
    cases = {"missing.txt": "does not exist", "missing.bin": "does not exist", "empty.txt": "no text found",
             "empty_dir": "holds no files", "odd.bin": "not a uint16 token file",
             "small.bin": "needs 8", "short.txt": r"short.txt holds \d+ tokens; one sequence needs"}  # 1 sequence of 64 tokens; a micro-batch needs 8
    for name, message in cases.items():
        with pytest.raises(DataError, match=message):
            prepare(small(data=str(tmp_path / name)))


def test_missing_or_foreign_checkpoint(tmp_path, small):
    with pytest.raises(GpuprofError, match="does not exist"):
        prepare(small(resume=str(tmp_path / "nope.pt")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(GpuprofError, match="no checkpoint"):
        prepare(small(resume=str(tmp_path / "empty")))
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(GpuprofError, match="cannot read checkpoint"):
        prepare(small(resume=str(tmp_path / "junk.pt")))
