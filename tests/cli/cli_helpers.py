"""What the command-line tests read of a command run in this process (`from cli.cli_helpers import ...`)."""

from __future__ import annotations

from gpuprof.cli import main


def refused_line(command: list[str], capsys) -> str:
    """The one line the command printed on refusing: exit code 2, nothing on stdout, no traceback."""
    code = main(command)
    out, err = capsys.readouterr()
    assert (code, out) == (2, ""), (code, out, err)
    [line] = err.strip().splitlines()
    assert line.startswith(f"gpuprof {command[0]}: error: ") and "Traceback" not in line, line
    return line
