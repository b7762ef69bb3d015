"""The scheduler's recording (docs/replay.md): what the engine hands its executor, written by a thread of its own.

``RecordingExecutor`` (``engine.recording_executor``) hands the ``Recorder`` each plan as it goes out, each result or
failure as it comes back, each reset, and the handshake of each executor instance new to the session. On the step's
path that is a clock read and an append to a deque, which wakes nobody: a plan or a result is not changed once
handed over (the planner sends copies), so the writer thread, waking every ``FLUSH_S``, encodes what gathered
(``common.step_codec``) and writes it (``common.recording``) in one go, a few times a second rather than twice a
step, so that it seldom takes the GIL from the engine's thread. The queue is bounded: a writer that falls behind,
like a write error or a full disk, stops the recording, logged once and seen in the status and the metrics, never
the service.

A session begins at a reset of the executor, so a recording always starts from an empty executor: the scheduler
resets it as it connects, and a recording started later asks the engine loop for a ``resync``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.recording import RecordingWriter, record_bytes
from common.step import ExecutorInfo
from common.step_codec import info_to_proto, plan_to_proto, result_to_proto
from nanoserve.v1 import recording_pb2 as rpb
from scheduler_svc.engine.metrics import PREFIX

log = logging.getLogger("nanoserve.scheduler")

# Records waiting for the writer, about two a step: a disk may stall for 0.2 s at the fastest step rates (W4), for
# seconds beside an accelerator, before the recording stops.
QUEUE_SIZE = 8192
# How often the writer thread wakes to write what gathered.
FLUSH_S = 0.05
# How long ``stop`` waits for the writer to empty its queue.
STOP_TIMEOUT_S = 10.0
DEFAULT_MAX_FILE_BYTES = 256 << 20


class RecordingUnavailable(RuntimeError):
    """The scheduler was started without ``--record DIR``: there is nowhere to record to."""


@dataclass(frozen=True)
class RecordingStatus:
    """``RecordingStatus`` of recording.proto, as plain data."""

    active: bool = False
    directory: str = ""
    session: str = ""
    num_records: int = 0
    num_bytes: int = 0
    error: str = ""
    starting: bool = False


@dataclass(eq=False)
class Session:
    """One start of recording: its queue, its writer and the writer's thread."""

    name: str
    writer: RecordingWriter
    started: float = field(default_factory=time.monotonic)
    # (entry, seconds since the start, item): appended by any thread, taken by the writer's.
    queue: deque = field(default_factory=deque)
    # Set by ``stop``: the writer writes what is left, then ends.
    closing: threading.Event = field(default_factory=threading.Event)
    # The executor instance whose handshake was recorded last.
    instance_id: str = ""
    failed: bool = False
    thread: threading.Thread | None = None


def session_name() -> str:
    """UTC time to the millisecond and a random suffix: file names sort sessions by age."""
    now = time.time()
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now % 1 * 1000):03d}Z-{secrets.token_hex(3)}"


class Recorder:
    """Sessions written into ``directory``: at most one at a time, started and stopped from any thread."""

    def __init__(self, directory: Path, with_text: bool = False,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES) -> None:
        self.directory = directory
        self.with_text = with_text
        self.max_file_bytes = max_file_bytes
        # Read on the step's path without the lock: records are taken while it is True.
        self.active = False
        # Started, waiting for the executor's next reset to begin the session.
        self.pending = False
        self.session: Session | None = None
        self.error = ""
        # Over every session, for the metrics.
        self.num_failed_sessions = 0
        self._bytes_before = 0
        self._lock = threading.Lock()

    def start(self) -> bool:
        """Begin a session at the executor's next reset; False when one is on, or about to begin, already."""
        with self._lock:
            if self.active or self.pending:
                return False
            self.pending, self.error = True, ""
            return True

    def begin(self, info: ExecutorInfo, num_dropped: int) -> None:
        """The executor was just reset while a session was to begin: open it with the handshake and that reset."""
        with self._lock:
            if not self.pending:
                return
            name = session_name()
            try:
                writer = RecordingWriter(self.directory, name, time.time(), self.with_text, self.max_file_bytes)
            except OSError as e:
                self.pending = False
                self._stopped_by(f"cannot write to {self.directory}: {e.strerror or e}")
                return
            if self.session is not None:
                self._bytes_before += self.session.writer.num_bytes
            self.session = session = Session(name, writer, instance_id=info.instance_id)
            session.queue.append(("handshake", 0.0, info))
            session.queue.append(("reset", 0.0, rpb.ExecutorReset(num_dropped_requests=num_dropped)))
            session.thread = threading.Thread(target=self._write, args=(session,), name="recorder", daemon=True)
            session.thread.start()
            # Active before no longer pending: a reader of the status (unlocked) never sees neither.
            self.active = True
            self.pending = False
        log.info("recording session %s into %s", name, self.directory)

    def handshake(self, info: ExecutorInfo) -> None:
        """A handshake: recorded when it names an instance other than the last one (a restart)."""
        session = self.session
        if self.active and session is not None and info.instance_id != session.instance_id:
            session.instance_id = info.instance_id
            self.put("handshake", info)

    def put(self, entry: str, item: object) -> None:
        """Queue ``item`` as a ``Record`` of ``entry`` (recording.proto's name), timed now; the step's path."""
        session = self.session
        if not self.active or session is None:
            return
        if len(session.queue) >= QUEUE_SIZE:
            self._fail(session, f"the writer fell {QUEUE_SIZE} records behind the steps")
            return
        session.queue.append((entry, time.monotonic() - session.started, item))

    def stop(self, reason: str = "stopped") -> None:
        """End the session in order (``reason``: "stopped" or "shutdown"), its last records written."""
        with self._lock:
            self.pending = False
            session = self.session
            if not self.active or session is None:
                return
            self.active = False
        session.queue.append(("end", time.monotonic() - session.started, rpb.RecordingEnd(reason=reason)))
        session.closing.set()
        session.thread.join(STOP_TIMEOUT_S)
        log.info("recording session %s stopped: %d records, %d bytes", session.name, session.writer.num_records,
                 session.writer.num_bytes)

    def status(self) -> RecordingStatus:
        session = self.session
        if session is None:
            return RecordingStatus(self.active, str(self.directory), error=self.error, starting=self.pending)
        return RecordingStatus(self.active, str(self.directory), session.name, session.writer.num_records,
                               session.writer.num_bytes, self.error, self.pending)

    @property
    def num_bytes(self) -> int:
        """Bytes written over every session."""
        session = self.session
        return self._bytes_before + (session.writer.num_bytes if session is not None else 0)

    def encode(self, entry: str, item: object) -> bytes:
        """The payload of a ``Record`` of ``entry`` (the writer thread's work, with ``record_bytes`` and the write)."""
        if entry == "plan":
            return plan_to_proto(item).SerializeToString()
        if entry == "result":
            return result_to_proto(item).SerializeToString()
        if entry == "handshake":
            kept = item if self.with_text else replace(item, tokenizer_json="", chat_template="")
            return info_to_proto(kept).SerializeToString()
        return item.SerializeToString()  # failure, reset and end come as their messages

    def _write(self, session: Session) -> None:
        """The writer thread: whatever gathered, encoded and written in one go, until the end or a failure."""
        done = False
        while not done and not session.failed:
            done = session.closing.wait(FLUSH_S)
            queued = session.queue
            batch = [queued.popleft() for _ in range(len(queued))]
            if not batch:
                continue
            try:
                session.writer.write([record_bytes(entry, t, self.encode(entry, item)) for entry, t, item in batch])
            except OSError as e:
                self._fail(session, f"cannot write to {self.directory}: {e.strerror or e}")
            except Exception as e:  # an encoding bug must not leave the steps filling a queue nobody empties
                log.exception("recording failed")
                self._fail(session, f"internal recording error ({type(e).__name__}: {e})")
        session.writer.close()

    def _fail(self, session: Session, reason: str) -> None:
        """Stop ``session`` for good (any thread); said once."""
        with self._lock:
            if session.failed:
                return
            session.failed = True
            if self.session is session:
                self.active = False
            self._stopped_by(reason)

    def _stopped_by(self, reason: str) -> None:
        self.error = reason
        self.num_failed_sessions += 1
        log.error("recording stopped: %s; the scheduler carries on without it", reason)


class RecordingMetrics:
    """The recording's metrics, for prometheus (docs/metrics.md)."""

    def __init__(self, recorder: Callable[[], Recorder | None]) -> None:
        self.recorder = recorder

    def collect(self) -> Iterator[Metric]:
        recorder = self.recorder()
        active = GaugeMetricFamily(PREFIX + "recording_active", "1 while plans and results are being recorded.")
        active.add_metric([], int(recorder is not None and recorder.active))
        written = CounterMetricFamily(PREFIX + "recording_bytes", "Bytes of recording written.")
        written.add_metric([], recorder.num_bytes if recorder is not None else 0)
        failed = CounterMetricFamily(PREFIX + "recording_failures",
                                     "Recordings stopped by an error (a full disk, a writer behind the steps).")
        failed.add_metric([], recorder.num_failed_sessions if recorder is not None else 0)
        yield from (active, written, failed)
