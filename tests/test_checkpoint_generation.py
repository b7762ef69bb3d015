"""generation_config.json's sampling defaults, as vLLM's ``--generation-config auto`` takes them: read by the executor,
handed over in the handshake, used by the scheduler for the fields a request leaves unset (gRPC and HTTP alike), and
left out with ``--generation-config vllm``."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import pytest

from common.sampling import GenerationDefaults
from common.step import ExecutorInfo
from common.step_codec import info_from_proto, info_to_proto
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.hf_folder import generation_defaults
from executor_svc.runtime.model_executor import ModelExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.http import schemas
from scheduler_svc.api.http.translate import Served, chat_request, completion_request
from scheduler_svc.api.prepare import prepare
from scheduler_svc.config import parse_config
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.core.validation import ModelLimits
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.service_fixtures import CHATML_TEMPLATE, byte_level_tokenizer, in_process_scheduler

LIMITS = ModelLimits(vocab_size=512, max_model_len=512, num_blocks=128, block_size=4)
DEFAULTS = {"temperature": 0.5, "top_p": 0.75, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.25, "max_tokens": 10}


def test_the_executor_reads_the_keys_vllm_takes(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    config = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0,
              "repetition_penalty": 1.1, "max_new_tokens": 64}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert generation_defaults(tmp_path) == GenerationDefaults(0.6, 0.95, 20, 0, 1.1, 64)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0}))
    with caplog.at_level(logging.WARNING, "nanoserve.executor"):
        assert generation_defaults(tmp_path) == GenerationDefaults(temperature=0.7)
    assert "top_p 0 is out of range" in caplog.text
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert generation_defaults(tmp_path) is None


def test_the_defaults_come_back_the_same_through_the_handshake_codec():
    info = ExecutorInfo("id", generation_defaults=GenerationDefaults(temperature=0.0, top_k=1, min_p=0.25,
                                                                     max_tokens=300))
    assert info_from_proto(info_to_proto(info)) == info
    assert info_from_proto(info_to_proto(ExecutorInfo("id"))).generation_defaults is None


def test_only_the_fields_a_request_leaves_unset_take_the_models_defaults():
    bare = pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[1, 2, 3]))
    params = prepare(bare, LIMITS, None, DEFAULTS).params
    assert {name: getattr(params, name) for name in DEFAULTS} == DEFAULTS
    assert (prepare(bare, LIMITS, None).params.temperature, prepare(bare, LIMITS, None).params.max_tokens) == (1, 256)
    given = pb.GenerateRequest(tokens=bare.tokens, sampling=pb.SamplingOptions(temperature=1.0, top_k=0, min_p=0),
                               stopping=pb.StoppingOptions(max_tokens=30))
    params = prepare(given, LIMITS, None, DEFAULTS).params
    assert (params.temperature, params.top_k, params.min_p, params.max_tokens, params.top_p) == (1.0, 0, 0, 30, 0.75)
    # HTTP: a completion sends max_tokens 16 when it leaves it out, a chat the room its conversation leaves, which
    # the model's max_tokens caps (as vLLM's does).
    served = Served("m")
    completion, = completion_request(schemas.CompletionRequest(model="m", prompt=[1, 2, 3]), served, None).requests
    params = prepare(completion, LIMITS, None, DEFAULTS).params
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 20, 16)
    tokenizer = ModelTokenizer(byte_level_tokenizer().to_str(), CHATML_TEMPLATE)
    body = schemas.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    chat, = chat_request(body, served).requests
    assert prepare(chat, LIMITS, tokenizer, DEFAULTS).params.max_tokens == 10
    assert prepare(chat, LIMITS, tokenizer).params.max_tokens > 10


def test_the_flag_takes_vllms_values():
    assert parse_config([], env={}).generation_config == "auto"
    assert parse_config(["--generation-config", "vllm"], env={}).generation_config == "vllm"
    with pytest.raises(SystemExit):
        parse_config(["--generation-config", "/some/folder"], env={})


def test_a_model_whose_generation_config_is_greedy_decodes_greedily_unless_generation_config_vllm(
    tiny_model_folders: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
):
    folder = Path(shutil.copytree(tiny_model_folders["llama"], tmp_path / "model"))
    path = folder / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.0, "top_k": 1}))
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(folder), kv_cache_memory=1 << 20, threads=1))
    assert executor.get_info().generation_defaults == GenerationDefaults(temperature=0.0, top_k=1)

    def request(seed: int, **sampling: object) -> pb.GenerateRequest:
        return pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[5, 6, 7, 8]),
                                  sampling=pb.SamplingOptions(seed=seed, **sampling),
                                  stopping=pb.StoppingOptions(max_tokens=12, ignore_eos=True))

    async def completions(generation_config: str) -> list[list[int]]:
        async with in_process_scheduler(executor, generation_config=generation_config) as s:
            requests = [request(1), request(2), request(3, temperature=0.0)]
            return [list((await s.stub.GenerateOnce(r)).token_ids) for r in requests]

    with caplog.at_level(logging.INFO, "nanoserve.scheduler"):
        first, second, greedy = asyncio.run(completions("auto"))
        assert first == second == greedy
        first, second, _ = asyncio.run(completions("vllm"))
        assert first != second
    taken = [r for r in caplog.records if "generation_config.json defaults" in r.getMessage()]
    assert [r.levelname for r in taken] == ["WARNING", "INFO"]
    assert "temperature=0, top_k=1" in taken[0].getMessage() and "ignored" in taken[1].getMessage()
