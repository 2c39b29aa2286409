"""The edits knobs record, made into a diff of a real script's source (no child process needed)."""

from __future__ import annotations

import ast
from pathlib import Path

from gpuprof.tune.edits import apply_edits, diff_of

SCRIPT = Path(__file__).parent / "slow_loader.py"


def line_of(source: str, text: str) -> int:
    return next(number for number, line in enumerate(source.splitlines(), 1) if text in line)


def test_every_kind_of_edit_lands_where_a_user_would_write_it():
    source = SCRIPT.read_text()
    loader_line = line_of(source, "loader = torch.utils.data.DataLoader(") + 1  # the call's second line
    optimizer_line = line_of(source, "optimizer = torch.optim.AdamW(")
    edits = [
        {"kind": "keywords", "call": "DataLoader", "file": str(SCRIPT), "line": loader_line,
         "keywords": {"num_workers": "2", "batch_size": "16"}},
        {"kind": "before", "file": str(SCRIPT), "line": optimizer_line, "code": ["model.compile()"]},
        {"kind": "after_imports", "file": str(SCRIPT), "code": ['torch.set_float32_matmul_precision("high")']},
        {"kind": "top", "file": str(SCRIPT), "code": ["import os", 'os.environ["X"] = "1"']},
    ]
    changed, missed = apply_edits(source, edits)
    assert missed == []
    tree = ast.parse(changed)
    loader = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and getattr(node.func, "attr", None) == "DataLoader")
    keywords = {keyword.arg: keyword.value for keyword in loader.keywords}
    assert ast.literal_eval(keywords["num_workers"]) == 2 and ast.literal_eval(keywords["batch_size"]) == 16  # replaced
    lines = changed.splitlines()
    assert lines[lines.index("model.compile()") + 1].startswith("optimizer = torch.optim.AdamW(")
    body = [type(node).__name__ for node in tree.body]
    assert body[0] == "Expr" and lines[lines.index("import os") - 1].endswith('"""')  # after the docstring
    first_code = lines.index('torch.set_float32_matmul_precision("high")')
    assert "GPT2LMHeadModel" in lines[first_code - 1]  # right after the imports


def test_a_call_built_inside_a_library_or_missing_becomes_a_sentence(tmp_path):
    diff, notes = diff_of([
        {"kind": "keywords", "call": "DataLoader", "file": "/site-packages/transformers/trainer.py", "line": 10,
         "keywords": {"num_workers": "2"}, "library": True},
        {"kind": "keywords", "call": "DataLoader", "file": str(SCRIPT), "line": 1, "keywords": {"num_workers": "2"}},
        {"kind": "note", "text": "model.compile()"},
    ])
    assert diff == ""  # no line of any file changed
    assert any("inside a library" in note and "num_workers=2" in note for note in notes)
    assert any("no such call" in note for note in notes) and "model.compile()" in notes
