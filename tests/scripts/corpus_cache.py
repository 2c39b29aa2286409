"""The cache of real public training scripts that the tests run: what is pinned, where it lives, how it is filled.

Third-party code never enters this repository. `corpus_pins.tsv` beside this file pins every file the tests read
(repository, commit, path, SHA-256), each repository's LICENSE with them; the files themselves live in a cache
outside the repository, `$GPUPROF_SCRIPT_CORPUS` or else `${XDG_CACHE_HOME:-~/.cache}/gpuprof/script-corpus`, as
`<owner>+<name>/<commit>/<path>`. `python scripts/get_corpus.py` fills it from git copies of the repositories
(`--git DIR`), from loose files laid out as in their repository (`--files DIR`), or online from GitHub at the
pinned commit, and checks every file's SHA-256. A repository pinned with no LICENSE (karpathy/build-nanogpt) is
taken from a git copy or loose files only, never downloaded, and the tests that use it skip where it is absent.

Standard library only: it runs before the project is installed.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import os
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PINS = Path(__file__).with_name("corpus_pins.tsv")
LICENCE_PATH = "LICENSE"
ONLINE_URL = "https://raw.githubusercontent.com/{repository}/{commit}/{path}"
ONLINE_TIMEOUT_S = 10
HOW_TO_FILL = ("python scripts/get_corpus.py --git DIR (a git copy of each repository; --files DIR for loose files), "
               "or the same without options where GitHub is reachable (tests/scripts/README.md)")


@dataclass(frozen=True)
class Pin:
    repository: str  # owner/name on GitHub
    commit: str
    path: str  # inside the repository
    sha256: str

    @property
    def label(self) -> str:
        return f"{self.repository}@{self.commit[:12]}:{self.path}"


def pins() -> list[Pin]:
    with PINS.open(newline="") as f:
        return [Pin(**row) for row in csv.DictReader(f, delimiter="\t")]


def cache_root() -> Path:
    if os.environ.get("GPUPROF_SCRIPT_CORPUS"):
        return Path(os.environ["GPUPROF_SCRIPT_CORPUS"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpuprof" / "script-corpus"


def cached_path(pin: Pin, root: Path | None = None) -> Path:
    return (root or cache_root()) / pin.repository.replace("/", "+") / pin.commit / pin.path


def licensed(repository: str) -> bool:
    """Whether the repository's LICENSE is pinned: only those are ever downloaded."""
    return any(pin.repository == repository and pin.path == LICENCE_PATH for pin in pins())


def read_pinned(pin: Pin, root: Path | None = None) -> bytes | None:
    """The cached file when it is there and is the pinned one, else None."""
    path = cached_path(pin, root)
    if not path.is_file():
        return None
    content = path.read_bytes()
    return content if _sha256(content) == pin.sha256 else None


def fill(wanted: list[Pin], git_dirs=(), file_dirs=(), online: bool = True, root: Path | None = None) -> list[Pin]:
    """Puts each wanted file that is not yet cached into the cache, from the first place that holds the
    pinned content; the pins still missing afterwards."""
    missing = []
    for pin in wanted:
        if read_pinned(pin, root) is not None:
            continue
        content = _from_git(pin, git_dirs)
        if content is None:
            content = _from_files(pin, file_dirs)
        if content is None and online and licensed(pin.repository):
            content, online = _from_github(pin)
        if content is None:
            missing.append(pin)
            continue
        target = cached_path(pin, root)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    return missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="get_corpus.py", description=__doc__.split("\n\n")[1])
    parser.add_argument("--git", action="append", default=[], metavar="DIR",
                        help="a git copy (bare or a clone) of a pinned repository; may be repeated")
    parser.add_argument("--files", action="append", default=[], metavar="DIR",
                        help="a folder holding pinned files at their repository paths; may be repeated")
    parser.add_argument("--offline", action="store_true", help="never download from GitHub")
    args = parser.parse_args(argv)
    root = cache_root()
    missing = fill(pins(), args.git, args.files, online=not args.offline, root=root)
    required = [pin for pin in missing if licensed(pin.repository)]
    total = len(pins())
    print(f"script corpus: {total - len(missing)} of {total} pinned files in {root}")
    for repository, commit in sorted({(pin.repository, pin.commit) for pin in missing}):
        paths = [pin.path for pin in missing if pin.repository == repository]
        optional = "" if licensed(repository) else " (from a git copy only: its tests skip without it)"
        print(f"  missing from {repository}@{commit[:12]}{optional}: {', '.join(paths)}")
    if required:
        repositories = sorted({pin.repository for pin in required})
        print(f"script corpus incomplete: {len(required)} pinned files of {', '.join(repositories)} are missing; "
              f"get them with {HOW_TO_FILL}", file=sys.stderr)
        return 1
    return 0


def _sha256(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def _from_git(pin: Pin, git_dirs) -> bytes | None:
    for git_dir in git_dirs:
        shown = subprocess.run(["git", "-C", str(git_dir), "show", f"{pin.commit}:{pin.path}"], capture_output=True)
        if shown.returncode == 0 and _sha256(shown.stdout) == pin.sha256:
            return shown.stdout
    return None


def _from_files(pin: Pin, file_dirs) -> bytes | None:
    for folder in file_dirs:
        path = Path(folder) / pin.path
        if path.is_file() and _sha256(path.read_bytes()) == pin.sha256:
            return path.read_bytes()
    return None


def _from_github(pin: Pin) -> tuple[bytes | None, bool]:
    """The file at its pinned commit and whether to go on trying online (not after the network failed)."""
    url = ONLINE_URL.format(repository=pin.repository, commit=pin.commit, path=pin.path)
    try:
        with urllib.request.urlopen(url, timeout=ONLINE_TIMEOUT_S) as response:
            content = response.read()
    except urllib.error.HTTPError:
        return None, True
    except (urllib.error.URLError, OSError):
        return None, False
    return (content if _sha256(content) == pin.sha256 else None), True
