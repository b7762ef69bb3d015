"""The link between the scheduler service and its API process (``--api-process``): pickled frames, each after its
length, over a Unix socket in a folder only this user can open.

The API process sends ``("listening", port, http_port)`` once, then ``("submit", key, GenerateRequest bytes, whole)``
(``"submit_step"`` for a beam search's step) and ``("close", key, cancel)`` (its caller is done; ``cancel``: before
the request finished), and for its HTTP routes ``("served", key, with_tokenizer)`` and ``("beam_start", key,
GenerateRequest bytes)``, and ``("reading", tokens)`` when what each stream takes at a time while its pacing holds
outputs changes (``pacing.PacedReading``). The scheduler answers ``("accepted", key, request_id, n, prompt length,
prompt token ids if the request asked for them, else None)`` (to ``served``: ``("accepted", key, model names, adapter
names, tokenizer or None)``; to ``beam_start``: ``("accepted", key, BeamStart)``) or ``("failed", key, error)``, sends
each step's ``("outputs", items)`` for every request of the link at once, and ``("yield_cpu",)``,
``("beside_accelerator",)`` and ``("stop", grace_s)``. A decode step's plain token travels as ``(key, index, text,
token_ids)``, anything else as ``(key, RequestOutput)``: a step of 256 streams then costs the engine loop tens of
microseconds to send.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import struct

from scheduler_svc.core.outputs import RequestOutput

HEADER = struct.Struct("!I")
PROTOCOL = pickle.HIGHEST_PROTOCOL

Frame = tuple


def pack(frame: Frame) -> bytes:
    data = pickle.dumps(frame, PROTOCOL)
    return HEADER.pack(len(data)) + data


def recv_frame(sock: socket.socket) -> Frame | None:
    """The next frame from a blocking socket; None once the other side closed it (or died, ``read_frame``)."""
    try:
        return _recv_frame(sock)
    except ConnectionResetError:
        return None


def _recv_frame(sock: socket.socket) -> Frame | None:
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    data = _recv_exactly(sock, HEADER.unpack(header)[0])
    return None if data is None else pickle.loads(data)


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


async def read_frame(reader: asyncio.StreamReader) -> Frame | None:
    """The next frame on an event loop; None once the other side closed the link, or died with frames of ours unread
    (its kernel then resets the connection)."""
    try:
        header = await reader.readexactly(HEADER.size)
        return pickle.loads(await reader.readexactly(HEADER.unpack(header)[0]))
    except (asyncio.IncompleteReadError, ConnectionResetError):
        return None


def encode_outputs(items: list[tuple[int, RequestOutput]]) -> list[tuple]:
    """Each (key, output) as the frame carries it: a plain token as a tuple of its fields."""
    return [(key, output.index, output.text, output.token_ids) if _plain(output) else (key, output)
            for key, output in items]


def _plain(output: RequestOutput) -> bool:
    return (output.finish_reason is None and output.error is None and not output.logprobs
            and output.prompt_logprobs is None)


class PlainToken:
    """A plain token's output as the API process reads it: what ``RequestOutput`` says of one, made in half its time
    (building ``RequestOutput``s was the largest of the API process's own costs per token in a W5 ``api`` profile)."""

    __slots__ = ("index", "text", "token_ids")
    logprobs = ()
    finish_reason = usage = error = prompt_logprobs = matched_stop = None
    drained = False

    def __init__(self, index: int, text: str, token_ids: list[int]) -> None:
        self.index, self.text, self.token_ids = index, text, token_ids


def decode_output(item: tuple) -> tuple[int, RequestOutput | PlainToken]:
    if len(item) == 2:
        return item
    key, index, text, token_ids = item
    return key, PlainToken(index, text, token_ids)
