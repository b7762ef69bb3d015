"""Structured output across an executor killed with SIGKILL mid-generation: the restarted executor rebuilds each
grammar's state from the tokens so far, so every completion still validates (the real model, real processes)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import jsonschema
from grpc_health.v1 import health_pb2

from nanoserve.v1 import generation_pb2 as pb
from nanoserve.v1 import generation_pb2_grpc as pb_grpc
from tests.service_fixtures import HOST, assert_idle, free_port, running_stack, spawn, wait_health, wait_serving

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "pets": {"type": "array", "maxItems": 3, "items": {"type": "string",
                                                                                             "maxLength": 8}}},
          "required": ["name", "age", "pets"], "additionalProperties": False}


def model_executor(port: int) -> list[str]:
    return [sys.executable, "-m", "executor_svc", "--host", HOST, "--port", str(port), "--kv-cache-memory", "64M",
            "--threads", "1"]


def request(seed: int) -> pb.GenerateRequest:
    constraint = pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    sampling = pb.SamplingOptions(temperature=1.0, seed=seed)
    return pb.GenerateRequest(text="Describe a person as JSON:", sampling=sampling,
                              stopping=pb.StoppingOptions(max_tokens=96), structured_output=constraint)


def test_json_outputs_validate_across_an_executor_kill(tmp_path: Path) -> None:
    port = free_port()
    with running_stack(model_executor(port), tmp_path, executor_port=port) as s:
        restarted = []

        def kill_and_restart() -> None:
            s.executor.kill()
            s.executor.wait()
            assert wait_health(s.target, s.scheduler, (NOT_SERVING,)) == NOT_SERVING
            restarted.append(spawn(model_executor(port), tmp_path / "executor-restarted.log"))
            wait_serving(s.target, s.scheduler)

        async def run() -> tuple[list[str], int]:
            async with grpc.aio.insecure_channel(s.target) as channel:
                stub = pb_grpc.GenerationStub(channel)
                calls = [stub.Generate(request(seed)) for seed in range(4)]
                firsts = [await call.read() for call in calls]
                unfinished = sum(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in firsts)
                await asyncio.to_thread(kill_and_restart)
                texts = []
                for call, first in zip(calls, firsts, strict=True):
                    text = first.text
                    while (response := await call.read()) != grpc.aio.EOF:
                        text += response.text
                    texts.append(text)
                return texts, unfinished

        try:
            texts, unfinished = asyncio.run(run())
            assert unfinished > 0, "every completion finished before the kill"
            for text in texts:
                jsonschema.validate(json.loads(text), SCHEMA)
            assert_idle(s.stub)
            assert "resume by recompute" in s.logs()
        finally:
            for process in restarted:
                process.kill()
                process.wait()
