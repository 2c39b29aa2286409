"""Exceptions gpuprof raises for bad input.

Every error a user can cause (a wrong path, a corrupt file, a bad flag value) is a
`GpuprofError`. The CLI prints its message as one line and exits with code 2;
the Python API lets it propagate as a typed exception.
"""


class GpuprofError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


class NotARunError(GpuprofError):
    """A path that is not a gpuprof run directory."""


class RunFormatError(GpuprofError):
    """A run directory gpuprof cannot read: newer format version, corrupt meta."""


class DamagedFileError(RunFormatError):
    """One rank's record file that cannot be read as its stream: readers leave that rank out and say so."""


class TraceFormatError(GpuprofError):
    """A file that is not a readable torch.profiler Chrome trace."""


class SnapshotFormatError(GpuprofError):
    """A file that is not a readable CUDA memory snapshot."""


class DataError(GpuprofError):
    """Training data that cannot be used: missing, empty, or out of vocabulary."""
