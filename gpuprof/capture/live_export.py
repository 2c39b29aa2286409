"""Each step's figures streamed to TensorBoard while the loop trains (`profile(..., live_export=DIR)`), written by a
thread of its own: the training thread only queues the step's record.

Tags are those of `gpuprof export --to tensorboard` (`steps/<column>` at the optimizer step, in `DIR/rank-R`), so a
live view and a later export read alike. A backend that fails (no tensorboard package, a folder that cannot be
written) switches this off with one event; the loop and the run's own files go on.
"""

from __future__ import annotations

import logging
import queue
import threading

from gpuprof.run import schema
from gpuprof.run.schema import EventKind

logger = logging.getLogger("gpuprof")

_CLOSE = None  # put on the queue at close: the thread writes what is left, then ends
CLOSE_WAIT_S = 10.0


class LiveTensorBoard:
    name = "live_export"

    def __init__(self, log_dir: str):
        self._log_dir = log_dir
        self._columns = schema.measured_columns("steps")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped = False  # the writing thread failed: nothing more is queued

    def on_start(self, prof) -> None:
        from torch.utils.tensorboard import SummaryWriter  # raising here switches the collector off, with its event

        writer = SummaryWriter(log_dir=f"{self._log_dir}/{schema.rank_dir_name(prof.ranks.rank)}")
        self._thread = threading.Thread(target=self._write, args=(prof, writer), name="gpuprof-live-export",
                                        daemon=True)
        self._thread.start()

    def meta(self, prof) -> dict:
        return {"live_export": {"to": "tensorboard", "log_dir": self._log_dir}}

    def on_step_record(self, prof, record: dict) -> None:
        if self._stopped:
            return
        self._queue.put((record["step"], record["time_unix_s"],
                         {column: record[column] for column in self._columns if record.get(column) is not None}))

    def on_close(self, prof) -> None:
        if self._thread is not None:
            self._queue.put(_CLOSE)
            self._thread.join(timeout=CLOSE_WAIT_S)

    def _write(self, prof, writer) -> None:
        try:
            while (item := self._queue.get()) is not _CLOSE:
                step, time_unix_s, values = item
                for column, value in values.items():
                    writer.add_scalar(f"steps/{column}", float(value), step, walltime=time_unix_s)
            writer.close()
        except Exception as error:  # noqa: BLE001 - a failing backend must not reach the loop
            self._stopped = True
            logger.warning("gpuprof: the live TensorBoard export stopped (%r); the run's own files go on", error)
            prof.event(EventKind.COLLECTOR_DISABLED, f"collector {self.name} switched off: writing to TensorBoard "
                       f"raised {error!r}", severity="warning", collector=self.name, hook="write", error=repr(error))
