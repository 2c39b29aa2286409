"""Training data: a corpus turned into a uint16 token file, cut into fixed-length sequences.

Every source ends as a nanoGPT-style `.bin` file (a flat array of uint16 token ids):
- no `--data`: the Python standard library's own sources, a corpus every machine has;
- `--data FILE.txt` or `--data FOLDER`: the user's text;
- `--data FILE.bin`: already tokenized, used as is.
Text is tokenized by a byte-level BPE trained on a bounded sample of that text with
the `tokenizers` library; tokenizer and token file are cached under `cache_dir()`,
keyed by the corpus files' names, sizes and modification times.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from gpuprof.errors import DataError

TOKENIZER_VOCAB_SIZE = 8192
TOKENIZER_SAMPLE_BYTES = 2_000_000  # what the BPE is trained on: about a second
CORPUS_MAX_BYTES = 8_000_000  # what gets tokenized: a few million tokens
END_OF_TEXT = "<|endoftext|>"
_CACHE_FORMAT = 1


def cache_dir() -> Path:
    """GPUPROF_CACHE, else $XDG_CACHE_HOME/gpuprof, else ~/.cache/gpuprof."""
    if os.environ.get("GPUPROF_CACHE"):
        return Path(os.environ["GPUPROF_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "gpuprof"


def token_file(data: str | None, vocab_size: int) -> Path:
    """The `.bin` token file for `--data` (None: the standard library corpus)."""
    if data is not None and Path(data).suffix == ".bin":
        path = Path(data)
        if not path.is_file():
            raise DataError(f"data file {data} does not exist")
        return path
    files = _text_files(data)
    return _tokenized(files, min(TOKENIZER_VOCAB_SIZE, vocab_size), data or "the standard library")


def load_tokens(path: Path, vocab_size: int, seq_len: int, name: str | None = None) -> np.memmap:
    """The token file as a read-only array, after checking it can feed the model.
    `name` is what error messages call the data (default: the file)."""
    name = name or str(path)
    size = path.stat().st_size
    if size % 2:
        raise DataError(f"{name} is not a uint16 token file (odd size {size} bytes)")
    if size < 2 * (seq_len + 1):
        raise DataError(
            f"{name} holds {size // 2} tokens; one sequence needs seq_len + 1 = {seq_len + 1}"
        )
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    largest = int(tokens.max())
    if largest >= vocab_size:
        raise DataError(
            f"{name} holds token id {largest}, beyond the model vocabulary of {vocab_size} "
            f"(raise --vocab-size)"
        )
    return tokens


# --------------------------------------------------------------------------- corpus


def _text_files(data: str | None) -> list[Path]:
    if data is None:
        return list(_standard_library_files())
    path = Path(data)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise DataError(f"data folder {data} holds no files")
        return files
    raise DataError(f"data path {data} does not exist")


@functools.lru_cache(maxsize=1)
def _standard_library_files() -> tuple[Path, ...]:
    """Listed once per process: walking the standard library takes a CPU-second, every prepare() needs it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return tuple(sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)))


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    return "" if b"\x00" in raw[:4096] else raw.decode("utf-8", errors="replace")  # skip binaries


def _corpus_documents(files: list[Path], source: str) -> list[str]:
    """A deterministic, diverse sample of the files, at most CORPUS_MAX_BYTES of text."""
    order = list(files)
    random.Random(0).shuffle(order)
    documents, total = [], 0
    for path in order:
        text = _read_text(path)
        if text.strip():
            documents.append(text)
            total += len(text)
        if total >= CORPUS_MAX_BYTES:
            break
    if not documents:
        raise DataError(f"no text found in {source}")
    return documents


def _cache_key(files: list[Path], tokenizer_vocab: int) -> str:
    digest = hashlib.sha1(f"{_CACHE_FORMAT} {tokenizer_vocab} {CORPUS_MAX_BYTES}".encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _tokenized(files: list[Path], tokenizer_vocab: int, source: str) -> Path:
    folder = cache_dir() / "data" / _cache_key(files, tokenizer_vocab)
    bin_path = folder / "tokens.bin"
    if bin_path.is_file():
        return bin_path
    started = time.perf_counter()
    documents = _corpus_documents(files, source)
    tokenizer = train_tokenizer(documents, tokenizer_vocab)
    ids = [enc.ids for enc in tokenizer.encode_batch([doc + END_OF_TEXT for doc in documents])]
    tokens = np.fromiter((i for doc in ids for i in doc), dtype=np.uint16)
    # tokenizers refuses to use its thread pool after a fork (DataLoader workers) and warns.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / "tokenizer.json", tokenizer.to_str().encode())
    info = {"files": len(files), "documents": len(documents), "tokens": len(tokens),
            "tokenizer_vocab_size": tokenizer.get_vocab_size(),
            "build_time_s": round(time.perf_counter() - started, 3)}
    _write_atomic(folder / "meta.json", json.dumps(info, indent=1).encode())
    _write_atomic(bin_path, tokens.tobytes())
    return bin_path


def train_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2's scheme) trained on the first TOKENIZER_SAMPLE_BYTES of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_sample(documents, TOKENIZER_SAMPLE_BYTES), trainer=trainer)
    return tokenizer


def _sample(documents: list[str], max_chars: int):
    total = 0
    for doc in documents:
        yield doc
        total += len(doc)
        if total >= max_chars:
            return


def _write_atomic(path: Path, content: bytes) -> None:
    """Concurrent builders (ranks, test workers) each write whole files; the last rename wins."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(content)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- batches


class TokenSequences(Dataset):
    """Non-overlapping windows of seq_len + 1 tokens: inputs are [:-1], targets [1:]."""

    def __init__(self, path: Path, n_tokens: int, seq_len: int):
        self.path, self.seq_len = path, seq_len
        self.n_sequences = (n_tokens - 1) // seq_len
        self._tokens = None  # opened lazily, so worker processes do not pickle the data

    def __len__(self) -> int:
        return self.n_sequences

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        start = index * self.seq_len
        return torch.from_numpy(self._tokens[start:start + self.seq_len + 1].astype(np.int64))


class ShardedSampler(Sampler):
    """A per-epoch shuffle shared by all ranks, each rank taking every world_size-th item.

    Like DistributedSampler, plus a start offset so a resumed run continues the exact
    order: `(epoch, start)` is the data position stored in checkpoints.
    """

    def __init__(self, n_items: int, rank: int, world_size: int, seed: int):
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.per_rank = n_items // world_size
        self.n_items, self.epoch, self.start = n_items, 0, 0

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n_items, generator=generator)
        mine = order[: self.per_rank * self.world_size][self.rank :: self.world_size]
        return iter(mine[self.start :].tolist())

    def __len__(self) -> int:
        return self.per_rank - self.start


class Collate:
    """Stacks windows into (inputs, targets); `delay_ms` makes a slow loader on purpose."""

    def __init__(self, delay_ms: float):
        self.delay_s = delay_ms / 1000

    def __call__(self, windows: list[torch.Tensor]):
        if self.delay_s:
            time.sleep(self.delay_s)
        batch = torch.stack(windows)
        return batch[:, :-1], batch[:, 1:]


class Batches:
    """Endless micro-batches across epochs, with a position that checkpoints can restore."""

    def __init__(self, loader: DataLoader, sampler: ShardedSampler):
        self.loader, self.sampler = loader, sampler
        self.index = 0  # sequences this rank consumed in the current epoch
        self._iterator = None

    def next(self):
        if self._iterator is None:
            self._iterator = iter(self.loader)
        batch = next(self._iterator, None)
        if batch is None:
            self.restore({"epoch": self.sampler.epoch + 1, "index": 0})
            self._iterator = iter(self.loader)
            batch = next(self._iterator)
        self.index += self.loader.batch_size
        return batch

    @property
    def position(self) -> dict:
        return {"epoch": self.sampler.epoch, "index": self.index}

    def restore(self, position: dict) -> None:
        self.sampler.epoch, self.sampler.start = position["epoch"], position["index"]
        self.index, self._iterator = position["index"], None


def build_batches(config, rank: int, world_size: int, use_pinned_memory: bool) -> Batches:
    """The loader for one rank: micro-batches of `config.micro_batch_size` sequences."""
    name = config.data or "the standard library corpus"
    path = token_file(config.data, config.vocab_size)
    tokens = load_tokens(path, config.vocab_size, config.seq_len, name)
    dataset = TokenSequences(path, len(tokens), config.seq_len)
    needed = config.micro_batch_size * world_size
    if len(dataset) < needed:
        raise DataError(
            f"{name} holds {len(dataset)} sequences of {config.seq_len} "
            f"tokens; a micro-batch on {world_size} rank(s) needs {needed} "
            f"(lower --batch-size or --seq-len)"
        )
    sampler = ShardedSampler(len(dataset), rank, world_size, config.seed)
    loader = DataLoader(
        dataset,
        batch_size=config.micro_batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=config.num_workers,
        pin_memory=use_pinned_memory,
        persistent_workers=config.num_workers > 0,
        collate_fn=Collate(config.data_delay_ms),
        # Its own generator: creating an iterator must not draw from the global RNG,
        # or a resumed run would see different dropout masks.
        generator=torch.Generator(),
    )
    return Batches(loader, sampler)
