"""The scheduler's side of ``--api-process``: it starts the API process (``api.api_process``), takes the requests it
sends in through the ``Frontend`` like any other caller's, and sends each step's outputs for all of them at once.

Outputs go from the engine loop's thread straight onto the link (``delivery.link_deliver``): none passes through this
process's event loop. Requests, closes and answers go through it. If the API process dies the scheduler stops: a
server whose public port is gone serves nobody, and its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict

from smg_grpc_proto import vllm_engine_pb2 as vllm

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.api_process import ENV, Settings
from scheduler_svc.api.frontend import Frontend, public
from scheduler_svc.api.pacing import share_of
from scheduler_svc.api.process_link import Frame, encode_outputs, pack, recv_frame
from scheduler_svc.api.vllm_engine.responses import ResponseWriter
from scheduler_svc.api.vllm_engine.servicer import submit_generate
from scheduler_svc.config import ServiceConfig
from scheduler_svc.core.errors import RequestFailed, internal_error
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.engine.loop import RequestHandle

log = logging.getLogger("nanoserve.scheduler")

# How long the API process may take to start and bind the public port.
START_TIMEOUT_S = 60.0
ACCEPT_POLL_S = 0.1


class RemoteSink:
    """Where the engine loop delivers a request of the API process: the link, and the request's key on it."""

    __slots__ = ("link", "key")

    def __init__(self, link: ApiProcess, key: int) -> None:
        self.link, self.key = link, key


class ApiProcess:
    """The API process, its link, and the requests it sent in, by key."""

    def __init__(self, config: ServiceConfig, frontend: Frontend, internal_target: str, internal_http: str,
                 folder: str) -> None:
        """``internal_http``: the scheduler's HTTP routes' socket, when the API process serves --http-port."""
        self.config, self.frontend = config, frontend
        self.internal_target, self.internal_http = internal_target, internal_http
        self.path = os.path.join(folder, "link.sock")
        self.port = 0
        self.handles: dict[int, RequestHandle] = {}
        # Keys being submitted, and those of them whose caller went away meanwhile.
        self._pending: set[int] = set()
        self._closed_early: set[int] = set()
        self._send_lock = threading.Lock()
        self._stopping = False
        # Set when the API process ended before the scheduler asked it to: the scheduler then exits with an error.
        self.lost: str | None = None
        self.process: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        # Tokens each stream takes at a time while the API process's pacing holds outputs (``pacing.PacedReading``).
        self._reading = 1

    async def start(self, on_lost: Callable[[], None]) -> tuple[int, int]:
        """Start the API process and wait until it listens; its gRPC and HTTP ports (OSError when it cannot bind)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        listener.listen(1)
        listener.settimeout(ACCEPT_POLL_S)
        c = self.config
        settings = Settings(self.path, self.internal_target, c.host, c.port, c.max_message_bytes, c.stream_interval,
                            c.log_level, c.tls_cert, c.tls_key, c.tls_ca, c.api_key,
                            c.http_port if self.internal_http else 0, self.internal_http,
                            share_of(c.api_process_cpu_share), asdict(c.cors()), asdict(c.chat_parsing()),
                            c.enable_server_load_tracking, c.enable_request_id_headers)
        env = {**os.environ, ENV: json.dumps(asdict(settings))}
        self.process = subprocess.Popen([sys.executable, "-m", "scheduler_svc.api.api_process"], env=env)
        try:
            self.sock = await asyncio.to_thread(self._accept, listener)
        finally:
            listener.close()
        first = await asyncio.to_thread(recv_frame, self.sock)
        if first is None or first[0] != "listening":
            raise OSError(first[1] if first else "the API process ended before it listened")
        self.port = first[1]
        aio_loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, args=(aio_loop, on_lost), name="api-link", daemon=True).start()
        return self.port, first[2]

    def _accept(self, listener: socket.socket) -> socket.socket:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(TimeoutError):
                return listener.accept()[0]
        raise OSError(f"the API process did not start (exit code {self.process.poll()})")

    def send(self, frame: Frame) -> None:
        """From any thread; a link already gone drops it (the reader thread tells of the loss)."""
        data = pack(frame)
        with contextlib.suppress(OSError), self._send_lock:
            self.sock.sendall(data)

    def send_outputs(self, items: list[tuple[int, RequestOutput]]) -> None:
        """One step's outputs of this link's requests (engine loop thread); failures as the public API names them."""
        for _, output in items:
            if output.error is not None:
                output.error = public(output.error)
        self.send(("outputs", encode_outputs(items)))

    def _read(self, aio_loop: asyncio.AbstractEventLoop, on_lost: Callable[[], None]) -> None:
        while (frame := recv_frame(self.sock)) is not None:
            aio_loop.call_soon_threadsafe(self._on_frame, frame)
        aio_loop.call_soon_threadsafe(self._lost, on_lost)

    def _on_frame(self, frame: Frame) -> None:
        kind, key = frame[0], frame[1]
        if kind in ("submit", "submit_step", "submit_vllm"):
            self._pending.add(key)
            asyncio.ensure_future(self._submit(key, kind, frame[2], frame[3]))
        elif kind == "reading":  # a plan computes num_scheduler_steps at most: a change above them changes nothing
            reading = min(frame[1], self.config.num_scheduler_steps)
            if reading != self._reading:
                self._reading = reading
                if self.handles:
                    self.frontend.set_reading(list(self.handles.values()), reading)
        elif kind == "served":
            self._served(key, frame[2])
        elif kind == "beam_start":
            asyncio.ensure_future(self._beam_start(key, frame[2]))
        elif kind == "close":
            if (handle := self.handles.pop(key, None)) is not None:
                self.frontend.forget(handle, cancel=frame[2])
            elif key in self._pending:
                self._closed_early.add(key)

    async def _submit(self, key: int, kind: str, data: bytes, whole: bool) -> None:
        """A nanoserve Generate (``submit``; ``submit_step``: a beam search's step) or a VllmEngine one
        (``submit_vllm``: translated here, and its answer carries what the API process's ``ResponseWriter`` needs)."""
        def submit(request: pb.GenerateRequest, whole: bool) -> Awaitable[RequestHandle]:
            return self.frontend.submit_to(request, whole, lambda interval: RemoteSink(self, key),
                                           continued=kind == "submit_step")

        try:
            if kind != "submit_vllm":
                handle = await submit(pb.GenerateRequest.FromString(data), whole)
            else:
                handle = await submit_generate(self.frontend, vllm.GenerateRequest.FromString(data), submit)
        except RequestFailed as e:
            self.send(("failed", key, public(e)))
            return
        except Exception as e:  # a bug preparing it: its caller is answered, as the engine loop answers its own
            log.exception("preparing a request failed: %s", e)
            self.send(("failed", key, internal_error(e)))
            return
        finally:
            self._pending.discard(key)
        if key in self._closed_early:
            self._closed_early.discard(key)
            self.frontend.forget(handle, cancel=True)
            return
        self.handles[key] = handle
        if self._reading > 1:
            self.frontend.set_reading([handle], self._reading)
        reading = () if kind == "submit" else (ResponseWriter.reading(handle.prepared),)
        prepared = handle.prepared
        prompt_token_ids = prepared.prompt_token_ids if prepared.return_prompt_token_ids else None
        self.send(("accepted", key, prepared.request_id, prepared.params.n, len(prepared.prompt_token_ids),
                   prompt_token_ids, *reading))

    async def _beam_start(self, key: int, data: bytes) -> None:
        try:
            start = await self.frontend.beam_start(pb.GenerateRequest.FromString(data))
        except RequestFailed as e:
            self.send(("failed", key, public(e)))
            return
        except Exception as e:  # a bug preparing it: its caller is answered
            log.exception("preparing a beam search failed: %s", e)
            self.send(("failed", key, internal_error(e)))
            return
        self.send(("accepted", key, start))

    def _served(self, key: int, with_tokenizer: bool) -> None:
        """What the HTTP routes' ``model`` may name now (the base model's names, the adapters loaded) and, when asked,
        the handshake's tokenizer, which the API process's HTTP responses decode logprobs and echoes with."""
        try:
            info = self.frontend.ready().info
        except RequestFailed as e:
            self.send(("failed", key, public(e)))
            return
        tokenizer = ((info.tokenizer_json, info.chat_template, info.bos_token_id, tuple(info.eos_token_ids),
                      info.special_tokens) if with_tokenizer and info.tokenizer_json else None)
        adapters = frozenset(adapter.name for adapter in self.frontend.adapters())
        self.send(("accepted", key, self.frontend.model_names(), adapters, tokenizer))

    def _lost(self, on_lost: Callable[[], None]) -> None:
        """The API process is gone: its requests are cancelled (their callers went with it)."""
        handles, self.handles = self.handles, {}
        for handle in handles.values():
            self.frontend.forget(handle, cancel=True)
        if not self._stopping:
            self.lost = f"the API process ended (exit code {self.process.wait()})"
            log.error("%s; the scheduler stops", self.lost)
            on_lost()

    def yield_cpu(self) -> None:
        self.send(("yield_cpu",))

    def beside_accelerator(self) -> None:
        """The executor is not on the CPU: the API process gives way to the engine loop (``api_process``)."""
        self.send(("beside_accelerator",))

    async def stop(self, grace_s: float) -> None:
        """After the engine loop drained: the API process finishes its streams and ends."""
        self._stopping = True
        if self.process is None:
            return
        self.send(("stop", grace_s))
        try:
            await asyncio.to_thread(self.process.wait, grace_s + 10)
        except subprocess.TimeoutExpired:
            log.warning("the API process did not end; killing it")
            self.process.kill()
            await asyncio.to_thread(self.process.wait)
        if self.sock is not None:
            self.sock.close()


def private_folder() -> str:
    """A folder only this user can open, for the link's and the internal gRPC socket."""
    return tempfile.mkdtemp(prefix="nanoserve-api-")


def remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
