"""A Hugging Face folder's tokenizer files as transformers and vLLM read them: the default of a list of chat templates,
the tokenizer's own special tokens (in the template and as an EOS id), transformers' template helpers, and a template
that does not compile refusing chat requests only."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from datetime import datetime
from pathlib import Path

import grpc
import pytest

from common.step import ExecutorInfo, SpecialTokens
from executor_svc.fakes.shadow import ShadowExecutor
from executor_svc.runtime.config import ExecutorOptions, ModelConfig
from executor_svc.runtime.hf_folder import read_chat_template, read_tokenizer_json, special_tokens
from executor_svc.runtime.model_executor import ModelExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.tokenizer import ChatMessage, ModelTokenizer
from tests.model_fixtures import tiny_model_folders  # noqa: F401
from tests.service_fixtures import (
    CHATML_TEMPLATE,
    EOS_ID,
    TOKENIZER_VOCAB_SIZE,
    byte_level_tokenizer,
    in_process_scheduler,
)

# The byte-level tokenizer's special tokens: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2.
TOKENIZER_JSON = byte_level_tokenizer().to_str()
NAMED_TEMPLATES = [{"name": "default", "template": CHATML_TEMPLATE}, {"name": "tool_use", "template": "{{ tools }}"}]
SPECIALS = "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}"
USER = [ChatMessage("user", "hi")]


def with_tokenizer(folder: Path, config: dict) -> Path:
    (folder / "tokenizer.json").write_text(TOKENIZER_JSON)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_a_list_of_named_chat_templates_gives_the_default_one(tmp_path: Path):
    with_tokenizer(tmp_path, {"chat_template": NAMED_TEMPLATES})
    assert read_chat_template(tmp_path) == CHATML_TEMPLATE


def test_the_tokenizers_own_eos_is_an_eos_id(tiny_model_folders: dict[str, Path], tmp_path: Path):  # noqa: F811
    folder = Path(shutil.copytree(tiny_model_folders["llama"], tmp_path / "model"))
    assert ModelConfig.from_folder(folder).eos_token_ids == (2,)  # generation_config.json and config.json's
    with_tokenizer(folder, {"eos_token": "<|endoftext|>"})
    assert ModelConfig.from_folder(folder).eos_token_ids == (2, 0)


def test_the_handshake_carries_the_tokenizers_special_tokens_and_default_template(
    tiny_model_folders: dict[str, Path], tmp_path: Path  # noqa: F811
):
    folder = Path(shutil.copytree(tiny_model_folders["llama"], tmp_path / "model"))
    with_tokenizer(folder, {"bos_token": None, "eos_token": "<|endoftext|>", "chat_template": NAMED_TEMPLATES,
                            "pad_token": {"content": "<|im_end|>", "special": True}})
    info = ModelExecutor(ExecutorOptions(dtype="float32", model=str(folder), kv_cache_memory=1 << 20,
                                         threads=1)).get_info()
    assert info.special_tokens == SpecialTokens(None, "<|endoftext|>", "<|im_end|>", None)
    assert (info.eos_token_ids, info.bos_token_id, info.chat_template) == ((2, 0), 1, CHATML_TEMPLATE)


def test_special_tokens_missing_from_tokenizer_config_come_from_the_map_then_the_config_ids(tmp_path: Path):
    with_tokenizer(tmp_path, {"pad_token": None})
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "<|im_start|>"}}))
    ids = {"bos_token": 0, "eos_token": 2}
    assert special_tokens(tmp_path, TOKENIZER_JSON, ids) == SpecialTokens("<|im_start|>", "<|im_end|>", None, None)
    (tmp_path / "special_tokens_map.json").unlink()
    (tmp_path / "tokenizer_config.json").unlink()
    assert special_tokens(tmp_path, TOKENIZER_JSON, ids) is None, "no file: the scheduler renders the ids' tokens"


def test_the_template_renders_the_tokenizers_special_tokens_not_the_config_ids():
    # DeepSeek-R1-Distill-Qwen's config.json names its end-of-sentence token as bos_token_id.
    info = ExecutorInfo(eos_token_ids=(2,), bos_token_id=0, tokenizer_json=TOKENIZER_JSON, chat_template=SPECIALS,
                        special_tokens=SpecialTokens("<|im_start|>", "<|endoftext|>", "<|im_end|>"))
    assert ModelTokenizer.from_info(info).render_chat(USER) == "<|im_start|>|<|endoftext|>|<|im_end|>|"
    # An executor that sends no special tokens: the tokens of its ids, as before.
    older = ExecutorInfo(eos_token_ids=(2,), bos_token_id=0, tokenizer_json=TOKENIZER_JSON, chat_template=SPECIALS)
    assert ModelTokenizer.from_info(older).render_chat(USER) == "<|endoftext|>|<|im_end|>||"


def test_transformers_template_helpers_render():
    template = ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
                "{{ {'b': 'é', 'a': 1} | tojson(ensure_ascii=True, separators=(',', ':'), sort_keys=True) }}"
                "{{ strftime_now('%Y') }}")
    tokenizer = ModelTokenizer(TOKENIZER_JSON, template)
    year = datetime.now().year
    rendered = tokenizer.render_chat(USER)
    assert rendered in {'{"a":1,"b":"\\u00e9"}'.join(["hi", str(y)]) for y in (year, datetime.now().year)}


def test_a_template_that_does_not_compile_refuses_chat_requests_only(caplog: pytest.LogCaptureFixture):
    executor = ShadowExecutor(num_blocks=64, block_size=4, vocab_size=TOKENIZER_VOCAB_SIZE, eos_token_ids=(EOS_ID,),
                              max_model_len=128, tokenizer_json=TOKENIZER_JSON, chat_template="{% for %}")
    assert ModelTokenizer.from_info(executor.get_info()).template_error  # raised in the handshake before
    caplog.clear()

    async def run() -> tuple[grpc.StatusCode, str, pb.GenerateResponse]:
        async with in_process_scheduler(executor) as s:
            chat = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="hi")]))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await s.stub.GenerateOnce(chat)
            text = pb.GenerateRequest(text="Hello", stopping=pb.StoppingOptions(max_tokens=2))
            text = await s.stub.GenerateOnce(text)
            return refused.value.code(), refused.value.details(), text

    with caplog.at_level(logging.ERROR, "nanoserve.scheduler"):
        code, details, text = asyncio.run(run())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat: the model's chat template does not compile (line 1: " in details
    assert len(text.token_ids) == 2
    logged = [r.getMessage() for r in caplog.records if "chat template does not compile" in r.getMessage()]
    assert len(logged) == 1 and "chat requests will be refused" in logged[0]


def test_the_refusal_names_the_templates_problem():
    tokenizer = ModelTokenizer(TOKENIZER_JSON, "{% if x %}never closed")
    assert tokenizer.encode("Hello")
    with pytest.raises(InvalidRequest, match=r"does not compile \(line 1: Unexpected end of template"):
        tokenizer.render_chat(USER)


@pytest.mark.parametrize("sentencepiece", [False, True], ids=["nothing", "tokenizer.model"])
def test_a_folder_without_tokenizer_json_warns_that_text_and_chat_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, sentencepiece: bool
):
    if sentencepiece:
        (tmp_path / "tokenizer.model").write_bytes(b"sentencepiece")
    with caplog.at_level(logging.WARNING, "nanoserve.executor"):
        assert read_tokenizer_json(tmp_path) == ""
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "no tokenizer.json" in warning and "Text and chat requests will be refused" in warning
    assert ("tokenizer.model is not converted (that is not supported)" in warning) == sentencepiece
