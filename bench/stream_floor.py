"""The floor under W5's ``api`` peer: gRPC Python streaming one token per stream per step, and nothing else.

``python -m bench.stream_floor --port P --step-ms S`` serves the public ``Generation`` service's ``Generate`` and
``GetStats`` only. A producer thread stands in for the scheduler's engine loop with no engine in it: every
``--step-ms`` (or, when it got the GIL late, as soon as it has it) it hands one token to every open stream through
the event loop, as the scheduler's loop hands over a step's outputs, and counts the step in
``GetStats.num_steps``. Each stream yields its tokens as ``GenerateResponse`` messages until ``max_tokens``. What
this process spends per step is what serving the streams costs any Python process, whatever runs beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc

FINISH_LENGTH = pb.FinishReason.Value("FINISH_REASON_LENGTH")


class StreamFloor(pb_grpc.GenerationServicer):
    """Open streams, each an asyncio queue the producer thread puts a token into every step."""

    def __init__(self, aio_loop: asyncio.AbstractEventLoop, step_s: float) -> None:
        self.aio_loop = aio_loop
        self.step_s = step_s
        self.streams: set[asyncio.Queue[int]] = set()
        self.num_steps = 0
        threading.Thread(target=self._produce, name="floor-producer", daemon=True).start()

    def _produce(self) -> None:
        deadline = time.perf_counter()
        while True:
            deadline = max(deadline + self.step_s, time.perf_counter())
            time.sleep(max(0.0, deadline - time.perf_counter()))
            self.aio_loop.call_soon_threadsafe(self._dispatch)

    def _dispatch(self) -> None:
        if self.streams:
            self.num_steps += 1
        for queue in self.streams:
            queue.put_nowait(self.num_steps)

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        self.streams.add(queue)
        try:
            left = request.stopping.max_tokens
            while left > 0:
                token_ids = [await queue.get()]
                while not queue.empty() and len(token_ids) < left:  # a slow reader gets fewer, larger messages
                    token_ids.append(queue.get_nowait())
                left -= len(token_ids)
                response = pb.GenerateResponse(request_id=request.request_id, token_ids=token_ids)
                if left == 0:
                    response.finish_reason = FINISH_LENGTH
                    response.usage.completion_tokens = request.stopping.max_tokens
                yield response
        finally:
            self.streams.discard(queue)

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.SchedulerStats:
        return pb.SchedulerStats(num_running=len(self.streams), num_steps=self.num_steps)


async def serve(host: str, port: int, step_ms: float) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(StreamFloor(asyncio.get_running_loop(), step_ms / 1e3), server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.stream_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, required=True, help="port to bind")
    parser.add_argument("--step-ms", type=float, default=5.0, help="milliseconds per step (default: %(default)s)")
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port, args.step_ms))


if __name__ == "__main__":
    main()
