"""The edits knobs record (gpuprof.integrations.knobs) as the diff a user applies to their own files.

Kinds: "keywords" (add or replace keyword arguments of the call at a file and line), "before" (lines
before the statement at a line, at its indentation), "after_imports" (lines after the script's leading
imports), "top" (lines before its first statement but the docstring and `from __future__` imports),
"note" (a change with no line to put it on). A keywords edit whose call was made inside a library, or
whose call cannot be found at its line, becomes a sentence instead of a hunk.
"""

from __future__ import annotations

import ast
import difflib
import os
from collections import defaultdict


def diff_of(edits: list[dict], root: str | None = None) -> tuple[str, list[str]]:
    """(the unified diff of the edits that change files, a sentence for each edit that cannot)."""
    by_file: dict[str, list[dict]] = defaultdict(list)
    sentences = []
    for edit in edits:
        if edit["kind"] == "note":
            sentences.append(edit["text"])
        elif edit.get("library"):
            sentences.append(f"{edit['call']} is built inside a library ({_where(edit)}): pass "
                             f"{_keywords_text(edit)} through that library's own arguments")
        else:
            by_file[edit["file"]].append(edit)
    hunks = []
    for path, file_edits in by_file.items():
        try:
            with open(path, encoding="utf-8") as file:
                source = file.read()
            changed, missed = apply_edits(source, file_edits)
        except (OSError, SyntaxError, UnicodeDecodeError) as error:
            sentences += [f"{_describe(edit)} ({path} could not be read: {error})" for edit in file_edits]
            continue
        sentences += [f"{_describe(edit)} (no such call at {_where(edit)})" for edit in missed]
        name = os.path.relpath(path, root or os.getcwd())
        hunks.append("".join(difflib.unified_diff(source.splitlines(keepends=True), changed.splitlines(keepends=True),
                                                  fromfile=f"a/{name}", tofile=f"b/{name}")))
    return "".join(hunks), sentences


def apply_edits(source: str, edits: list[dict]) -> tuple[str, list[dict]]:
    """`source` with the edits made, and the keywords edits whose call is not at their line."""
    tree = ast.parse(source)
    data = source.encode("utf-8")
    line_starts = _line_starts(data)
    changes: list[tuple[int, int, int, bytes]] = []  # (start, end, order, text): replace data[start:end]
    missed = []
    for order, edit in enumerate(edits):
        found = _changes(tree, data, line_starts, edit)
        if found is None:
            missed.append(edit)
        changes += [(start, end, order, text) for start, end, text in found or ()]
    for start, end, _, text in sorted(changes, key=lambda change: (change[0], change[2]), reverse=True):
        data = data[:start] + text + data[end:]
    return data.decode("utf-8"), missed


def _changes(tree, data: bytes, line_starts: list[int], edit: dict):
    kind = edit["kind"]
    if kind == "keywords":
        call = _call_at(tree, edit["line"], edit["call"])
        return None if call is None else _keyword_changes(call, data, line_starts, edit["keywords"])
    if kind == "before":
        statement = _statement_at(tree, edit["line"])
        if statement is None:
            return None
        at = line_starts[statement.lineno - 1]
        return [(at, at, _lines(edit["code"], " " * statement.col_offset))]
    at = line_starts[_line_after_imports(tree) if kind == "after_imports" else _first_statement_line(tree)]
    return [(at, at, _lines(edit["code"], ""))]


def _keyword_changes(call: ast.Call, data: bytes, line_starts: list[int], keywords: dict) -> list:
    offset = lambda line, col: line_starts[line - 1] + col  # noqa: E731 - ast columns are UTF-8 byte offsets
    given = {keyword.arg: keyword for keyword in call.keywords if keyword.arg}
    changes, added = [], []
    for name, value in keywords.items():
        if name in given:
            node = given[name].value
            changes.append((offset(node.lineno, node.col_offset), offset(node.end_lineno, node.end_col_offset),
                            value.encode()))
        else:
            added.append(f"{name}={value}")
    if added:
        arguments = [*call.args, *call.keywords]
        if arguments:
            last = max(arguments, key=lambda node: (node.end_lineno, node.end_col_offset))
            at, text = offset(last.end_lineno, last.end_col_offset), ", " + ", ".join(added)
        else:
            at, text = offset(call.end_lineno, call.end_col_offset) - 1, ", ".join(added)
        changes.append((at, at, text.encode()))
    return changes


def _call_at(tree, line: int, name: str) -> ast.Call | None:
    """The innermost call of `name` (a plain or dotted name) whose span holds `line`."""
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and node.lineno <= line <= node.end_lineno
             and _callee(node.func) == name]
    return min(calls, key=lambda node: node.end_lineno - node.lineno, default=None)


def _callee(func) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _statement_at(tree, line: int) -> ast.stmt | None:
    """The innermost statement whose span holds `line`."""
    statements = [node for node in ast.walk(tree) if isinstance(node, ast.stmt) and node.lineno <= line <= node.end_lineno]
    return min(statements, key=lambda node: node.end_lineno - node.lineno, default=None)


def _leading(tree) -> list[ast.stmt]:
    """The module's docstring and `from __future__` imports."""
    body = tree.body
    count = 1 if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
        and isinstance(body[0].value.value, str) else 0
    while count < len(body) and isinstance(body[count], ast.ImportFrom) and body[count].module == "__future__":
        count += 1
    return body[:count]


def _first_statement_line(tree) -> int:
    """Index of the line before which `top` lines go (0-based)."""
    leading = _leading(tree)
    return leading[-1].end_lineno if leading else 0


def _line_after_imports(tree) -> int:
    """Index of the line after the imports that open the script (0-based)."""
    end = _first_statement_line(tree)
    for node in tree.body[len(_leading(tree)):]:
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            break
        end = node.end_lineno
    return end


def _line_starts(data: bytes) -> list[int]:
    starts, position = [0], 0
    for line in data.splitlines(keepends=True):
        position += len(line)
        starts.append(position)
    return starts


def _lines(code: list[str], indent: str) -> bytes:
    return "".join(f"{indent}{line}\n" for line in code).encode()


def _keywords_text(edit: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in edit["keywords"].items())


def _where(edit: dict) -> str:
    return f"{edit['file']}:{edit['line']}"


def _describe(edit: dict) -> str:
    if edit["kind"] == "keywords":
        return f"add {_keywords_text(edit)} to the {edit['call']}(...) call"
    return "add " + "; ".join(edit["code"])
