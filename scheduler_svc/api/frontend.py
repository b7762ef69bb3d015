"""What every public API does around the engine loop, once: the gRPC servicer and the HTTP routes both call it.

A ``GenerateRequest`` goes through ``prepare.prepare`` and ``EngineLoop.submit``; its id is registered for
Abort; its outputs are read batch by batch until each of its n choices finished; a caller that goes
away cancels it (``Generation.close``), so its KV blocks are free before the next step. Failures are
raised as ``RequestFailed``, naming a refused field as GenerateRequest spells it; each API maps them
to its own statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable

from common.step import ExecutorInfo, LoraAdapterInfo
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.codec import model_info, scheduler_stats
from scheduler_svc.api.outbox import ChoicesReader, Outbox
from scheduler_svc.api.prepare import detokenize, prepare, public_error, tokenize
from scheduler_svc.api.server_info import ServerInfo, server_info
from scheduler_svc.api.thinking import ThinkingMarkers
from scheduler_svc.core.beam_search import BeamStart
from scheduler_svc.core.errors import ExecutorUnavailable, InvalidRequest, RequestFailed
from scheduler_svc.core.request import PreparedRequest
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.core.validation import ModelLimits
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.kv_events import KvEventBatch, KvEventLog
from scheduler_svc.engine.loop import EngineLoop, RequestHandle
from scheduler_svc.engine.pause import PauseMode
from scheduler_svc.engine.turn import Turn

log = logging.getLogger("nanoserve.scheduler")


def model_defaults(info: ExecutorInfo, generation_config: str = "auto") -> dict[str, object]:
    """The handshake's request defaults the scheduler uses, by field (none with ``--generation-config vllm``), logged
    once as vLLM logs them."""
    given = info.generation_defaults.given() if info.generation_defaults is not None else {}
    if not given:
        return {}
    named = ", ".join(f"{name}={value:g}" for name, value in given.items())
    if generation_config == "vllm":
        log.info("the model's generation_config.json defaults (%s) are ignored (--generation-config vllm)", named)
        return {}
    log.warning("requests that leave them unset take the model's generation_config.json defaults: %s (start with "
                "--generation-config vllm to ignore them)", named)
    return given


def public(error: RequestFailed) -> RequestFailed:
    """The error as a caller sees it: a refused engine field renamed to its GenerateRequest field."""
    return public_error(error) if isinstance(error, InvalidRequest) else error


class Generation(ChoicesReader):
    """One submitted request: its outputs until every choice finished (``batches``); ``close`` when the caller is
    done. Each piece waits for the engine's turn to end first (``engine.turn``)."""

    def __init__(self, frontend: Frontend, handle: RequestHandle, outbox: Outbox) -> None:
        super().__init__(outbox, handle.prepared.params.n)
        self._frontend = frontend
        self._handle = handle
        self.prepared: PreparedRequest = handle.prepared
        self.request_id = handle.prepared.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prepared.prompt_token_ids)

    @property
    def prompt_token_ids(self) -> list[int] | None:
        """The prompt's token ids where the request asked for them (``return_prompt_token_ids``), else None."""
        return self.prepared.prompt_token_ids if self.prepared.return_prompt_token_ids else None

    def give_way(self) -> None:
        self._frontend.turn.give_way()

    def failure(self, error: Exception) -> Exception:
        return public(error)

    def close(self) -> None:
        """Forget the request's id; one not finished (the caller went away, or it failed) is cancelled."""
        self._frontend.forget(self._handle, cancel=bool(self.remaining))

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class KvEventReader:
    """One subscriber of the prefix cache's events on the event loop: ``batches`` waits for the next ones."""

    def __init__(self, events: KvEventLog, start_sequence_number: int) -> None:
        aio_loop, self._woken = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the event loop closed: nobody reads any more
                aio_loop.call_soon_threadsafe(self._woken.set)

        self._events = events
        self._subscription = events.subscribe(wake, start_sequence_number)

    @staticmethod
    def listen(engine: Engine) -> None:
        """On the loop thread: the block manager records its events from now on."""
        engine.block_manager.listen()

    async def batches(self) -> list[KvEventBatch]:
        while not (batches := self._subscription.take()):
            await self._woken.wait()
            self._woken.clear()
        return batches

    def close(self) -> None:
        self._events.unsubscribe(self._subscription)

    def __enter__(self) -> KvEventReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Frontend:
    """Refuses with ExecutorUnavailable until ``attach`` hands it the engine loop after the executor handshake.

    Event-loop thread only, like the engine loop's ``submit`` callers. ``turn``: the executor stream's
    (``engine.turn``), which every reader gives way to.
    """

    def __init__(self, executor_target: str, stream_interval: int = 1, turn: Turn | None = None,
                 served_model_names: tuple[str, ...] = ()) -> None:
        self.executor_target = executor_target
        # --served-model-name (``model_names``).
        self.served_model_names = served_model_names
        self.stream_interval = stream_interval
        self.turn = turn or Turn()
        self.loop: EngineLoop | None = None
        self.tokenizer: ModelTokenizer | None = None
        # The model's request defaults in use (``model_defaults``), by field.
        self.model_defaults: dict[str, object] = {}
        # --reasoning-parser's markers in the model's vocabulary: a grammar waits for the thinking's end.
        self.thinking: ThinkingMarkers | None = None
        self.reasoning_parser = ""
        # Requests in flight by the id the caller gave (or was given), for Abort.
        self.by_request_id: dict[str, set[RequestHandle]] = {}
        # Ids Abort named, while requests under them are still held: a beam search's next step submitted under such an
        # id ends at once (``continued``), so that an abort between two steps holds.
        self.aborted: set[str] = set()
        # When the scheduler started, and when the last request arrived (time.time), for GetServerInfo.
        self.started_at = time.time()
        self.last_request_at = 0.0

    def attach(self, loop: EngineLoop, tokenizer: ModelTokenizer | None, generation_config: str = "auto",
               reasoning_parser: str = "") -> None:
        self.loop, self.tokenizer = loop, tokenizer
        self.model_defaults = model_defaults(loop.info, generation_config)
        self.reasoning_parser, self.thinking = reasoning_parser, ThinkingMarkers.of(tokenizer, reasoning_parser)
        if reasoning_parser and self.thinking is None:
            log.warning("--reasoning-parser %s: the model's vocabulary has no <think> and </think> tokens, so "
                        "structured output applies from the first token", reasoning_parser)

    def ready(self) -> EngineLoop:
        if self.loop is None:
            raise ExecutorUnavailable(f"the scheduler is still connecting to the executor at {self.executor_target}")
        return self.loop

    async def render(self, request: pb.GenerateRequest) -> PreparedRequest:
        """What ``submit`` would queue for ``request``, checked the same way (InvalidRequest), without running it."""
        loop = self.ready()
        return await asyncio.to_thread(prepare, request, ModelLimits.of(loop.info), self.tokenizer, self.model_defaults,
                                       self.thinking)

    async def beam_start(self, request: pb.GenerateRequest) -> BeamStart:
        """What a beam search makes of ``request`` before its first step, checked as ``render`` checks it."""
        prepared = await self.render(request)
        params = prepared.params
        eos = frozenset() if params.ignore_eos else frozenset(self.ready().info.eos_token_ids)
        return BeamStart(prepared.prompt_token_ids, params.max_tokens, eos, params.stop_token_ids, params.min_tokens)

    async def submit(self, request: pb.GenerateRequest, whole: bool = False, continued: bool = False) -> Generation:
        """Validate (off the event loop: tokenizing and templating take time) and queue ``request``; its latency
        metrics count from now, as vLLM's count from a request's arrival. ``whole``: the caller reads each choice
        only once it ended, so its outputs wait for that. ``continued``: a beam search's step, which an abort of its
        id before it came ends at once."""
        handle = await self.submit_to(request, whole, Outbox, continued)
        return Generation(self, handle, handle.sink)

    async def submit_to(self, request: pb.GenerateRequest, whole: bool, sink_of: Callable[[float], object],
                        continued: bool = False) -> RequestHandle:
        """``submit`` for any reader: ``sink_of(tokens a read takes)`` is what the engine loop's ``deliver`` hands the
        request's outputs to (an ``Outbox``, or the API process's link). Forget the handle with ``forget``."""
        arrived_at, self.last_request_at = time.monotonic(), time.time()
        loop = self.ready()
        prepared = await asyncio.to_thread(prepare, request, ModelLimits.of(loop.info), self.tokenizer,
                                           self.model_defaults, self.thinking)
        interval = math.inf if whole else prepared.stream_interval or self.stream_interval
        handle = loop.submit(prepared, sink_of(interval), arrived_at, interval)
        self.by_request_id.setdefault(prepared.request_id, set()).add(handle)
        if continued and prepared.request_id in self.aborted:
            loop.cancel(handle, answer=True)
        return handle

    def forget(self, handle: RequestHandle, cancel: bool) -> None:
        """Forget the request's id; ``cancel``: it did not finish (its caller went away, or it failed)."""
        handles = self.by_request_id[handle.prepared.request_id]
        handles.discard(handle)
        if not handles:
            del self.by_request_id[handle.prepared.request_id]
            self.aborted.discard(handle.prepared.request_id)
        if cancel:
            self.ready().cancel(handle)

    def set_reading(self, handles: list[RequestHandle], tokens: float) -> None:
        """``EngineLoop.set_reading``: these requests' readers take ``tokens`` at a time."""
        self.ready().set_reading(handles, tokens)

    def abort(self, request_ids: Iterable[str]) -> list[str]:
        """End each request found with ABORT; its blocks are free before the next step. Returns the ids found."""
        loop = self.ready()
        found = [request_id for request_id in dict.fromkeys(request_ids) if request_id in self.by_request_id]
        self.aborted.update(found)
        for request_id in found:
            for handle in self.by_request_id[request_id]:
                loop.cancel(handle, answer=True)
        return found

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        loop = self.ready()
        token_ids = await asyncio.to_thread(tokenize, request, self.tokenizer)
        return pb.TokenizeResponse(token_ids=token_ids, count=len(token_ids), max_model_len=loop.info.max_model_len)

    def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        loop = self.ready()
        return pb.DetokenizeResponse(text=detokenize(request, self.tokenizer, loop.info.vocab_size))

    def model_info(self) -> pb.ModelInfo:
        return model_info(self.ready().info, self.tokenizer, self.adapters())

    def model_names(self, info: ExecutorInfo | None = None) -> tuple[str, ...]:
        """The names a request's ``model`` may give the base model, the first its id in every answer: vLLM's
        --served-model-name, else the model id of the executor (``info``, or the one attached)."""
        return self.served_model_names or ((info or self.ready().info).model_id,)

    def adapters(self) -> list[LoraAdapterInfo]:
        """The LoRA adapters requests may name now, by name (a copy of the loop thread's map)."""
        return sorted(dict(self.ready().engine.adapters.by_name).values(), key=lambda adapter: adapter.name)

    async def load_lora(self, name: str, path: str, inplace: bool = False) -> LoraAdapterInfo:
        """Have the executor load an adapter (``inplace``: replacing the one of that name), between steps; LoraRefused
        with the reason if not."""
        call = self.ready().call(lambda engine: engine.load_lora(name, path, inplace))
        return await asyncio.wrap_future(call)

    async def unload_lora(self, name: str) -> LoraAdapterInfo:
        """Unload an adapter, between steps: refused to new requests at once, its weights dropped once the requests
        already through it finish; LoraRefused if none is served under ``name``."""
        return await asyncio.wrap_future(self.ready().call(lambda engine: engine.unload_lora(name)))

    def stats(self) -> pb.SchedulerStats:
        return scheduler_stats(self.ready().stats)

    def server_info(self) -> ServerInfo:
        num_requests = sum(len(handles) for handles in self.by_request_id.values())
        return server_info(self.ready(), self.started_at, num_requests, self.model_names()[0])

    async def flush_cache(self) -> int:
        """Drop the prefix cache's entries no request holds, before the next step; the number of blocks dropped."""
        return await asyncio.wrap_future(self.ready().call(lambda engine: engine.block_manager.flush()))

    async def reset_prefix_cache(self) -> bool:
        """vLLM's reset: ``flush_cache``, then whether nothing is cached any more (False while requests in flight
        hold named blocks, as vLLM's reset fails while blocks are held)."""
        def reset(engine: Engine) -> bool:
            engine.block_manager.flush()
            return engine.block_manager.num_cached_blocks == 0

        return await asyncio.wrap_future(self.ready().call(reset))

    async def pause(self, mode: PauseMode, clear_cache: bool) -> None:
        """``EngineLoop.pause``: returns once paused and (unless ``keep``) idle."""
        await asyncio.wrap_future(self.ready().pause(mode, clear_cache))

    async def resume(self) -> None:
        await asyncio.wrap_future(self.ready().resume())

    def is_paused(self) -> bool:
        return self.ready().paused

    def kv_events(self, start_sequence_number: int = 0) -> KvEventReader:
        """A reader of the prefix cache's event batches from ``start_sequence_number`` on (0: from now), subscribed
        now; the block manager records from the next step. Close it when done (``with``)."""
        loop = self.ready()
        loop.call(KvEventReader.listen)
        return KvEventReader(loop.engine.kv_events, start_sequence_number)
