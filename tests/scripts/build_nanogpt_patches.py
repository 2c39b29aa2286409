"""What build-nanogpt's train_gpt2.py gets at run time, in its own process, before it starts (corpus_build_nanogpt.py
describes the whole): its sizes and evaluation cadence, tiktoken offline, CUDA for its DDP branch on a CPU, and
the faults its tests break it with. The script's own names are patched as it binds them (corpus_patches.after_binding).
"""

from __future__ import annotations

import functools
import sys
import time
import types

from corpus_patches import after_binding

VOCAB = 256  # the byte-level stand-in for tiktoken
MODEL = dict(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32)  # GPTConfig's fields


def offline_tiktoken() -> None:
    """tiktoken downloads its GPT-2 encoding at first use: a byte-level encoding stands in for it."""
    class Bytes:
        n_vocab = VOCAB

        @staticmethod
        def encode(text: str) -> list[int]:
            return list(text.encode("utf-8"))

        @staticmethod
        def decode(tokens: list[int]) -> str:
            return bytes(tokens).decode("utf-8", errors="replace")

    module = types.ModuleType("tiktoken")
    module.get_encoding = lambda name: Bytes()
    sys.modules["tiktoken"] = module


def shrink(names: dict, eval_every: int) -> None:
    """The script's constants `names` rebound as it binds them, every GPTConfig it makes MODEL, and `max_steps` a
    StepCount evaluating every `eval_every` steps."""
    for name, value in names.items():
        after_binding(name, lambda _, value=value: value)
    after_binding("max_steps", lambda steps: StepCount(steps, eval_every))
    after_binding("GPTConfig", _made_small)


class StepCount(int):
    """`max_steps`, whose `max_steps - 1` is a LastStep."""

    def __new__(cls, steps: int, eval_every: int):
        count = super().__new__(cls, steps)
        count.eval_every = eval_every
        return count

    def __sub__(self, other):
        return LastStep(int(self) - 1, self.eval_every) if other == 1 else int(self) - other


class LastStep(int):
    """The last step, which a step equals (`step == max_steps - 1`: the subclass's __eq__ comes first) when it is the
    last or a multiple of `eval_every` after 0."""

    def __new__(cls, step: int, eval_every: int):
        last = super().__new__(cls, step)
        last.eval_every = eval_every
        return last

    def __eq__(self, step):
        return int(step) == int(self) or (step > 0 and step % self.eval_every == 0)

    __hash__ = int.__hash__


def _made_small(config_class):
    init = config_class.__init__

    @functools.wraps(init)
    def small_init(config, *args, **kwargs):
        init(config, **MODEL)

    config_class.__init__ = small_init
    return config_class


def cuda_asserted_on_cpu() -> None:
    """Under torchrun the script asserts `torch.cuda.is_available()` and puts each rank on `cuda:LOCAL_RANK`: CUDA is
    available to the script's own calls (gpuprof's see the machine as it is), and its device is the CPU."""
    import torch

    is_available = torch.cuda.is_available

    @functools.wraps(is_available)
    def available_to_the_script():
        return sys._getframe(1).f_globals.get("__name__") == "__main__" or is_available()

    torch.cuda.is_available = available_to_the_script
    after_binding("device", lambda device: "cpu")


# ---------------------------------------------------------------------------------------------- faults
def slow_hellaswag(delay_s: float) -> None:
    """Each HellaSwag example takes `delay_s` longer to render (its render_example, as the script imported it): a
    HellaSwag evaluation of many examples, as the real one's 10,042."""
    def patch(render_example):
        @functools.wraps(render_example)
        def slow_render_example(example):
            time.sleep(delay_s)
            return render_example(example)

        return slow_render_example

    after_binding("render_example", patch)
