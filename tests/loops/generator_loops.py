"""Training loops that draw their batches by name from an iterator, each slow inside it (run as a script, bare or
under `gpuprof run`): `python generator_loops.py SHAPE DELAY_S MICRO_BATCHES`.

- `tokenizing`: a generator that tokenizes text on the fly, held in a local of `main_tokenizing()`, drawn until it
  runs out (the loop ends on its StopIteration) and closed after;
- `chain`: an `itertools.chain` of two slow sources, held in a module global the top-level loop reads;
- `iterable_dataset`: a torch IterableDataset's `iter()`, without a DataLoader, held in an attribute of the
  trainer object whose method draws from it.

Every step is MICRO_BATCHES micro-batches (more than one: then the time before a step's first model call is not all
of its data), each item DELAY_S slower to make. The script prints a checksum of every token the loop was given: the
same under gpuprof as bare.
"""

from __future__ import annotations

import itertools
import sys
import time

import torch
from torch.utils.data import IterableDataset

VOCAB = 64
SEQ_LEN = 16
BATCH = 4
STEPS = 6
SHAPE, DELAY_S, MICRO_BATCHES = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.head(self.embed(x)).flatten(0, 1), y.flatten())


def tokenize(text: str) -> list[int]:
    time.sleep(DELAY_S / BATCH)  # a slow tokenizer: DELAY_S a batch
    return [ord(char) % VOCAB for char in text]


def tokenized_batches(lines: list[str]):
    for start in range(0, len(lines), BATCH):
        tokens = torch.tensor([tokenize(line)[:SEQ_LEN + 1] for line in lines[start:start + BATCH]])
        yield tokens[:, :-1], tokens[:, 1:]


def slow_source(seed: int):
    generator = torch.Generator().manual_seed(seed)
    while True:
        time.sleep(DELAY_S)  # a slow read
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


class TokenStream(IterableDataset):
    def __iter__(self):
        yield from slow_source(1)


class Trainer:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.batches = iter(TokenStream())
        self.checksum = 0

    def fit(self):
        for _ in range(STEPS):
            for _ in range(MICRO_BATCHES):
                x, y = next(self.batches)
                self.checksum += int(x.sum())
                self.model(x, y).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def model_and_optimizer():
    torch.manual_seed(0)
    model = TinyLM()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def main_tokenizing() -> int:
    model, optimizer = model_and_optimizer()
    lines = [f"line {index:04d} of some text to tokenize" for index in range(BATCH * MICRO_BATCHES * STEPS)]
    batches = tokenized_batches(lines)
    checksum = 0
    while True:
        for _ in range(MICRO_BATCHES):
            try:
                x, y = next(batches)
            except StopIteration:
                batches.close()
                return checksum
            checksum += int(x.sum())
            model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()


def main_iterable_dataset() -> int:
    trainer = Trainer(*model_and_optimizer())
    trainer.fit()
    return trainer.checksum


if SHAPE == "tokenizing":
    print("checksum", main_tokenizing())
elif SHAPE == "chain":
    model, optimizer = model_and_optimizer()
    stream = itertools.chain(itertools.islice(slow_source(2), STEPS), slow_source(3))
    checksum = 0
    for _ in range(STEPS):
        for _ in range(MICRO_BATCHES):
            x, y = next(stream)
            checksum += int(x.sum())
            model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    print("checksum", checksum)
elif SHAPE == "iterable_dataset":
    print("checksum", main_iterable_dataset())
else:
    sys.exit(f"unknown shape {SHAPE}")
