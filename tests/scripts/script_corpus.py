"""Real public training scripts, written elsewhere, run unmodified under `gpuprof run`.

The scripts are not copied into this repository: each is read at test time, byte for byte, from the
script cache outside it (corpus_cache.py: pinned in corpus_pins.tsv with their SHA-256, filled by
`python scripts/get_corpus.py`), with its licence file beside it, into the test's own folder. A pinned
script missing from the cache fails its tests. See README.md beside this file.

Harness API (for any test folder: `from script_corpus import ...`):

    run_nanogpt(tmp_path, patches=(), **config)          -> ScriptRun
        karpathy/nanoGPT train.py on random tokens (data/corpus/{train,val}.bin, meta.pkl with
        NANOGPT_VOCAB), a tiny model on the CPU; `config` overrides NANOGPT_CONFIG and is passed
        as nanoGPT's own `--key=value` arguments (max_iters=10 runs iterations 0..10: 11 steps).
    run_accelerate_clm(tmp_path, patches=(), lines=CLM_LINES, args=(), ranks=1)   -> ScriptRun
        accelerate's examples/by_feature/gradient_accumulation_for_autoregressive_models.py
        (accelerator.backward, gradient accumulation, eval after each of its 3 epochs) on a local
        text file, a BPE tokenizer trained here with `tokenizers` and a tiny GPT-2 built from a
        config, fully offline; `args` go to the script (`--gradient_accumulation_steps 2`); `ranks` > 1
        runs it under torchrun, each rank a process of Accelerate's multi-CPU DDP.
    run_lightning_transformer(tmp_path, patches=(), max_steps=10, ranks=1, devices=None) -> ScriptRun
        Lightning's examples/pytorch/basics/transformer.py (a LightningModule, Trainer.fit, a
        validation loop) on a local word file, the Trainer limited to `max_steps` steps; under torchrun with
        `ranks` > 1, and `devices` for the Trainer's DDP strategy (without it each process trains alone).
    run_word_language_model(tmp_path, patches=(), flags=(), **args) -> ScriptRun
        pytorch/examples' word_language_model/main.py (an LSTM updating its weights by hand with
        `p.data.add_(p.grad, alpha=-lr)` unless `--use-optimizer` is in `flags`, `torch.save(model)`
        at each epoch) on random words written as data/wikitext-2/{train,valid,test}.txt; `args`
        override WLM_ARGS as its own `--key=value` arguments.
    run_chargpt(tmp_path, patches=(), **config) -> ScriptRun
        karpathy/minGPT's projects/chargpt/chargpt.py with its mingpt package beside it (its own Trainer
        class holding the optimizer as an attribute, a model returning `(logits, loss)`, a callback after
        every iteration that samples from the model once in 500) on random words as input.txt; `config`
        overrides CHARGPT_CONFIG as minGPT's own `--section.key=value` arguments.
    run_x_transformers(tmp_path, patches=(), gpuprof_args=(), how=run_script, **names) -> ScriptRun
        (corpus_x_transformers.py) lucidrains/x-transformers' train_enwik8.py with its x_transformers package beside
        it: a plain loop of gradient accumulation drawing its batches with `next()` from a generator (`cycle()` over a
        DataLoader), validating and generating (`model.generate`) every few iterations, on random bytes as enwik8.
    run_script(name, tmp_path, script_args, patches=(), env=None, timeout_s=..., ranks=1, gpuprof_args=())
        -> ScriptRun
        any SOURCES entry, once its data is in `tmp_path/work` (the scripts' working directory); `gpuprof_args`
        go to `gpuprof run` (`--hang-timeout-s 10`). script_launch(...) is its command, environment and folders,
        for a test that starts (and stops) the job itself.

`patches` apply faults and slowdowns at run time, inside the script's process, before the script
starts: each is `"module:function"` or `("module:function", {kwargs})`, the module importable from
tests/scripts (corpus_patches.py holds the offline set-ups and the faults) or from any folder on
the test's PYTHONPATH. The function is called once, before `gpuprof run` starts the script; to
patch a module the script imports later use `corpus_patches.after_import(name, fn)`.
A ScriptRun has `.run` (gpuprof.load_run of its run directory, or None if none was written),
`.returncode`, `.stdout`, `.stderr`, `.run_dir` and `.workdir`. `assert_recorded(result, steps)` checks
that it finished and recorded `steps` steps with finite gradient norms, and returns its run.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from corpus_cache import HOW_TO_FILL, LICENCE_PATH, cache_root, licensed, pins, read_pinned
from numerics.numerics_helpers import events
from processes import torchrun

import gpuprof

HERE = Path(__file__).parent
RUNNER = HERE / "corpus_runner.py"
TIMEOUT_S = 600  # a loaded 2-core machine; the runs themselves take seconds


@dataclass(frozen=True)
class Source:
    repo: str  # owner/name on GitHub
    commit: str
    files: tuple[str, ...]  # paths in the repository, each pinned with its SHA-256 in corpus_pins.tsv
    entry: str  # the script `gpuprof run` runs, one of `files`
    packages: tuple[str, ...] = ()  # folders the script imports as packages: kept as they are, beside it


EXAMPLES = ("pytorch/examples", "77f55b912142e11fcfdf5b530231fb9c52f181e8")
SOURCES = {
    "nanogpt": Source("karpathy/nanoGPT", "3adf61e154c3fe3fca428ad6bc3818b27a3b8291",
                      ("train.py", "model.py", "configurator.py"), entry="train.py"),
    "accelerate_clm": Source(
        "huggingface/accelerate", "16cb6eb80dd9aa8b4df1a63ef57863e455d53b83",
        ("examples/by_feature/gradient_accumulation_for_autoregressive_models.py",),
        entry="examples/by_feature/gradient_accumulation_for_autoregressive_models.py"),
    "lightning_transformer": Source(
        "Lightning-AI/pytorch-lightning", "7f0c3436cd3f6ad3753125672024fc415cbcb414",
        ("examples/pytorch/basics/transformer.py",), entry="examples/pytorch/basics/transformer.py"),
    "word_language_model": Source(
        *EXAMPLES, ("word_language_model/main.py", "word_language_model/data.py", "word_language_model/model.py"),
        entry="word_language_model/main.py"),
    "mingpt": Source(
        "karpathy/minGPT", "37baab71b9abea1b76ab957409a1cc2fbfba8a26",
        ("projects/chargpt/chargpt.py", "mingpt/__init__.py", "mingpt/model.py", "mingpt/trainer.py",
         "mingpt/utils.py"),
        entry="projects/chargpt/chargpt.py", packages=("mingpt",)),
    "build_nanogpt": Source(  # no licence file: read from a git copy only
        "karpathy/build-nanogpt", "6104ab1b53920f6e2159749676073ff7d815c1fa", ("train_gpt2.py", "hellaswag.py"),
        entry="train_gpt2.py"),
    "fsdp2_example": Source(
        *EXAMPLES, ("distributed/FSDP2/example.py", "distributed/FSDP2/model.py", "distributed/FSDP2/checkpoint.py",
                    "distributed/FSDP2/utils.py"),
        entry="distributed/FSDP2/example.py"),
    "ddp_tutorial": Source(
        *EXAMPLES, ("distributed/ddp-tutorial-series/multigpu_torchrun.py",
                    "distributed/ddp-tutorial-series/datautils.py"),
        entry="distributed/ddp-tutorial-series/multigpu_torchrun.py"),
    "x_transformers_enwik8": Source(
        "lucidrains/x-transformers", "dbc0d9550de38571907b0df58d2c9fa4c0bfecb6",
        ("train_enwik8.py", *(f"x_transformers/{module}.py" for module in (
            "__init__", "attend", "autoregressive_wrapper", "continuous", "dpo", "multi_input", "neo_mlp",
            "nonautoregressive_wrapper", "x_transformers", "xl_autoregressive_wrapper", "xval"))),
        entry="train_enwik8.py", packages=("x_transformers",)),
    "hf_run_clm": Source(
        "huggingface/transformers", "00d481d18f914b55e65faa31e82321629691eadb",
        ("examples/pytorch/language-modeling/run_clm.py",), entry="examples/pytorch/language-modeling/run_clm.py"),
}

NANOGPT_VOCAB = 64
NANOGPT_CONFIG = dict(  # nanoGPT's own names; a tiny model, fp32 on the CPU, nothing saved or logged
    dataset="corpus", device="cpu", dtype="float32", compile=False, batch_size=4, block_size=32,
    n_layer=2, n_head=2, n_embd=32, gradient_accumulation_steps=1, max_iters=10, eval_interval=1000,
    eval_iters=2, log_interval=1, warmup_iters=2, lr_decay_iters=10, always_save_checkpoint=False,
    learning_rate=1e-3, min_lr=1e-4, dropout=0.0)
CLM_LINES = 24  # 3 epochs of 24 lines at 2 a batch: 36 optimizer steps without accumulation
CLM_SELECTED_LINES = 500  # the example takes the first 500 lines of the training text
CLM_MODEL = dict(n_layer=2, n_head=2, n_embd=32, n_positions=64)
LIGHTNING_WORDS = 150_000  # the example splits off 2 x 2000 blocks of 35 words for validation and test
CHARGPT_WORDS = 20_000
CHARGPT_CONFIG = {  # minGPT's own names (--section.key=value); a tiny GPT on the CPU, its DataLoader's 4 workers kept
    "trainer.max_iters": 30, "trainer.device": "cpu", "trainer.batch_size": 8, "data.block_size": 32,
    "model.model_type": None, "model.n_layer": 2, "model.n_head": 2, "model.n_embd": 32,
    "system.work_dir": "out"}  # in the working directory: minGPT reads values with literal_eval, which a path fails
WLM_WORDS = {"train": 1400, "valid": 300, "test": 300}
WLM_ARGS = {"emsize": 16, "nhid": 16, "nlayers": 1, "bptt": 8, "batch_size": 4, "epochs": 2, "log-interval": 5}  # tiny


@dataclass
class ScriptRun:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path
    workdir: Path
    run: Any = field(default=None)  # gpuprof.Run


def materialize(name: str, workdir: Path) -> Path:
    """The source's files, unmodified, and its LICENSE under `workdir`, read from the script cache
    (corpus_cache.py); the entry script's path. A pinned file missing from the cache fails the test, or skips it
    for a repository taken from a git copy only (no licence pinned)."""
    source = SOURCES[name]
    for path in (*source.files, *((LICENCE_PATH,) if licensed(source.repo) else ())):
        content = _cached(source, path)
        kept = any(Path(path).is_relative_to(package) for package in source.packages)
        target = workdir / (path if kept else Path(path).name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    return workdir / Path(source.entry).name


def run_script(name: str, tmp_path: Path, script_args: list[str], patches=(), env: dict | None = None,
               timeout_s: float = TIMEOUT_S, ranks: int = 1, gpuprof_args=()) -> ScriptRun:
    """`gpuprof run GPUPROF_ARGS --run-dir tmp_path/run SCRIPT ARGS` with `patches` applied, cwd tmp_path/work;
    under torchrun (gloo on this host's CPU) with `ranks` > 1."""
    launch = script_launch(name, tmp_path, script_args, patches, env, ranks, gpuprof_args)
    done = subprocess.run(launch.command, capture_output=True, text=True, timeout=timeout_s, cwd=launch.workdir,
                          env=launch.env)
    run_dir, workdir = launch.run_dir, launch.workdir
    result = ScriptRun(done.returncode, done.stdout, done.stderr, run_dir, workdir)
    if (run_dir / "meta.json").exists() or any(run_dir.glob("*/meta.json")):
        result.run = gpuprof.load_run(run_dir)
    return result


@dataclass(frozen=True)
class ScriptLaunch:
    command: list[str]
    env: dict[str, str]
    workdir: Path
    run_dir: Path


def script_launch(name: str, tmp_path: Path, script_args: list[str], patches=(), env: dict | None = None,
                  ranks: int = 1, gpuprof_args=()) -> ScriptLaunch:
    """What run_script runs, the source's files in place, for a test that starts the job itself (one that hangs)."""
    workdir = _workdir(tmp_path)
    script = materialize(name, workdir)
    run_dir = tmp_path / "run"
    python = torchrun(ranks) if ranks > 1 else [sys.executable]
    command = [*python, str(RUNNER), json.dumps([_patch_spec(patch) for patch in patches]),
               *map(str, gpuprof_args), "--run-dir", str(run_dir), str(script), *map(str, script_args)]
    # one torch thread: on a loaded machine of few cores OpenMP threads spinning against each other make a tiny
    # model's step many times slower (and its CPU time several times the step's own)
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                 "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                 "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "WANDB_MODE": "disabled", **(env or {})}
    return ScriptLaunch(command, child_env, workdir, run_dir)


def finished(result: ScriptRun) -> ScriptRun:
    """`result`, checked to have ended as a script that ran well does (exit 0; else the end of its stderr)."""
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def nonfinite_event(result: ScriptRun) -> dict:
    """The one `nonfinite` event of a script that ran to its end."""
    [event] = events(finished(result).run_dir, "nonfinite")
    return event


def assert_recorded(result: ScriptRun, steps: int):
    finished(result)
    assert result.run is not None and result.run.meta["status"] == "finished"
    assert len(result.run.steps) == steps
    assert np.isfinite(result.run.steps["grad_norm"]).all()
    return result.run


# ---------------------------------------------------------------------------------------------- nanoGPT
def run_nanogpt(tmp_path: Path, patches=(), **config) -> ScriptRun:
    write_nanogpt_data(_workdir(tmp_path) / "data" / "corpus")
    settings = {**NANOGPT_CONFIG, "out_dir": str(tmp_path / "out"), **config}
    return run_script("nanogpt", tmp_path, [f"--{key}={value}" for key, value in settings.items()], patches)


def write_nanogpt_data(data_dir: Path, tokens: int = 20_000, seed: int = 0) -> None:
    """What nanoGPT's data/*/prepare.py writes: uint16 token files and meta.pkl with the vocab size."""
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split in ("train", "val"):
        rng.integers(0, NANOGPT_VOCAB, tokens, dtype=np.uint16).tofile(data_dir / f"{split}.bin")
    with open(data_dir / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": NANOGPT_VOCAB}, f)


# ---------------------------------------------------------------------------------------------- Accelerate
def run_accelerate_clm(tmp_path: Path, patches=(), lines: int = CLM_LINES, args=(), ranks: int = 1) -> ScriptRun:
    local = write_clm_assets(_workdir(tmp_path) / "assets", lines)
    offline = ("corpus_patches:offline_hub", local)
    return run_script("accelerate_clm", tmp_path, ["--cpu", *args], (offline, *patches), ranks=ranks)


def write_clm_assets(folder: Path, lines: int, seed: int = 0) -> dict[str, str]:
    """Text files, a byte-level BPE tokenizer trained on them and a tiny GPT-2 config: what the
    example would load from the Hub, made here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    words = _words(seed, lines * 12)
    texts = {"train": words[: lines * 10], "validation": words[lines * 10: lines * 11],
             "test": words[lines * 11:]}
    files = {}
    for split, split_words in texts.items():
        files[split] = str(folder / f"{split}.txt")
        text = [" ".join(split_words[i:i + 10]) for i in range(0, len(split_words), 10)]
        blank = [""] * (CLM_SELECTED_LINES - len(text))  # WikiText's blank lines, which the example filters out
        Path(files[split]).write_text("".join(line + "\n" for line in text + blank))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train(list(files.values()), trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            model_max_length=CLM_MODEL["n_positions"]).save_pretrained(folder / "tokenizer")
    eos = tokenizer.token_to_id("<|endoftext|>")
    GPT2Config(vocab_size=tokenizer.get_vocab_size(), bos_token_id=eos, eos_token_id=eos, **CLM_MODEL).save_pretrained(folder / "model")
    return {"data_files": files, "tokenizer": str(folder / "tokenizer"), "model": str(folder / "model")}


# ---------------------------------------------------------------------------------------------- Lightning
def run_lightning_transformer(tmp_path: Path, patches=(), max_steps: int = 10, ranks: int = 1,
                              devices: int | None = None) -> ScriptRun:
    data = _workdir(tmp_path) / "data"
    data.mkdir(exist_ok=True)
    words = _words(0, LIGHTNING_WORDS)
    (data / "wikitext-2.txt").write_text("\n".join(" ".join(words[i:i + 20]) for i in range(0, len(words), 20)))
    limits = ("corpus_patches:limit_lightning_trainer", {"max_steps": max_steps, "devices": devices})
    return run_script("lightning_transformer", tmp_path, [], (limits, *patches), ranks=ranks)


# ---------------------------------------------------------------------------------------------- word_language_model
def run_word_language_model(tmp_path: Path, patches=(), flags=(), **args) -> ScriptRun:
    write_wikitext(_workdir(tmp_path) / "data" / "wikitext-2")
    settings = {**WLM_ARGS, **args}
    return run_script("word_language_model", tmp_path,
                      [*(f"--{key}={value}" for key, value in settings.items()), *flags], patches)


def write_wikitext(folder: Path) -> None:
    """WikiText-2's three files as the example reads them (lines of words), of random words: the
    repository's own train.txt is stored apart from its snapshot."""
    folder.mkdir(parents=True, exist_ok=True)
    for seed, (split, count) in enumerate(WLM_WORDS.items()):
        words = _words(seed, count)
        (folder / f"{split}.txt").write_text("".join(" ".join(words[i:i + 20]) + "\n" for i in range(0, count, 20)))


def wikitext_iterations(folder: Path, batch_size: int = WLM_ARGS["batch_size"],
                        bptt: int = WLM_ARGS["bptt"]) -> list[int]:
    """The tokens of each training iteration of one epoch, as the example batches train.txt: a word a token
    and an <eos> a line, `batch_size` columns, `bptt` rows at a time, the last one shorter."""
    lines = (folder / "train.txt").read_text().splitlines()
    rows = sum(len(line.split()) + 1 for line in lines) // batch_size
    return [min(bptt, rows - 1 - start) * batch_size for start in range(0, rows - 1, bptt)]


# ---------------------------------------------------------------------------------------------- minGPT
def run_chargpt(tmp_path: Path, patches=(), **config) -> ScriptRun:
    write_chargpt_text(_workdir(tmp_path) / "input.txt")
    settings = {**CHARGPT_CONFIG, **config}
    return run_script("mingpt", tmp_path, [f"--{key}={value}" for key, value in settings.items()], patches)


def write_chargpt_text(path: Path) -> None:
    """input.txt (Shakespeare in the project) of random words, with the line its callback samples from: every
    character of "O God, O God!" must be in the vocabulary."""
    words = _words(0, CHARGPT_WORDS)
    lines = [" ".join(words[i:i + 20]) for i in range(0, len(words), 20)]
    path.write_text("\n".join([*lines, "O God, O God!"]) + "\n")


# ---------------------------------------------------------------------------------------------- helpers
def _words(seed: int, count: int) -> list[str]:
    rng = np.random.default_rng(seed)
    vocabulary = [f"w{index}" for index in range(200)]
    return [vocabulary[i] for i in rng.zipf(1.3, count) % len(vocabulary)]


def _workdir(tmp_path: Path) -> Path:
    workdir = tmp_path / "work"
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def _patch_spec(patch) -> list:
    target, kwargs = (patch, {}) if isinstance(patch, str) else patch
    return [target, kwargs]


def _cached(source: Source, path: str) -> bytes:
    [pin] = [pin for pin in pins() if (pin.repository, pin.commit, pin.path) == (source.repo, source.commit, path)]
    content = read_pinned(pin)
    if content is not None:
        return content
    where = f"{pin.label} is not in the script cache {cache_root()}"
    if not licensed(source.repo):
        pytest.skip(f"{where}: it is read from a git copy only; get it with {HOW_TO_FILL}")
    pytest.fail(f"{where}; get it with {HOW_TO_FILL}", pytrace=False)
