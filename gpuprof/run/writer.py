"""Writes a run directory (docs/run-format.md). The only code that creates run files.

Each record stream is a JSON lines file. Events are encoded and handed to the OS (`write` +
`flush`) the moment they are written; the streams written every step or sample (steps, layers,
system, stacks) are kept in memory and encoded and handed over by the writer's own thread every BUFFER_S
seconds, in one `write`, so that the training thread never pays an encode or a system call for them. Whatever the OS holds
survives a SIGKILL of the process: such a kill loses at most the last BUFFER_S seconds of those
streams. A clean close, an exception leaving the loop and interpreter exit write everything.
A failing disk (full, read-only) switches the stream off and never raises into the training loop;
the run directory's first such failure is logged, one line (the later ones at debug level).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping

from gpuprof.run import schema
from gpuprof.run.jsonable import encodable

logger = logging.getLogger("gpuprof")

BUFFER_S = 1.0  # the longest that step, layer and system records stay in memory before the OS has them
BUFFERED_STREAMS = ("steps", "layers", "system", "heartbeats", "stacks")


def dumps(record: Mapping[str, Any]) -> str:
    return json.dumps(record, default=encodable, separators=(",", ":"))


def write_json_atomic(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _removed_on_failure(tmp):
        tmp.write_text(json.dumps(data, default=encodable, indent=2) + "\n")
        os.replace(tmp, path)


@contextlib.contextmanager
def _removed_on_failure(tmp: Path):
    """A temporary file not left behind half written (a full disk)."""
    try:
        yield
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class StreamWriter:
    """One append-only JSON lines stream; thread safe; switches itself off on an OS error.

    buffered: records wait in memory until `flush` (the run writer's thread calls it every BUFFER_S); else each
    `write` encodes and writes at once. A record must not be changed after `write`.
    """

    def __init__(self, path: Path, buffered: bool = False, on_error=None):
        self.path = path
        self.buffered = buffered
        self._on_error = on_error or _log_failure
        self._lock = threading.Lock()  # held by `write` only to append: never while encoding
        self._file_lock = threading.Lock()  # one writer of the file at a time, records in order
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._pending: list[Mapping[str, Any]] = []
        self.records_written = 0

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, records: Iterable[Mapping[str, Any]]) -> None:
        with self._lock:
            if self._file is None:
                return
            self._pending.extend(records)
        if not self.buffered:
            self.flush()

    def flush(self) -> None:
        """Encodes every pending record and hands it to the OS."""
        with self._file_lock:
            with self._lock:
                records, self._pending = self._pending, []
            if records and self._file is not None:
                self._write_records(records)

    def _write_records(self, records: list[Mapping[str, Any]]) -> None:
        try:
            self._file.write("".join(dumps(record) + "\n" for record in records))
            self._file.flush()
            self.records_written += len(records)
        except (OSError, ValueError) as error:
            self._on_error(self.path, error)
            self._close_quietly()

    def close(self) -> None:
        self.flush()
        with self._file_lock:
            self._close_quietly()

    def _close_quietly(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


class RunWriter:
    """The writer of one rank's part of a run directory."""

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.rank_dir = self.run_dir / schema.rank_dir_name(rank)
        self.rank_dir.mkdir(parents=True, exist_ok=True)
        self._clear_previous_run()
        self._failed = False  # a file of this run could not be written
        self.streams = {name: StreamWriter(self.rank_dir / f"{name}.jsonl", name in BUFFERED_STREAMS,
                                           self._write_failed) for name in schema.STREAMS}
        atexit.register(self.flush)  # a loop that never closes the profiler still leaves every record
        # encoding off the training thread; a loop that stalls still shows its last steps within BUFFER_S
        self._stopped = threading.Event()
        self._flusher = threading.Thread(target=self._flush_every_buffer_s, name="gpuprof-writer", daemon=True)
        self._flusher.start()

    def _flush_every_buffer_s(self) -> None:
        while not self._stopped.wait(BUFFER_S):
            self.flush()

    def _clear_previous_run(self) -> None:
        """A new run in the same directory replaces this rank's files of the previous one."""
        stale = [*self.rank_dir.glob("*.jsonl"), *self.rank_dir.glob("*.parquet")]
        stale += list((self.run_dir / schema.TRACES_DIR).glob(f"*/{schema.rank_dir_name(self.rank)}.*"))
        if stale:
            logger.warning("gpuprof: %s held an earlier run; replacing its rank-%d files", self.run_dir, self.rank)
        for path in stale:
            path.unlink(missing_ok=True)

    def write(self, stream: str, records: Iterable[Mapping[str, Any]]) -> None:
        self.streams[stream].write(records)

    def flush(self) -> None:
        for stream in self.streams.values():
            stream.flush()

    def write_run_meta(self, meta: Mapping[str, Any]) -> None:
        self._write_meta(self.run_dir / schema.RUN_META, meta)

    def write_rank_meta(self, meta: Mapping[str, Any]) -> None:
        self._write_meta(self.rank_dir / schema.RANK_META, meta)

    def _write_meta(self, path: Path, meta: Mapping[str, Any]) -> None:
        try:
            write_json_atomic(path, meta)
        except OSError as error:
            self._write_failed(path, error)

    def _write_failed(self, path: Path, error: BaseException) -> None:
        """One warning line per run directory, at its first file that cannot be written (a full or read-only
        disk fails them all)."""
        if self._failed:
            logger.debug("gpuprof: cannot write %s (%s)", path, error)
            return
        self._failed = True
        logger.warning("gpuprof: cannot write %s (%s): its records, and any other of %s that cannot be written "
                       "from now on, are lost", path, error, self.run_dir)

    def artifact_dir(self, name: str) -> Path:
        """A folder for files beside the streams (`traces`, `snapshots`, `numerics`)."""
        path = self.run_dir / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def trace_path(self, first_step: int, last_step: int) -> Path:
        """This rank's Chrome trace of a window; one folder per window, as HTA expects."""
        folder = self.artifact_dir(schema.TRACES_DIR) / f"steps-{first_step}-{last_step}"
        folder.mkdir(exist_ok=True)
        return folder / f"{schema.rank_dir_name(self.rank)}.pt.trace.json.gz"

    def snapshot_path(self, step: int) -> Path:
        return self.artifact_dir(schema.SNAPSHOTS_DIR) / f"{schema.rank_dir_name(self.rank)}.step-{step}.pickle"

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.run_dir))

    def close(self) -> None:
        """Closes the streams and compacts each to Parquet; a failure leaves the JSON lines."""
        atexit.unregister(self.flush)
        self._stopped.set()
        self._flusher.join()
        for name, stream in self.streams.items():
            stream.close()
            try:
                compact(stream.path, name)
            except OSError as error:  # the JSON lines remain readable
                self._write_failed(stream.path.with_suffix(".parquet"), error)
            except Exception as error:  # noqa: BLE001 - the JSON lines remain readable
                logger.warning("gpuprof: could not compact %s to Parquet (%s)", stream.path, error)


def _log_failure(path: Path, error: BaseException) -> None:
    logger.warning("gpuprof: cannot write %s (%s); this stream is switched off", path, error)


def compact(jsonl: Path, stream: str) -> None:
    """JSON lines -> Parquet beside it (atomically), then removes the JSON lines."""
    from gpuprof.run.streams import read_jsonl_frame, storable

    frame = storable(read_jsonl_frame(jsonl, stream))
    target = jsonl.with_suffix(".parquet")
    tmp = target.with_name(f".{target.name}.tmp")
    with _removed_on_failure(tmp):
        frame.to_parquet(tmp, index=False)
        os.replace(tmp, target)
    jsonl.unlink()

