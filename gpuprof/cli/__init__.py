"""The `gpuprof` command line: one module per subcommand, this file only dispatches.

Each subcommand module exposes `add_parser(subparsers)` (which sets `func` on its
parser) and keeps its imports of heavy libraries inside the function it runs, so
`gpuprof --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from gpuprof.errors import GpuprofError

SUBCOMMANDS = ("train", "run", "tune", "analyze", "compare", "dashboard", "report", "export", "trace", "replay", "demo")


class _OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a bad flag gets one clear line instead."""

    def error(self, message: str):  # noqa: D401 - argparse API
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrorParser(
        prog="gpuprof",
        description="Profile and diagnose PyTorch training of GPT-2-class transformers.",
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_OneLineErrorParser
    )
    for name in SUBCOMMANDS:
        importlib.import_module(f"gpuprof.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except GpuprofError as error:
        print(f"gpuprof {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gpuprof {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `gpuprof ... | head` closed our stdout: stop quietly, as Unix tools do.
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
