"""The admin switch of the recording (docs/replay.md): ``RecordingControl`` starts, stops and reads it for the gRPC
``Recording`` service here and the HTTP routes (``api.http.admin``), which only translate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict

import grpc

from nanoserve.v1 import recording_pb2 as rpb
from nanoserve.v1 import recording_pb2_grpc as rpb_grpc
from scheduler_svc.engine.loop import EngineLoop
from scheduler_svc.engine.recorder import Recorder, RecordingStatus, RecordingUnavailable

SERVICE_NAME = rpb.DESCRIPTOR.services_by_name["Recording"].full_name
# How long a start waits for the session to begin (the engine loop resets the executor at its next turn).
START_WAIT_S = 5.0
POLL_S = 0.01


class RecordingControl:
    """The scheduler's ``Recorder`` (None without --record) and the engine loop, once it runs."""

    def __init__(self, recorder: Recorder | None, loop: Callable[[], EngineLoop | None]) -> None:
        self.recorder = recorder
        self.loop = loop

    def _recorder(self) -> Recorder:
        if self.recorder is None:
            raise RecordingUnavailable("this scheduler was started without --record DIR: there is nowhere to record "
                                       "to")
        return self.recorder

    async def start(self) -> RecordingStatus:
        """Start a session; it begins once the engine loop has reset the executor (waited for a few seconds: longer
        while the executor is down, and the status then says ``starting``)."""
        recorder = self._recorder()
        loop = self.loop()
        if recorder.start() and loop is not None:
            loop.resync()
        deadline = time.monotonic() + START_WAIT_S
        while recorder.pending and loop is not None and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        return recorder.status()

    async def stop(self) -> RecordingStatus:
        recorder = self._recorder()
        await asyncio.to_thread(recorder.stop)  # waits for the writer to empty its queue
        return recorder.status()

    def status(self) -> RecordingStatus:
        return self._recorder().status()


def to_proto(status: RecordingStatus) -> rpb.RecordingStatus:
    return rpb.RecordingStatus(**asdict(status))


class RecordingServicer(rpb_grpc.RecordingServicer):
    def __init__(self, control: RecordingControl) -> None:
        self.control = control

    async def _answer(self, context: grpc.aio.ServicerContext, work) -> rpb.RecordingStatus:
        try:
            return to_proto(await work())
        except RecordingUnavailable as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    async def StartRecording(self, request: rpb.StartRecordingRequest,
                             context: grpc.aio.ServicerContext) -> rpb.RecordingStatus:
        return await self._answer(context, self.control.start)

    async def StopRecording(self, request: rpb.StopRecordingRequest,
                            context: grpc.aio.ServicerContext) -> rpb.RecordingStatus:
        return await self._answer(context, self.control.stop)

    async def GetRecording(self, request: rpb.GetRecordingRequest,
                           context: grpc.aio.ServicerContext) -> rpb.RecordingStatus:
        async def status() -> RecordingStatus:
            return self.control.status()

        return await self._answer(context, status)
