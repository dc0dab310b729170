"""Step traces: what every engine rank did, step by step, as Trace Event Format records, the JSON
that Perfetto's UI (ui.perfetto.dev) and chrome://tracing open.

minicore's own: vLLM has the torch profiler (kernel-level, one process) and OpenTelemetry request
spans (vllm/tracing.py), nothing that shows DP ranks in time. A trace is one file that every
process of a run appends to: the JSON Array Format, ``[`` then one record a line, each ending in
``,``, whose closing ``]`` the format makes optional; a write is one ``os.write`` of whole lines on
an ``O_APPEND`` file, so records of several processes never interleave. Records are queued by the
busy loop and written by a thread of their own (``emit`` never blocks); a process writes at most
``limit`` records, then one ``trace truncated`` instant and no more (the bound is in records, not
bytes: a record is about 200 bytes). Times are microseconds of the wall clock (``time.time_ns``),
which the processes of one machine share; a rank on another machine adds the offset its DP group
measured against rank 0 (``set_clock_offset``).

The schema (what trace-view and the tests read): one process (``pid``) per DP rank (``DP rank
N``), named by a ``process_name`` metadata record; thread 0 of a rank is its steps (``X`` records:
``step``, ``dummy batch``), thread 1 its collectives (``X``, args ``waited_ms``), counters (``C``)
``kv_usage``, ``requests``; instants (``i``) for waves and events; each request an async track
(``b``/``e`` records, ``cat`` ``request``, ``id`` the request id) on its rank. Left out: flow
arrows between ranks, the protobuf format.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path

DEFAULT_LIMIT = 1_000_000  # records a process writes, about 200 MB
STEPS, COLLECTIVES = 0, 1  # a rank's threads (tracks)


def now_us() -> float:
    return time.time_ns() / 1000


class TraceWriter:
    """One process's records, appended to ``path`` by a thread of its own."""

    def __init__(self, path: str | os.PathLike, pid: int, process_name: str,
                 limit: int = DEFAULT_LIMIT):
        self.path, self.pid, self.limit = Path(path), pid, limit
        self.offset_us = 0.0
        self._count = 0
        self._queue: queue.SimpleQueue[dict | None] = queue.SimpleQueue()
        self._fd = _open_trace(self.path)
        self._thread = threading.Thread(target=self._write_loop, name="trace-writer",
                                        daemon=True)
        self._thread.start()
        self.emit({"ph": "M", "name": "process_name", "args": {"name": process_name}})
        for tid, name in ((STEPS, "steps"), (COLLECTIVES, "collectives")):
            self.emit({"ph": "M", "name": "thread_name", "tid": tid, "args": {"name": name}})

    def set_clock_offset(self, offset_us: float) -> None:
        """Added to every later time: this clock's difference from rank 0's."""
        self.offset_us = offset_us

    def now(self) -> float:
        return now_us() + self.offset_us

    def emit(self, record: dict) -> None:
        """Queue one record (its pid filled in); past the limit, one truncation mark and then
        nothing."""
        self._count += 1
        if self._count > self.limit:
            if self._count == self.limit + 1:
                self._queue.put({"ph": "i", "name": "trace truncated", "s": "p", "pid": self.pid,
                                 "ts": self.now(), "args": {"limit": self.limit}})
            return
        record.setdefault("pid", self.pid)
        self._queue.put(record)

    def complete(self, name: str, start_us: float, end_us: float, tid: int = STEPS,
                 **args) -> None:
        self.emit({"ph": "X", "name": name, "ts": start_us, "dur": end_us - start_us,
                   "tid": tid, "args": args})

    def instant(self, name: str, tid: int = STEPS, **args) -> None:
        self.emit({"ph": "i", "name": name, "ts": self.now(), "tid": tid, "s": "t",
                   "args": args})

    def counter(self, name: str, ts: float, **values) -> None:
        self.emit({"ph": "C", "name": name, "ts": ts, "args": values})

    def close(self) -> None:
        """Write what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(timeout=5)
        os.close(self._fd)

    def _write_loop(self) -> None:
        """Write whatever is queued in one go, until close's None."""
        closed = False
        while not closed:
            records = [self._queue.get()]
            while not self._queue.empty():
                records.append(self._queue.get())
            closed = records[-1] is None
            lines = [json.dumps(r, separators=(",", ":")) + ",\n" for r in records if r]
            if lines:
                os.write(self._fd, "".join(lines).encode())


def _open_trace(path: Path) -> int:
    """The file for appending, begun with ``[`` by whichever process creates it."""
    path.parent.mkdir(parents=True, exist_ok=True)
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
