"""The recording file format of ``protos/nanoserve/v1/recording.proto``: the scheduler writes it, replay reads it.

A session (one start of recording) is written into ``DIR`` as ``<session>-<index>.nsrec`` files, the next one begun
when the current one would pass its size limit. Each file is the magic, a header frame, then one frame per
``Record``; a frame is the payload's length (varint), its CRC-32 and the payload, so a torn or damaged file is
refused by name and byte offset instead of being replayed wrong. The reader checks every frame of every file
before it hands out the first record.
"""

from __future__ import annotations

import glob
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from io import FileIO
from pathlib import Path

from nanoserve.v1 import recording_pb2 as rpb

MAGIC = b"NSRECORD"
VERSION = 1
SUFFIX = ".nsrec"
# A frame this large is a damaged length, not a record: no plan or result comes near it.
MAX_FRAME_BYTES = 1 << 30
CRC_BYTES = 4
_TIME_TAG = bytes([1 << 3 | 1])  # Record.time_s: field 1, 64-bit


class RecordingError(ValueError):
    """A recording that cannot be read; the message names the file, the byte offset and what is wrong."""


def varint(value: int) -> bytes:
    """Unsigned LEB128, as protobuf writes lengths."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# Record's entries by name: the tag bytes of each (a length-delimited field of the oneof).
ENTRY_TAGS = {f.name: varint(f.number << 3 | 2) for f in rpb.Record.DESCRIPTOR.oneofs_by_name["entry"].fields}


def record_bytes(entry: str, time_s: float, payload: bytes) -> bytes:
    """A serialized ``Record`` whose ``entry`` holds the serialized message ``payload``: the wire format of the
    envelope built around the bytes, without copying the message into a Record first."""
    return _TIME_TAG + struct.pack("<d", time_s) + ENTRY_TAGS[entry] + varint(len(payload)) + payload


def frame(payload: bytes) -> bytes:
    return varint(len(payload)) + zlib.crc32(payload).to_bytes(CRC_BYTES, "little") + payload


def file_name(session: str, index: int) -> str:
    return f"{session}-{index:05d}{SUFFIX}"


class RecordingWriter:
    """Writes one session's records into ``directory``, a new file begun whenever the current one would pass
    ``max_file_bytes`` (each holds at least one record). Single-threaded: the scheduler's writer thread owns it."""

    def __init__(self, directory: Path, session: str, started_at: float, with_text: bool,
                 max_file_bytes: int) -> None:
        self.directory = directory
        self.header = rpb.RecordingHeader(version=VERSION, session=session, started_at=started_at,
                                          with_text=with_text)
        self.max_file_bytes = max_file_bytes
        self.num_records = 0
        self.num_bytes = 0
        self._file: FileIO | None = None
        self._size = self._header_size = 0
        # Bytes of the current file known to be on disk whole: a failed write is cut back to here.
        self._good = 0
        directory.mkdir(parents=True, exist_ok=True)
        self._open(0)

    def _open(self, index: int) -> None:
        if self._file is not None:
            self._file.close()
        self.header.file_index = index
        # Unbuffered: each batch is one write, and a failed one is cut back without a buffer to flush first.
        path = self.directory / file_name(self.header.session, index)
        self._file = open(path, "xb", buffering=0)  # noqa: SIM115
        self._size = self._good = 0
        try:
            self._append(MAGIC + frame(self.header.SerializeToString()))
        except OSError:  # a full disk: no file without its header, which no reader could open
            self._file.close()
            self._file = None
            path.unlink(missing_ok=True)
            raise
        self._header_size = self._size

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self._file.write(view) :]
        self._size += len(data)
        self._good = self._size
        self.num_bytes += len(data)

    def write(self, records: list[bytes]) -> None:
        """Write serialized ``Record``s (``record_bytes``), flushed: one write per file they go into. An OSError
        (a full disk) leaves the file cut back to its last whole record; the writer is then to be ``close``d."""
        try:
            batch: list[bytes] = []
            size = self._size
            for record in records:
                framed = frame(record)
                if size + len(framed) > self.max_file_bytes and (batch or self._size > self._header_size):
                    self._append(b"".join(batch))
                    batch.clear()
                    self._open(self.header.file_index + 1)
                    size = self._size
                batch.append(framed)
                size += len(framed)
            self._append(b"".join(batch))
        except OSError:
            self._cut_back()
            raise
        self.num_records += len(records)

    def _cut_back(self) -> None:
        """Drop the torn end of a failed write, so the file still reads whole (cutting frees space, it needs none)."""
        if self._file is None:
            return
        try:
            self._file.truncate(self._good)
        except (OSError, ValueError):  # ValueError: the file could not even be kept open
            return

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class Session:
    """One session's files, in order, and how many records they hold."""

    name: str
    files: list[Path] = field(default_factory=list)
    header: rpb.RecordingHeader = field(default_factory=rpb.RecordingHeader)
    num_records: int = 0


def _frames(path: Path, data: bytes) -> Iterator[tuple[int, bytes]]:
    """Each frame's offset and payload, checked: a torn frame or a bad checksum raises ``RecordingError``."""
    offset = len(MAGIC)
    while offset < len(data):
        start, length, shift = offset, 0, 0
        while True:
            if offset >= len(data):
                raise RecordingError(f"{path} is truncated at byte {start}: its last record is cut short")
            byte = data[offset]
            offset += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
            if shift > 35:
                raise RecordingError(f"{path} is corrupt at byte {start}: not a record length")
        if length > MAX_FRAME_BYTES:
            raise RecordingError(f"{path} is corrupt at byte {start}: a record of {length} bytes")
        end = offset + CRC_BYTES + length
        if end > len(data):
            raise RecordingError(f"{path} is truncated at byte {start}: its last record ({length} bytes) is cut short "
                                 f"after {max(0, len(data) - offset - CRC_BYTES)}")
        payload = data[offset + CRC_BYTES : end]
        if zlib.crc32(payload) != int.from_bytes(data[offset : offset + CRC_BYTES], "little"):
            raise RecordingError(f"{path} is corrupt at byte {start}: the record's checksum does not match")
        yield start, payload
        offset = end


def _read_file(path: Path) -> tuple[rpb.RecordingHeader, list[tuple[int, bytes]]]:
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise RecordingError(f"{path} is not a nanoserve recording (it does not start with {MAGIC.decode()})")
    frames = list(_frames(path, data))
    if not frames:
        raise RecordingError(f"{path} is truncated: it has no header")
    header = rpb.RecordingHeader()
    try:
        header.ParseFromString(frames[0][1])
    except Exception as e:
        raise RecordingError(f"{path} is corrupt at byte {frames[0][0]}: not a header ({e})") from None
    if header.version != VERSION:
        raise RecordingError(f"{path} is recording format version {header.version}; this nanoserve reads version "
                             f"{VERSION}")
    return header, frames[1:]


class Recording:
    """The sessions found in a directory, oldest first, every frame of every file checked on opening."""

    def __init__(self, directory: Path, session: str | None = None) -> None:
        self.directory = directory
        if not directory.is_dir():
            raise RecordingError(f"{directory} is not a directory")
        # A session's own files only: another's damaged file does not stand in the way of this one.
        paths = sorted(directory.glob(f"*{SUFFIX}" if session is None else
                                      f"{glob.escape(session)}-{'[0-9]' * 5}{SUFFIX}"))
        if not paths and session is None:
            raise RecordingError(f"{directory} holds no recording (no *{SUFFIX} file)")
        sessions: dict[str, Session] = {}
        for path in paths:
            header, frames = _read_file(path)
            if session is not None and header.session != session:
                continue
            found = sessions.setdefault(header.session, Session(header.session, header=header))
            if header.file_index != len(found.files):
                raise RecordingError(f"session {header.session}: file {len(found.files)} is missing before {path}")
            found.files.append(path)
            found.num_records += len(frames)
        if session is not None and session not in sessions:
            raise RecordingError(f"{directory} holds no session {session!r}")
        self.sessions = sorted(sessions.values(), key=lambda s: (s.header.started_at, s.name))

    @property
    def num_records(self) -> int:
        return sum(s.num_records for s in self.sessions)

    def records(self, session: Session) -> Iterator[rpb.Record]:
        """The session's records in order (its files are read again, and checked again, one at a time)."""
        for path in session.files:
            for offset, payload in _read_file(path)[1]:
                record = rpb.Record()
                try:
                    record.ParseFromString(payload)
                except Exception as e:
                    raise RecordingError(f"{path} is corrupt at byte {offset}: not a record ({e})") from None
                if record.WhichOneof("entry") is None:
                    raise RecordingError(f"{path} is corrupt at byte {offset}: a record with no entry")
                yield record
