"""scripts/get_corpus.py fills the script cache from what it is given, checks every file against its pin, and says
in one line what is missing and how to get it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from corpus_cache import Pin, cache_root, cached_path, fill, pins, read_pinned

GET_CORPUS = Path(__file__).resolve().parents[2] / "scripts" / "get_corpus.py"


def get_corpus(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"GPUPROF_SCRIPT_CORPUS": str(cache), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(GET_CORPUS), "--offline", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture(scope="module")
def repository_trees(tmp_path_factory) -> list[Path]:
    """Every pinned file of the machine's cache, laid out as in its repository (one folder a repository), as a
    contributor's loose copies would be."""
    trees = tmp_path_factory.mktemp("trees")
    for pin in pins():
        content = read_pinned(pin)
        if content is None:
            pytest.fail(f"{pin.label} is not in {cache_root()}: run scripts/get_corpus.py first", pytrace=False)
        target = trees / pin.repository.replace("/", "+") / pin.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    return sorted(trees.iterdir())


def test_an_empty_cache_fails_with_one_line_saying_how_to_fill_it(tmp_path):
    done = get_corpus(tmp_path / "cache")
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert line.startswith("script corpus incomplete: ") and "python scripts/get_corpus.py --git DIR" in line
    assert "karpathy/nanoGPT" in line and "karpathy/build-nanogpt" not in line  # that one is a git copy only
    assert "(from a git copy only: its tests skip without it)" in done.stdout


def test_loose_files_fill_the_cache_and_a_second_run_finds_it_complete(tmp_path, repository_trees):
    cache = tmp_path / "cache"
    done = get_corpus(cache, *(arg for tree in repository_trees for arg in ("--files", str(tree))))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == f"script corpus: {len(pins())} of {len(pins())} pinned files in {cache}"
    assert all(read_pinned(pin, cache) is not None for pin in pins())  # the empty mingpt/__init__.py too
    again = get_corpus(cache)
    assert again.returncode == 0 and again.stdout.startswith(f"script corpus: {len(pins())} of {len(pins())}")


def test_a_file_that_is_not_the_pinned_one_is_never_taken(tmp_path, repository_trees):
    [pin] = [pin for pin in pins() if pin.path == "train.py" and pin.repository == "karpathy/nanoGPT"]
    trees = tmp_path / "trees"
    shutil.copytree(repository_trees[0].parent, trees)
    (trees / "karpathy+nanoGPT" / "train.py").write_text("# someone's edit\n")
    cache = tmp_path / "cache"
    done = get_corpus(cache, *(arg for tree in sorted(trees.iterdir()) for arg in ("--files", str(tree))))
    assert done.returncode == 1 and not cached_path(pin, cache).exists()
    assert "missing from karpathy/nanoGPT@3adf61e154c3: train.py" in done.stdout


def test_a_git_copy_fills_the_cache_at_the_pinned_commit(tmp_path, repository_trees):
    """A clone whose pinned commit holds the files; a later commit changes one, which must not be what is taken."""
    [tree] = [tree for tree in repository_trees if tree.name == "karpathy+minGPT"]
    clone = tmp_path / "minGPT"
    shutil.copytree(tree, clone)
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "pinned"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (clone / "mingpt" / "model.py").write_text("changed later\n")
    subprocess.run([*git, "commit", "-qam", "later"], check=True)
    pinned = [Pin(pin.repository, commit, pin.path, pin.sha256) for pin in pins() if pin.repository == "karpathy/minGPT"]
    assert fill(pinned, git_dirs=[clone], online=False, root=tmp_path / "cache") == []
    assert all(read_pinned(pin, tmp_path / "cache") is not None for pin in pinned)
