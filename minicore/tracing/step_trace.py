"""Step traces: what every engine rank did, step by step, as Trace Event Format records, the JSON
that Perfetto's UI (ui.perfetto.dev) and chrome://tracing open.

minicore's own: vLLM has the torch profiler (kernel-level, one process) and OpenTelemetry request
spans (vllm/tracing.py), nothing that shows DP ranks in time. A trace is one file that every
process of a run appends to: the JSON Array Format, ``[`` then one record a line, each ending in
``,``, whose closing ``]`` the format makes optional; a write is one ``os.write`` of whole lines on
an ``O_APPEND`` file, so records of several processes never interleave. Records are queued by the
busy loop and written by a thread of their own (``emit`` never blocks), every WRITE_INTERVAL_S:
woken for each record it would take the GIL from the busy loop at every step (which on a loaded
machine, measured, costs more than building the records); ``defer`` queues a function and its
arguments instead, called on that thread for the records, so that the busy loop hands over
references and builds nothing. A process writes at most ``limit`` records, then one ``trace
truncated`` instant and no more (the bound is in records, not bytes: a record is about 200 bytes,
a step's more with a large batch). Times are microseconds of the wall clock (``time.time_ns``),
which the processes of one machine share; a rank on another machine adds the offset its DP group
measured against rank 0 (``set_clock_offset``).

The schema (what trace-view and the tests read): one process (``pid``) per DP rank (``DP rank
N``), named by a ``process_name`` metadata record; thread 0 of a rank is its steps (``X`` records:
``step``, ``dummy batch``), thread 1 its collectives (``X``, args ``waited_ms``), thread 2 its
forwards and thread 3 its schedule() calls (``X`` ``forward`` and ``schedule``, args ``step``: with
async scheduling the next step's schedule falls inside this step's forward), counters (``C``)
``kv_usage``, ``requests``; instants (``i``) for waves and events; each request an async track
(``b``/``e`` records, ``cat`` ``request``, ``id`` the request id) on its rank. Left out: flow
arrows between ranks, the protobuf format.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)

DEFAULT_LIMIT = 1_000_000  # records a process writes, about 200 MB
# How often the writer's thread takes what is queued: a step's records reach the file this late.
WRITE_INTERVAL_S = 0.1
STEPS, COLLECTIVES, FORWARD, SCHEDULE = 0, 1, 2, 3  # a rank's threads (tracks)
THREAD_NAMES = {STEPS: "steps", COLLECTIVES: "collectives", FORWARD: "forward",
                SCHEDULE: "schedule"}


def now_us() -> float:
    return time.time_ns() / 1000


class TraceWriter:
    """One process's records, appended to ``path`` by a thread of its own. fresh: replace a file
    left at ``path`` (by an earlier run) instead of appending to it."""

    def __init__(self, path: str | os.PathLike, pid: int, process_name: str,
                 limit: int = DEFAULT_LIMIT, fresh: bool = False):
        self.path, self.pid, self.limit = Path(path), pid, limit
        self.offset_us = 0.0
        # Counted, and set once the limit is reached, by the writer's thread alone.
        self._count, self.full = 0, False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()  # set by flush and close, not by a record
        # msgspec's: a step's record, with its tokens per request, in a tenth of json's time.
        self._encode = msgspec.json.Encoder().encode
        self._fd = _open_trace(self.path, fresh)
        self._thread = threading.Thread(target=self._write_loop, name="trace-writer",
                                        daemon=True)
        self._thread.start()
        # A process that never closes its writer (an offline LLM left to the interpreter's exit)
        # still writes what it queued.
        atexit.register(self.close)
        self.emit({"ph": "M", "name": "process_name", "args": {"name": process_name}})
        for tid, name in THREAD_NAMES.items():
            self.emit({"ph": "M", "name": "thread_name", "tid": tid, "args": {"name": name}})

    def set_clock_offset(self, offset_us: float) -> None:
        """Added to every later time: this clock's difference from rank 0's."""
        self.offset_us = offset_us

    def now(self) -> float:
        return now_us() + self.offset_us

    def emit(self, record: dict) -> None:
        """Queue one record (its pid filled in when written); past the limit, one truncation
        mark and then nothing."""
        if not self.full:
            self._queue.put(record)

    def defer(self, build, *args) -> None:
        """Queue build(*args), called on the writer's thread for the records it returns (an
        iterable of them)."""
        if not self.full:
            self._queue.put((build, args))

    def complete(self, name: str, start_us: float, end_us: float, tid: int = STEPS,
                 **args) -> None:
        self.emit({"ph": "X", "name": name, "ts": start_us, "dur": end_us - start_us,
                   "tid": tid, "args": args})

    def instant(self, name: str, tid: int = STEPS, **args) -> None:
        self.emit({"ph": "i", "name": name, "ts": self.now(), "tid": tid, "s": "t",
                   "args": args})

    def counter(self, name: str, ts: float, **values) -> None:
        self.emit({"ph": "C", "name": name, "ts": ts, "args": values})

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until what is queued now is written; whether it was within timeout."""
        written = threading.Event()
        self._queue.put(written)
        self._wake.set()
        return written.wait(timeout)

    def close(self) -> None:
        """Write what is queued, then stop; again, nothing."""
        if self._fd is None:
            return
        atexit.unregister(self.close)
        self._queue.put(None)
        self._wake.set()
        self._thread.join(timeout=5)
        os.close(self._fd)
        self._fd = None

    def _write_loop(self) -> None:
        """Write whatever is queued in one go, every WRITE_INTERVAL_S or when woken, until
        close's None."""
        closed = False
        while not closed:
            self._wake.wait(WRITE_INTERVAL_S)
            self._wake.clear()  # what woke it is queued already: taken below
            items = []
            while not self._queue.empty():
                items.append(self._queue.get())
            lines: list[bytes] = []
            written = []
            for item in items:
                if item is None:
                    closed = True
                elif isinstance(item, threading.Event):
                    written.append(item)
                else:
                    self._add_lines(item, lines)
            if lines:
                os.write(self._fd, b"".join(lines))
            for event in written:
                event.set()

    def _add_lines(self, item, lines: list[bytes]) -> None:
        """A queued record, or a deferred build's records, as lines, within the limit."""
        try:
            records = item[0](*item[1]) if isinstance(item, tuple) else (item,)
            for record in records:
                if self._count >= self.limit:
                    self._truncate(lines)
                    return
                self._count += 1
                record.setdefault("pid", self.pid)
                lines.append(self._encode(record) + b",\n")
        except Exception:  # a trace must never stop the engine: the step's records are lost
            logger.exception("step trace: a record could not be written")

    def _truncate(self, lines: list[bytes]) -> None:
        if not self.full:
            self.full = True
            lines.append(self._encode({"ph": "i", "name": "trace truncated", "s": "p",
                                       "pid": self.pid, "ts": self.now(),
                                       "args": {"limit": self.limit}}) + b",\n")


def overlap_records(step: int, schedule: tuple[float, float], forward: tuple[float, float]
                    ) -> list[dict]:
    """A step's schedule() and forward (start, end in us) as X records on their threads."""
    return [{"ph": "X", "name": name, "ts": start, "dur": end - start, "tid": tid,
             "args": {"step": step}}
            for name, tid, (start, end) in (("schedule", SCHEDULE, schedule),
                                            ("forward", FORWARD, forward)) if end > start]


def _open_trace(path: Path, fresh: bool) -> int:
    """The file for appending, begun with ``[`` by whichever process creates it (or, fresh,
    replaces it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fresh:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"[\n")
        return fd
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"[\n")
        return fd
    except FileExistsError:
        return os.open(path, os.O_WRONLY | os.O_APPEND)


def read_trace(path: str | os.PathLike) -> list[dict]:
    """The records of a trace file, closed or not (a trailing comma, no ``]``)."""
    text = Path(path).read_text().strip()
    if text.endswith(","):
        text = text[:-1]
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)
