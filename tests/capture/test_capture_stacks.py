"""Stacks read from another thread: a frame caught between lines still gives its entry."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from gpuprof.capture.usercode import frame_list


def test_a_frame_without_a_line_number_is_listed_without_code():
    """CPython reports f_lineno None while a frame runs an instruction that belongs to no line (the
    hang watchdog met one on a loaded machine and stopped)."""
    here = sys._getframe()
    between_lines = SimpleNamespace(f_code=here.f_code, f_lineno=None, f_back=here)
    caller, innermost = frame_list(between_lines)[-2:]
    assert innermost == {"file": __file__, "line": None, "function": here.f_code.co_name, "code": ""}
    assert isinstance(caller["line"], int) and "frame_list(between_lines)" in caller["code"]
