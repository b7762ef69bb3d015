"""``vllm.grpc.engine.VllmEngine`` (the stubs of the PyPI package smg-grpc-proto), served beside nanoserve.v1 on the
scheduler's gRPC port: the router -> worker protocol of the Shepherd Model Gateway and the gateways that speak it.

It only translates: requests go through ``requests`` into the same ``Frontend`` the other APIs use, outputs come
out through ``responses``, the info RPCs through ``info``. What nanoserve cannot do is refused with a status and a
message naming the field or the RPC (UNIMPLEMENTED: Embed, StartProfile, StopProfile; INVALID_ARGUMENT:
multimodal inputs, KV transfer, a structural tag), and nothing in flight is touched by a refusal.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc
from smg_grpc_proto.generated import common_pb2 as common

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.frontend import Frontend, Generation
from scheduler_svc.api.grpc_status import fail
from scheduler_svc.api.malformed import refuse_malformed
from scheduler_svc.api.vllm_engine import info
from scheduler_svc.api.vllm_engine.requests import generate_request, vllm_error
from scheduler_svc.api.vllm_engine.responses import ResponseWriter
from scheduler_svc.core.errors import InvalidRequest, RequestFailed

T = TypeVar("T")
SERVICE_NAME = vllm.DESCRIPTOR.services_by_name["VllmEngine"].full_name
NOT_SERVED = {
    "Embed": "Embed is not supported: nanoserve serves generative models; use Generate",
    "StartProfile": "profiling is not supported by nanoserve (its executor's timings are in /metrics)",
    "StopProfile": "profiling is not supported by nanoserve (its executor's timings are in /metrics)",
}


async def submit_generate(frontend: Frontend, request: vllm.GenerateRequest,
                          submit: Callable[[pb.GenerateRequest, bool], Awaitable[T]]) -> T:
    """``submit(request as nanoserve's, whole)``; an InvalidRequest names the VllmEngine field (RequestFailed: the
    frontend's other refusals). Generate's own and the API process's (``api.api_link``)."""
    constraint = request.sampling_params.WhichOneof("constraint")
    try:
        return await submit(generate_request(request, frontend.ready().info.max_model_len), not request.stream)
    except InvalidRequest as e:
        raise vllm_error(e, constraint) from None


class VllmEngineServicer(vllm_grpc.VllmEngineServicer):
    """``serving``: what gRPC health says (True: SERVING), for HealthCheck."""

    def __init__(self, frontend: Frontend, serving: Callable[[], bool]) -> None:
        self.frontend = frontend
        self.serving = serving

    async def _ready(self, context: grpc.aio.ServicerContext) -> None:
        try:
            self.frontend.ready()
        except RequestFailed as e:
            await fail(context, e)

    async def _submit(self, request: vllm.GenerateRequest, context: grpc.aio.ServicerContext) -> Generation:
        await refuse_malformed(request, context, "Generate")
        await self._ready(context)
        try:
            return await submit_generate(self.frontend, request, self.frontend.submit)
        except RequestFailed as e:
            await fail(context, e)

    async def Generate(self, request: vllm.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[vllm.GenerateResponse]:
        with await self._submit(request, context) as generation:
            writer = ResponseWriter.of(generation.prepared, request.stream)
            try:
                async for outputs in generation.batches():
                    for response in writer.responses(outputs):
                        yield response
            except RequestFailed as e:
                await fail(context, vllm_error(e) if isinstance(e, InvalidRequest) else e)

    async def Abort(self, request: vllm.AbortRequest, context: grpc.aio.ServicerContext) -> vllm.AbortResponse:
        """Each request found ends with finish_reason "abort"; unknown ids are no error (they may have finished)."""
        await self._ready(context)
        self.frontend.abort(request.request_ids)
        return vllm.AbortResponse()

    async def HealthCheck(self, request: vllm.HealthCheckRequest,
                          context: grpc.aio.ServicerContext) -> vllm.HealthCheckResponse:
        healthy = self.serving()
        message = "serving" if healthy else "not serving: the executor is not ready, or the scheduler is stopping"
        return vllm.HealthCheckResponse(healthy=healthy, message=message)

    async def GetModelInfo(self, request: vllm.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> vllm.GetModelInfoResponse:
        await self._ready(context)
        return info.model_info(self.frontend.ready().info, self.frontend.model_names()[0])

    async def GetServerInfo(self, request: vllm.GetServerInfoRequest,
                            context: grpc.aio.ServicerContext) -> vllm.GetServerInfoResponse:
        await self._ready(context)
        frontend = self.frontend
        return info.server_info(frontend.server_info(), len(frontend.by_request_id), frontend.last_request_at,
                                frontend.reasoning_parser, frontend.thinking is not None)

    async def GetLoads(self, request: vllm.GetLoadsRequest,
                       context: grpc.aio.ServicerContext) -> vllm.GetLoadsResponse:
        await self._ready(context)
        if request.HasField("dp_rank") and request.dp_rank != 0:
            await fail(context, InvalidRequest("dp_rank", f"this engine has one rank, 0; got {request.dp_rank}"))
        return info.loads(self.frontend.server_info())

    async def GetTokenizer(self, request: common.GetTokenizerRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[common.GetTokenizerChunk]:
        """The tokenizer the executor handed over, as a Hugging Face tokenizer folder zipped."""
        await self._ready(context)
        tokenizer = self.frontend.tokenizer
        if tokenizer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this executor handed over no tokenizer; the "
                                                                     "gateway must load one from the model's files")
        files = info.tokenizer_files(self.frontend.ready().info, tokenizer)
        for chunk in await asyncio.to_thread(info.tokenizer_chunks, files):
            yield chunk

    async def SubscribeKvEvents(self, request: common.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext) -> AsyncIterator[common.KvEventBatch]:
        """The prefix cache's events from ``start_sequence_number`` (0: from now), batch by batch, until the caller
        hangs up; a caller that fell too far behind finds a gap in the sequence numbers."""
        await refuse_malformed(request, context, "SubscribeKvEvents")
        await self._ready(context)
        with self.frontend.kv_events(request.start_sequence_number) as reader:
            await context.send_initial_metadata(())  # subscribed: the gateway waits for this to count it connected
            while True:
                for batch in await reader.batches():
                    yield info.kv_event_batch(batch)

    async def FlushCache(self, request: common.FlushCacheRequest,
                         context: grpc.aio.ServicerContext) -> common.FlushCacheResponse:
        """Drop the prefix cache's entries no request holds, now: nothing needs to wait for idle, so timeout_s (the
        wait vLLM allows for it) is accepted and unused; requests in flight keep their blocks and go on."""
        await self._ready(context)
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            await fail(context, InvalidRequest("timeout_s", f"must be a finite number >= 0, got {request.timeout_s}"))
        dropped = await self.frontend.flush_cache()
        return common.FlushCacheResponse(success=True, message=f"dropped {dropped} cached KV blocks; blocks that "
                                                                "requests hold keep their entries")

    async def Embed(self, request: vllm.EmbedRequest, context: grpc.aio.ServicerContext) -> vllm.EmbedResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_SERVED["Embed"])

    async def StartProfile(self, request: common.StartProfileRequest,
                           context: grpc.aio.ServicerContext) -> common.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_SERVED["StartProfile"])

    async def StopProfile(self, request: common.StopProfileRequest,
                          context: grpc.aio.ServicerContext) -> common.ProfileResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_SERVED["StopProfile"])


def add_to_server(frontend: Frontend, serving: Callable[[], bool], server: grpc.aio.Server) -> None:
    vllm_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(frontend, serving), server)
