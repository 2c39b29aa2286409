"""docs/ARCHITECTURE.md's module map: every module of the package with its one job, the first sentence of its
docstring, so that the map is written once, in the code, and the document cannot drift from it.

    python scripts/module_map.py           # print the map
    python scripts/module_map.py --write   # replace the map at the end of docs/ARCHITECTURE.md

`tests/architecture/test_module_map.py` fails when the document's map is not what this writes.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gpuprof"
DOCUMENT = ROOT / "docs" / "ARCHITECTURE.md"
HEADING = "## Every module's one job"
INTRO = ("The first sentence of each module's docstring, written by `python scripts/module_map.py --write`; "
         "`tests/architecture/test_module_map.py` checks that it is current.")
# Up to the first full stop that ends a sentence (not "e.g." nor "i.e.").
FIRST_SENTENCE = re.compile(r"(.+?(?<!e\.g)(?<!i\.e)[.!?])(?:\s|$)")


def job(path: Path) -> str:
    """The first sentence of the module's docstring, on one line; "" where it has none."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    found = FIRST_SENTENCE.match(paragraph)
    return found.group(1) if found else paragraph


def modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


def module_map() -> str:
    lines = [HEADING, "", INTRO, ""]
    lines += [f"- `{path.relative_to(ROOT).as_posix()}`: {job(path)}" for path in modules()]
    return "\n".join(lines) + "\n"


def documented_map(text: str) -> str:
    """The map as the document has it: from its heading to the end."""
    start = text.find(HEADING)
    return text[start:] if start >= 0 else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the map at the end of {DOCUMENT.name}")
    args = parser.parse_args()
    if not args.write:
        print(module_map(), end="")
        return 0
    text = DOCUMENT.read_text()
    before = text[: text.find(HEADING)] if HEADING in text else text.rstrip("\n") + "\n\n"
    DOCUMENT.write_text(before + module_map())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
