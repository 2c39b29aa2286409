"""A `gpuprof tune` folder's result file: its name, the keys every reader relies on, and its one reader.

Tune writes it (gpuprof.tune.tuning, its plain form `TuneResult.to_dict()`); the terminal, the HTML page and the
dashboard's Tune page read it through `read_result` (gpuprof.report.tuning renders it)."""

from __future__ import annotations

import json
from pathlib import Path

from gpuprof.errors import GpuprofError

RESULT_FILE = "tune.json"
RESULT_KEYS = {"target": str, "out_dir": str, "conclusion": str, "baseline": dict, "trials": list, "by_hand": list,
               "notes": list, "diff": str, "diff_notes": list}


def read_result(path: Path) -> dict:
    """A RESULT_FILE's plain form; GpuprofError, saying why, for one that is not tune's."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise GpuprofError(f"{path} cannot be read as a tune result: {error}") from None
    wrong = [key for key, kind in RESULT_KEYS.items() if not isinstance(result, dict) or not isinstance(result.get(key), kind)]
    if wrong:
        raise GpuprofError(f"{path} is not a tune result: {', '.join(wrong)} missing or of the wrong type")
    return result
