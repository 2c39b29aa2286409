"""`gpuprof replay BUNDLE`: re-run a NaN/Inf step from its replay bundle and print the blame."""

from __future__ import annotations

import argparse
import json
import zipfile
from pathlib import Path

from gpuprof.errors import GpuprofError

# torch.save writes a zip archive of one folder holding the pickle (and its tensors): every bundle is one.
TORCH_SAVE_PICKLE = "/data.pkl"
SNIFFED_BYTES = 1 << 20  # enough to tell a JSON document or text from a binary file


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "replay", help="re-run a non-finite step from its replay bundle (RUN/numerics/*.pt) and print the blame",
        description="Load a replay bundle safely (tensors and plain values only), re-run the step in forensic "
        "mode on this machine and print where the first Inf/NaN appeared. Exit 0 when the blame matches the "
        "one recorded in training, 1 when it differs, 2 for a bad bundle.",
    )
    parser.add_argument("bundle", type=Path, help="a replay bundle, e.g. RUN/numerics/step-12-rank-0.pt")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to re-run (default: the bundle's device type when available, else cpu)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problem = not_a_bundle(args.bundle)
    if problem is not None:
        raise GpuprofError(problem)
    from gpuprof.numerics.blame import format_blame
    from gpuprof.numerics.replay import replay, same_blame
    from gpuprof.workloads.gpt2.faults import replay_model

    blame, recorded = replay(args.bundle, device=None if args.device == "auto" else args.device,
                             builders={"gpt2": replay_model})  # the reference workload's own bundles
    print(format_blame(blame))
    if same_blame(blame, recorded):
        print("same blame as recorded during training")
        return 0
    print(f"differs from the blame recorded during training: {recorded.message()}")
    return 1


def not_a_bundle(path: Path) -> str | None:
    """Why `path` cannot be a replay bundle, in one line, seen before torch reads it (torch's own errors speak of
    its internals: "pop from empty list"); None where it may be one."""
    if path.is_dir():
        bundles = sorted(path.glob("numerics/*.pt")) or sorted(path.glob("*.pt"))
        return f"{path} is a folder, not a replay bundle" + (f"; the bundles in it: {', '.join(map(str, bundles[:3]))}"
                                                              + (" ..." if len(bundles) > 3 else "") if bundles else "")
    if not path.is_file():
        return f"{path} does not exist"
    if path.stat().st_size == 0:
        return f"{path} is empty, not a replay bundle"
    if _torch_saved(path):
        return None
    return (f"{path} is not a replay bundle but {_what_it_holds(path)}: a bundle is the file gpuprof saved with "
            "torch.save when a step went non-finite (RUN/numerics/step-N-rank-R.pt)")


def _torch_saved(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith(TORCH_SAVE_PICKLE) for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _what_it_holds(path: Path) -> str:
    if zipfile.is_zipfile(path):
        return "a zip archive of other files"
    with open(path, "rb") as handle:
        head = handle.read(SNIFFED_BYTES)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return "a binary file of another kind"
    try:
        json.loads(text)
        return "a JSON document"
    except ValueError:
        return "a text file"
