"""Structured output behind ``--reasoning-parser``, as vLLM gates it: the scheduler tells the executor to wait for the
thinking's end unless the prompt closed it (read back to the turn's start for ``qwen3``), the chat prompt turned the
thinking off, or the request asks for the grammar from its first token; the executor masks nothing before that end,
follows the tokens after ``</think>``, and a request that comes back finds where its grammar started in its
completion. The HTTP side: ``test_http_reasoning``."""

from __future__ import annotations

import math
import re
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf import struct_pb2
from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc

from client.cli import build_parser, generation_options
from client.request_builder import build_request
from common.step import SamplingSettings
from common.step_codec import sampling_from_proto, sampling_to_proto
from executor_svc.core.request_table import RequestState
from executor_svc.sample.constraints import GrammarConstraints
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.prepare import prepare
from scheduler_svc.api.thinking import ThinkingMarkers
from scheduler_svc.core.tokenizer import ModelTokenizer
from scheduler_svc.core.validation import ModelLimits
from tests.http_fixtures import hosted
from tests.service_fixtures import CHATML_TEMPLATE, EOS_ID, HOST, byte_level_tokenizer
from tests.test_http_reasoning import WAITS, RecordingEcho, waits
from tests.test_http_tools import TOKENIZER

VOCAB = TOKENIZER.get_vocab_size()
LIMITS = ModelLimits(vocab_size=VOCAB, max_model_len=256, num_blocks=64, block_size=16)
REGEX = "[ab]{1,3}"
MODEL = ModelTokenizer(TOKENIZER.to_str(), CHATML_TEMPLATE, eos_token_ids=(EOS_ID,))
START, END, CALL, TURN = (TOKENIZER.token_to_id(t) for t in ("<think>", "</think>", "<tool_call>", "<|im_start|>"))


def ids(text: str) -> list[int]:
    return MODEL.encode(text, add_special_tokens=False)


def settings(request: pb.GenerateRequest, parser: str = "qwen3", model: ModelTokenizer = MODEL) -> SamplingSettings:
    return prepare(request, LIMITS, model, thinking=ThinkingMarkers.of(model, parser)).params.settings


def gate(prompt: list[int], parser: str = "qwen3", **structured: object) -> tuple[int, ...]:
    request = pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=prompt),
                                 structured_output=pb.StructuredOutput(regex=REGEX, **structured))
    return waits(settings(request, parser))


def test_the_grammar_waits_for_the_thinking_unless_the_prompt_or_the_request_says_it_ended():
    hello, none = ids("Hello"), ()
    assert gate(hello) == WAITS == (END,)
    assert gate(hello, "deepseek_r1") == WAITS
    assert gate([*hello, START]) == WAITS, "a template that opens the thinking (DeepSeek-R1's)"
    assert gate([*hello, START, *ids("\n\n"), END, *ids("\n\n")]) == none, "closed in the prompt (thinking off)"
    assert gate([*hello, START, END, START]) == WAITS, "the last marker counts"
    earlier = [TURN, *ids("assistant"), START, END, *ids("Hi"), TURN, *ids("assistant")]
    assert gate(earlier) == WAITS, "qwen3: an earlier turn's </think> is not this turn's"
    assert gate(earlier, "deepseek_r1") == none, "deepseek_r1 reads the prompt back to its last marker, as vLLM's"
    assert gate([*hello, CALL]) == none, "a <tool_call> in the prompt ends Qwen3's thinking, as vLLM reads it"
    assert gate([*hello, CALL], "deepseek_r1") == WAITS
    assert gate(hello, from_first_token=True) == none, "vLLM's reasoning_ended"
    assert gate(hello, parser="") == none, "no --reasoning-parser: no wait"
    plain = ModelTokenizer(byte_level_tokenizer().to_str(), eos_token_ids=(EOS_ID,))
    assert ThinkingMarkers.of(plain, "qwen3") is None, "a vocabulary without the markers: nothing to wait for"
    assert waits(settings(pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=hello)))) == none, "no grammar"


def test_a_chat_prompt_with_thinking_off_starts_the_grammar_at_once():
    def chat(enable_thinking: bool | None, parser: str = "qwen3", model: ModelTokenizer = MODEL) -> tuple[int, ...]:
        kwargs = struct_pb2.Struct()
        if enable_thinking is not None:
            kwargs.update({"enable_thinking": enable_thinking})
        request = pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content="Hi")],
                                                        template_kwargs=kwargs),
                                     structured_output=pb.StructuredOutput(json_object=True))
        return waits(settings(request, parser, model))

    assert chat(None) == WAITS
    assert chat(True) == WAITS
    assert chat(False) == (), "Qwen3's switch (its template writes the thought closed, too)"
    bare = ModelTokenizer(TOKENIZER.to_str(), CHATML_TEMPLATE.replace("<think>\n\n</think>\n\n", ""),
                          eos_token_ids=(EOS_ID,))
    assert chat(False, model=bare) == (), "the switch alone, where the template writes no empty thought"
    assert chat(False, "deepseek_r1", bare) == WAITS, "DeepSeek-R1's thinking has no switch"


def test_the_wait_crosses_the_wire():
    waiting = SamplingSettings(grammar="{}", grammar_after_token_ids=(7, 9))
    assert sampling_from_proto(sampling_to_proto(waiting)) == waiting
    assert sampling_from_proto(sampling_to_proto(SamplingSettings(grammar="{}"))).grammar_after_token_ids == ()


def allowed(logits: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(logits.tolist()) if not math.isinf(x)}


def test_the_executor_masks_nothing_before_the_end_of_thinking_and_follows_the_grammar_after(tmp_path: Path):
    path = tmp_path / "tokenizer.json"
    path.write_text(TOKENIZER.to_str())
    constraints = GrammarConstraints(path, VOCAB, [EOS_ID])
    request = pb.GenerateRequest(text="Hello", structured_output=pb.StructuredOutput(regex=REGEX))
    waiting = settings(request)
    prompt = ids("Hello")
    a, b, x = (ids(t)[0] for t in ("a", "b", "x"))
    everything = set(range(VOCAB))
    letters = {i for i in everything if re.fullmatch(REGEX, MODEL.decode([i]))}
    thinking = RequestState(0, list(prompt), [], 0, waiting, len(prompt))
    # Came back after preemption: thought "x", ended it, then wrote "a": "b" or EOS may follow, and "a" once more.
    back = RequestState(1, [*prompt, x, END, a], [], 0, waiting, len(prompt))
    still = RequestState(2, [*prompt, x, x], [], 0, waiting, len(prompt))
    called = RequestState(3, list(prompt), [], 0, waiting, len(prompt))
    states = [thinking, back, still, called]
    logits = torch.zeros(4, VOCAB)
    rows = constraints.mask(logits, states)
    assert rows == [0, 1, 2, 3]
    assert [allowed(row) for row in logits] == [everything, {a, b, EOS_ID}, everything, everything]
    constraints.advance(states, rows, [x, b, END, CALL])  # thinks on; writes; ends its thinking; calls a tool
    logits = torch.zeros(4, VOCAB)
    constraints.mask(logits, states)
    assert [allowed(row) for row in logits] == [everything, {a, b, EOS_ID}, letters, everything], \
        "the grammar follows the tokens after </think>; a <tool_call> in the thinking does not start it"
    constraints.advance(states, rows, [END, a, a, END])
    logits = torch.zeros(4, VOCAB)
    constraints.mask(logits, states)
    assert allowed(logits[0]) == letters
    assert allowed(logits[1]) == {EOS_ID}, "'aba': the grammar is complete"
    assert allowed(logits[2]) == {a, b, EOS_ID}
    assert allowed(logits[3]) == letters, "the </think> after the call starts it"


@pytest.mark.parametrize("parser", ["qwen3", ""])
def test_vllm_engine_says_where_its_grammar_starts_and_takes_the_gateways_word(parser: str):
    """GetServerInfo's constrained_decoding_start and engine_reasoning_parser, which the gateway shapes forced tool
    calls by; grammar_from_first_token (the gateway led the grammar with the thought) starts it at once."""
    executor = RecordingEcho()
    with hosted(executor, reasoning_parser=parser) as h, grpc.insecure_channel(f"{HOST}:{h.server.port}") as channel:
        engine = vllm_grpc.VllmEngineStub(channel)
        server = engine.GetServerInfo(vllm.GetServerInfoRequest())
        assert (server.engine_reasoning_parser, server.constrained_decoding_start) == (
            parser, "after_reasoning" if parser else "first_token")
        for first in (False, True):
            params = vllm.SamplingParams(temperature=0, max_tokens=3, regex=REGEX, grammar_from_first_token=first)
            list(engine.Generate(vllm.GenerateRequest(tokenized=vllm.TokenizedInput(input_ids=ids("Hello")),
                                                      sampling_params=params)))
            assert waits(executor.sampling[-1]) == (WAITS if parser and not first else ())
        h.assert_idle()


def test_the_client_and_its_cli_ask_for_the_grammar_from_the_first_token():
    request = build_request(token_ids=ids("Hello"), regex=REGEX, grammar_from_first_token=True)
    assert request.structured_output.from_first_token
    assert waits(settings(request)) == ()
    assert waits(settings(build_request(token_ids=ids("Hello"), regex=REGEX))) == WAITS
    with pytest.raises(ValueError, match="grammar_from_first_token"):
        build_request(token_ids=ids("Hello"), grammar_from_first_token=True)
    args = build_parser().parse_args(["generate", "--regex", REGEX, "--grammar-from-first-token", "Hi"])
    assert build_request("Hi", **generation_options(args)).structured_output.from_first_token
