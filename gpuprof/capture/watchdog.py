"""The hang watchdog: a `hang` event while the job is still hung, naming the rank that is behind and where.

A daemon thread on every rank wakes every `HEARTBEAT_S`. It publishes this rank's heartbeat (step,
phase, time, collectives made, the collective in flight, where the main thread is) to the store
torchrun already runs (a client of its TCPStore of its own, so that a blocked store call of the loop
never blocks it), and watches the step: when it has not advanced for the timeout, the thread asks
every rank for its stacks (a counter in the store, which each rank's thread polls), waits for them a
few beats, and writes one `hang` event: every thread's Python stack, the phase, the collective it
waits in, the ranks behind and those waiting for them (each one's step, phase and stack), a desync
when the ranks' collectives differ, and one summary line. The training thread only stores a tuple
per step; no collective, no store call and no sync ever runs on it.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from collections import deque
from datetime import timedelta

import torch

from gpuprof.capture import flight, usercode
from gpuprof.errors import GpuprofError
from gpuprof.modules import initialized
from gpuprof.torch_compat import private
from gpuprof.run.jsonable import encodable
from gpuprof.run.schema import EventKind

logger = logging.getLogger("gpuprof")

HEARTBEAT_S = 5.0
MIN_TIMEOUT_S = 120.0
TIMEOUT_STEPS = 20  # the default timeout in median steps, from MIN_TIMEOUT_S up
STEP_TIMES_KEPT = 100
STEP_COLLECTIVES_KEPT = 8  # the collective count at the start of each of the last steps, for desyncs
STALE_BEATS = 3  # a rank whose heartbeat is older than this many beats is silent (dead, or holds the GIL)
STACK_WAIT_BEATS = 2  # how long a stalled rank waits for the others' stacks
STORE_TIMEOUT_S = 10.0
STACKS_IN_EVENT = 8  # ranks behind and ranks waiting whose main-thread stacks an event carries, each


def check_timeout(value) -> float | None:
    """hang_timeout_s as given: None (the default), 0 (off) or seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise GpuprofError(f"hang_timeout_s must be a number of seconds, 0 (off) or None (the default), got {value!r}")
    return float(value)


def connect_store(session: str):
    """A client of the job's store (torchrun's TCPStore at MASTER_ADDR:MASTER_PORT, else the default
    process group's), its keys under `gpuprof/<session>/`; None when the process has none."""
    store = None
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if address and port and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        try:
            store = torch.distributed.TCPStore(address, int(port), is_master=False, wait_for_workers=False,
                                               timeout=timedelta(seconds=STORE_TIMEOUT_S))
        except Exception as error:  # noqa: BLE001 - no reachable store: the default group's, or none
            logger.info("gpuprof: hang watchdog cannot reach the store at %s:%s (%r)", address, port, error)
    if store is None and initialized():
        store = private("torch.distributed.distributed_c10d._get_default_store", lambda: None)()
    return torch.distributed.PrefixStore(f"gpuprof/{session}/", store) if store is not None else None


class HeartbeatBoard:
    """The ranks' heartbeats and stacks in the store: `beat/R`, `stacks/R` (JSON) and the `dump` counter."""

    def __init__(self, store, world_size: int):
        self.store, self.world_size = store, world_size

    def publish(self, rank: int, beat: dict) -> None:
        self.store.set(f"beat/{rank}", json.dumps(beat, default=encodable))

    def post_stacks(self, rank: int, payload: dict) -> None:
        self.store.set(f"stacks/{rank}", json.dumps(payload, default=encodable))

    def request_dump(self) -> int:
        return self.store.add("dump", 1)

    def dump_requests(self) -> int:
        return self.store.add("dump", 0)

    def read(self, kind: str) -> dict[int, dict]:
        found = {}
        for rank in range(self.world_size):
            key = f"{kind}/{rank}"
            if self.store.check([key]):
                found[rank] = json.loads(self.store.get(key))
        return found


class HangWatchdog:
    """A collector: the loop's side stores (step, start time, collectives) at each step start; the rest
    runs on its thread. timeout_s: None for max(MIN_TIMEOUT_S, TIMEOUT_STEPS x the median step)."""

    name = "hang_watchdog"

    def __init__(self, timeout_s: float | None, interval_s: float = HEARTBEAT_S):
        self.timeout_s = timeout_s
        self.interval_s = min(interval_s, timeout_s / 4) if timeout_s else interval_s
        self._prof = None
        self._board: HeartbeatBoard | None = None
        self._group = None
        self._step = (0, time.monotonic(), time.time())
        self._step_times_s: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self._step_collectives: deque[tuple[int, int]] = deque(maxlen=STEP_COLLECTIVES_KEPT)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reported_step: int | None = None  # the stalled step a hang event was written for
        self._dumps_answered = 0
        self._status = "running"

    # ------------------------------------------------------------------ the loop's side
    def on_start(self, prof) -> None:
        self._prof = prof
        flight.enable()
        self._group = _default_group()
        self._thread = threading.Thread(target=self._run, name="gpuprof-watchdog", daemon=True)
        self._thread.start()

    def on_step_start(self, prof, step: int) -> None:
        now = time.monotonic()
        if step > self._step[0]:
            self._step_times_s.append(now - self._step[1])
        self._step = (step, now, time.time())
        if self._group is not None:
            self._step_collectives.append((step, self._group._get_sequence_number_for_group()))

    def on_close(self, prof) -> None:
        self._status = getattr(prof, "final_status", None) or "finished"
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STORE_TIMEOUT_S)
        if self._reported_step is not None and self._status == "finished":  # slow, not hung: the run finished
            prof.event(EventKind.HANG_ENDED, f"the run finished after the hang at step {self._reported_step}",
                       step=self._reported_step)
        if self._board is not None:
            try:
                self._board.publish(prof.ranks.rank, self._beat())
            except Exception:  # noqa: BLE001 - the store may be gone at the end of the job
                pass

    def meta(self, prof) -> dict:
        return {"hang_watchdog": {"timeout_s": self.timeout_s, "heartbeat_s": self.interval_s,
                                  "store": self._board is not None}}

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        world_size = self._prof.ranks.world_size
        while not self._stop.wait(self.interval_s):
            try:
                if self._board is None and world_size > 1:
                    self._connect(world_size)
                self._tick()
            except torch.distributed.DistError as error:  # the store went away (the job ends): on without it
                logger.info("gpuprof: hang watchdog lost the store (%r); watching this rank alone", error)
                self._board = None
            except Exception as error:  # noqa: BLE001 - the watchdog must never take the process down
                logger.warning("gpuprof: hang watchdog stopped: %r", error)
                self._prof.event(EventKind.COLLECTOR_DISABLED, f"hang watchdog stopped: {error!r}", severity="warning",
                                 collector=self.name, hook="heartbeat", error=repr(error))
                return

    def _connect(self, world_size: int) -> None:
        store = connect_store(os.path.basename(os.path.abspath(self._prof.run_dir)))
        if store is not None:
            self._board = HeartbeatBoard(store, world_size)
            self._dumps_answered = self._board.dump_requests()  # an earlier run's requests are not this one's
        if self._group is None:
            self._group = _default_group()

    def _tick(self) -> None:
        rank = self._prof.ranks.rank
        beat = self._beat()
        stalled_s = beat["stalled_s"]
        if self._reported_step is not None and beat["step"] != self._reported_step:
            self._prof.event(EventKind.HANG_ENDED, f"step {self._reported_step} went on after the hang",
                             step=self._reported_step)
            self._reported_step = None
        self._prof.writer.write("heartbeats", [heartbeat_row(beat)])
        if self._board is not None:
            self._board.publish(rank, beat)
            if self._answer_requests() and stalled_s >= self.interval_s and self._reported_step is None:
                self._report(beat, requested=True)
        if stalled_s >= self.current_timeout_s() and self._reported_step is None:
            self._report(beat, requested=False)

    def _answer_requests(self) -> bool:
        """Posts this rank's stacks when another rank asked for them since the last answer."""
        requests = self._board.dump_requests()
        if requests <= self._dumps_answered:
            return False
        self._dumps_answered = requests
        self._board.post_stacks(self._prof.ranks.rank, self._stacks_payload(requests))
        return True

    def current_timeout_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s or float("inf")
        median_s = statistics.median(self._step_times_s) if self._step_times_s else 0.0
        return max(MIN_TIMEOUT_S, TIMEOUT_STEPS * median_s)

    def _beat(self) -> dict:
        """This rank's heartbeat. Where the main thread is, only once its step has been still for a beat: the
        stack is read from outside by faulthandler, which CPython 3.11 can crash when a C thread makes its thread
        state meanwhile (gloo's threads do), so a healthy step never pays that risk (gpuprof.capture.main_thread)."""
        step, started, started_unix_s = self._step
        stalled_s = time.monotonic() - started
        frames = usercode.main_thread_frames() if stalled_s >= self.interval_s else []
        return {
            "rank": self._prof.ranks.rank, "pid": os.getpid(), "status": self._status, "time_unix_s": time.time(),
            "step": step, "step_started_unix_s": started_unix_s, "stalled_s": stalled_s,
            "phase": self._prof.current_phase(), "where": usercode.where(frames),
            "collectives": self._group._get_sequence_number_for_group() if self._group is not None else None,
            "step_collectives": [list(pair) for pair in tuple(self._step_collectives)],  # copied at once: the loop appends
            "collective": self._collective(frames),
        }

    def _collective(self, frames: list[dict]) -> dict | None:
        """The collective this rank waits in: the first the Flight Recorder saw enqueued and not completed
        (its sequence number), named by a torch.distributed call on the main thread's stack, else a DDP
        gradient bucket launched this step; without a recorder, that call or bucket alone. None for a rank whose
        main thread is read in its data with no such call on it: its loader holds it, and an entry or bucket time
        read then is an earlier step's (a loaded host's recorder marks completions late)."""
        if self._group is None:
            return None
        call = usercode.collective_call(frames)
        if frames and call is None and self._prof.current_phase() == "data":
            return None
        arrival = next((c.arrival_unix_s for c in self._prof.collectors if hasattr(c, "arrival_unix_s")), None)
        guess = {"kind": call or "all_reduce", "since_unix_s": None if call else arrival}
        waiting = flight.waiting_on(str(torch.distributed.get_backend()))
        if waiting is False:
            return guess if call or arrival else None
        return {**guess, **waiting} if waiting else None

    def _stacks_payload(self, request: int) -> dict:
        """Every thread's stack, and the Flight Recorder's entries: the last ones, and the one in flight."""
        payload = {"request": request, "stacks": usercode.thread_stacks(), "flight_recorder": [], "collective": None}
        if self._group is not None:
            entries, completed = flight.read(str(torch.distributed.get_backend()))
            payload["flight_recorder"] = flight.recent(entries)
            in_flight = flight.in_flight(entries, completed)
            # the one the main thread waits in; an earlier one may read not completed yet (a loaded host's recorder)
            main = next((stack["frames"] for stack in payload["stacks"] if stack["main"]), [])
            call = usercode.collective_call(main)
            payload["collective"] = next((entry for entry in in_flight if entry["kind"] == call),
                                         next(iter(in_flight), None))
        return payload

    def _report(self, beat: dict, requested: bool) -> None:
        """Writes this rank's `hang` event (and hands every buffered record to the OS)."""
        rank = self._prof.ranks.rank
        self._reported_step = beat["step"]
        own = self._stacks_payload(self._dumps_answered)
        beat = with_recorded_collective(beat, own)
        beats, payloads = {rank: beat}, {rank: own}
        if self._board is not None:
            if not requested:
                self._dumps_answered = self._board.request_dump()
                own["request"] = self._dumps_answered
                self._board.post_stacks(rank, own)
            payloads = self._gather_stacks(self._dumps_answered)
            beats = {other: with_recorded_collective(other_beat, payloads.get(other))
                     for other, other_beat in self._board.read("beat").items()}
            beats[rank] = beat
        hang = describe_hang(beats, payloads, time.time(), STALE_BEATS * self.interval_s)
        self._prof.event(EventKind.HANG, hang["summary"], severity="critical", step=beat["step"],
                         timeout_s=self.current_timeout_s(), stalled_s=beat["stalled_s"], phase=beat["phase"],
                         collective=beat["collective"], stacks=own["stacks"], requested=requested, **hang)
        self._prof.writer.flush()

    def _gather_stacks(self, request: int) -> dict[int, dict]:
        """The ranks' stacks answering `request`, waiting up to STACK_WAIT_BEATS beats for the living ones."""
        deadline = time.monotonic() + STACK_WAIT_BEATS * self.interval_s
        while True:
            self._answer_requests()
            payloads = {rank: payload for rank, payload in self._board.read("stacks").items()
                        if payload.get("request", 0) >= request}
            if len(payloads) >= self._board.world_size or time.monotonic() > deadline or self._stop.is_set():
                return payloads
            time.sleep(min(0.5, self.interval_s / 4))


def with_recorded_collective(beat: dict, payload: dict | None) -> dict:
    """The beat with its collective in flight as the rank's Flight Recorder entry names it (kind, sizes,
    since when), where the rank posted one."""
    recorded = (payload or {}).get("collective")
    if not recorded or not beat.get("collective"):
        return beat
    return {**beat, "collective": {**beat["collective"], **{k: v for k, v in recorded.items() if v is not None}}}


def heartbeat_row(beat: dict) -> dict:
    collective = beat["collective"] or {}
    return {"time_unix_s": beat["time_unix_s"], "rank": beat["rank"], "step": beat["step"], "phase": beat["phase"],
            "stalled_s": beat["stalled_s"], "collectives": beat["collectives"], "collective_kind": collective.get("kind"),
            "collective_seq": collective.get("seq"), "where": beat["where"]}


def _default_group():
    return private("torch.distributed.distributed_c10d._get_default_group", lambda: None)() if initialized() else None


def describe_hang(beats: dict[int, dict], payloads: dict[int, dict], now_unix_s: float, stale_s: float) -> dict:
    """From the ranks' heartbeats and stacks: who is behind, who waits for them, desyncs, and one line."""
    silent = sorted(r for r, b in beats.items() if b["status"] == "running" and now_unix_s - b["time_unix_s"] > stale_s)
    closed = {r: b["status"] for r, b in beats.items() if b["status"] != "running"}
    alive = [r for r in sorted(beats) if r not in silent and r not in closed]
    waiting = [r for r in alive if beats[r].get("collective")]
    if waiting:
        behind = sorted(set(beats) - set(waiting))
    else:
        progress = {r: (beats[r]["step"], beats[r].get("collectives") or 0) for r in alive}
        lowest = min(progress.values(), default=None)
        behind = sorted(r for r, value in progress.items() if value == lowest) + silent + sorted(closed)
    ranks = {r: _rank_view(beats[r], payloads.get(r), now_unix_s, with_stack=r in behind[:STACKS_IN_EVENT]
                           or r in waiting[:STACKS_IN_EVENT]) for r in sorted(beats)}
    for r in silent:
        ranks[r]["silent_s"] = now_unix_s - beats[r]["time_unix_s"]
    desync = collective_desync(beats, payloads)
    return {"behind_ranks": behind, "waiting_ranks": waiting, "silent_ranks": silent, "closed_ranks": closed,
            "ranks": ranks, "desync": desync, "summary": summary_line(behind, waiting, ranks, desync)}


def _rank_view(beat: dict, payload: dict | None, now_unix_s: float, with_stack: bool) -> dict:
    view = {key: beat.get(key) for key in ("step", "phase", "where", "status", "collective", "collectives", "pid")}
    view["stalled_s"] = now_unix_s - beat["step_started_unix_s"]
    collective = beat.get("collective") or {}
    view["waited_s"] = now_unix_s - collective["since_unix_s"] if collective.get("since_unix_s") else None
    main = next((stack for stack in (payload or {}).get("stacks", ()) if stack["main"]), None)
    if with_stack and main is not None:
        view["stack"] = main["frames"]
    return view


def collective_desync(beats: dict[int, dict], payloads: dict[int, dict]) -> dict | None:
    """Ranks that reached different collectives: a different count at the start of a step both began,
    a different collective in flight at the same sequence number, or a Flight Recorder mismatch."""
    started: dict[int, dict[int, int]] = {}
    for rank, beat in beats.items():
        for step, count in beat.get("step_collectives") or ():
            started.setdefault(step, {})[rank] = count
    for step in sorted(started):
        counts = started[step]
        if len(counts) > 1 and len(set(counts.values())) > 1:
            return {"how": "count", "step": step, "collectives_by_rank": counts}
    recorded = {rank: payload["flight_recorder"] for rank, payload in payloads.items() if payload.get("flight_recorder")}
    mismatch = flight.first_mismatch(recorded) if len(recorded) > 1 else None
    if mismatch is not None:
        return {"how": "flight_recorder", **mismatch}
    in_flight = {rank: beat["collective"] for rank, beat in beats.items() if (beat.get("collective") or {}).get("seq")}
    by_seq: dict[int, dict[int, str]] = {}
    for rank, collective in in_flight.items():
        by_seq.setdefault(collective["seq"], {})[rank] = collective["kind"]
    for seq, kinds in sorted(by_seq.items()):
        if len(set(kinds.values())) > 1:
            return {"how": "kind", "seq": seq, "by_rank": kinds}
    return None


def _collective_text(view: dict) -> str:
    collective = view.get("collective") or {}
    kind = collective.get("kind") or "a collective"
    phase = view.get("phase")
    text = f"{phase}'s {kind}" if phase and phase not in ("other", None) else kind
    return text + (f" (#{collective['seq']})" if collective.get("seq") else "")


def summary_line(behind: list[int], waiting: list[int], ranks: dict[int, dict], desync: dict | None) -> str:
    parts = []
    for rank in behind[:STACKS_IN_EVENT]:
        view = ranks[rank]
        if view["status"] != "running":
            parts.append(f"rank {rank} has {view['status']} at step {view['step']}")
        elif "silent_s" in view:
            parts.append(f"rank {rank} is silent since step {view['step']} (no heartbeat for {view['silent_s']:.0f} s: "
                         "its process died, or holds the GIL)")
        else:
            where = f" in {view['where']}" if view.get("where") else ""
            parts.append(f"rank {rank} is at step {view['step']} ({view['phase']}){where}")
    for rank in waiting[:STACKS_IN_EVENT]:
        view = ranks[rank]
        waited = view["waited_s"] if view["waited_s"] is not None else view["stalled_s"]
        parts.append(f"rank {rank} has waited in {_collective_text(view)} for {waited:.0f} s")
    more = len(behind) + len(waiting) - len(parts)
    if more > 0:
        parts.append(f"and {more} more ranks")
    if desync is not None:
        parts.append(desync_text(desync))
    return "; ".join(parts)


def desync_text(desync: dict) -> str:
    if desync["how"] == "count":
        counts = ", ".join(f"rank {r}: {n}" for r, n in sorted(desync["collectives_by_rank"].items()))
        return f"desync: different collective counts at the start of step {desync['step']} ({counts})"
    kinds = ", ".join(f"rank {r}: {k}" for r, k in sorted(desync["by_rank"].items()))
    return f"desync: the ranks' collective #{desync['seq']} differs ({kinds})"
