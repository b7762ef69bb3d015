"""vLLM's ``logprob_token_ids``: each sampled token's alternatives are the logprobs of the tokens a request names (a
fixed label set), in its order, instead of the most likely; the other rows of the batch keep their top n. The ids
cross the step contract, are checked where the request enters and where the plan arrives, and reach chat,
completions, the client and the CLI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from client.request_builder import build_request
from common.step import SamplingSettings
from common.step_codec import sampling_from_proto, sampling_to_proto
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.sample.sampler import Sampler
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.prepare import prepare
from scheduler_svc.core.errors import InvalidRequest
from tests.http_fixtures import Hosted, hosted, hosted_smollm2
from tests.model_fixtures import smollm2_folder, tiny_model_folders  # noqa: F401
from tests.test_structured_reasoning import LIMITS

PROMPT = [5, 17, 99, 200, 3, 41, 7]
LABELS = [9, 300, 4]


def test_a_row_naming_tokens_gets_their_raw_logprobs_in_its_order_beside_a_row_taking_the_top() -> None:
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplingSettings(temperature=0.0, num_logprobs=3, logprob_token_ids=(30, 2, 41)),
            SamplingSettings(temperature=0.0, num_logprobs=2)]
    out = Sampler(seed=0)(logits.clone(), rows, [1, 1])
    raw = logits.log_softmax(dim=-1)
    named, top = out.logprobs
    assert named.top_token_ids == [30, 2, 41]
    assert named.top_logprobs == pytest.approx(raw[0, [30, 2, 41]].tolist())
    assert named.logprob == pytest.approx(raw[0].max().item()) and named.rank == 1
    assert top.top_token_ids == raw[1].topk(2).indices.tolist()
    assert sampling_from_proto(sampling_to_proto(rows[0])).logprob_token_ids == (30, 2, 41)


def prepared(**sampling: object) -> object:
    return prepare(pb.GenerateRequest(tokens=pb.TokenPrompt(token_ids=[1, 2]), sampling=pb.SamplingOptions(
        **sampling)), LIMITS, None).params


def test_the_scheduler_counts_the_named_tokens_once_and_refuses_what_vllm_refuses() -> None:
    params = prepared(logprob_token_ids=[7, 3, 7])
    settings = params.settings
    assert (params.logprobs, settings.logprob_token_ids, settings.num_logprobs) == (3, (7, 3), 2), "vLLM's count"
    assert prepared(logprob_token_ids=list(range(25)), logprobs=25).logprobs == 25, "the limit of 20 is the top's"
    for sampling in ({"logprob_token_ids": list(range(129))}, {"logprob_token_ids": [7, 3], "logprobs": 1},
                     {"logprob_token_ids": [7, 3, 7], "logprobs": 2}, {"logprob_token_ids": [LIMITS.vocab_size]}):
        with pytest.raises(InvalidRequest) as refused:
            prepared(**sampling)
        assert refused.value.field == "sampling.logprob_token_ids"
    assert list(build_request(token_ids=[1], logprob_token_ids=[4, 5]).sampling.logprob_token_ids) == [4, 5]


@pytest.fixture(scope="module")
def tiny(tiny_model_folders: dict[str, Path]) -> Iterator[Hosted]:  # noqa: F811
    executor = ModelExecutor(ExecutorOptions(dtype="float32", model=str(tiny_model_folders["llama"]), threads=2,
                                             kv_cache_memory=16 << 20))
    with hosted(executor) as h:
        yield h
        h.assert_idle()


def test_a_completion_lists_the_named_tokens_logprobs_as_transformers_computes_them(
        tiny: Hosted, tiny_model_folders: dict[str, Path]) -> None:  # noqa: F811
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "logprob_token_ids": LABELS,
            "return_token_ids": True}
    choice = httpx.post(f"{tiny.url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folders["llama"], dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + choice["token_ids"]])).logits[0, len(PROMPT) - 1:-1]
    expected = logits.log_softmax(dim=-1)[:, LABELS]
    shown = choice["logprobs"]["top_logprobs"]
    assert [list(position) for position in shown] == [[f"token_id:{t}" for t in LABELS]] * 4
    assert [v for position in shown for v in position.values()] == pytest.approx(expected.flatten().tolist(), abs=1e-4)
    many = httpx.post(f"{tiny.url}/v1/completions", timeout=30,
                      json={**body, "logprob_token_ids": list(range(100, 125))})
    assert [len(position) for position in many.json()["choices"][0]["logprobs"]["top_logprobs"]] == [25] * 4
    echoed = httpx.post(f"{tiny.url}/v1/completions", timeout=30, json={**body, "echo": True, "logprobs": 5}).json()
    assert [len(p or ()) for p in echoed["choices"][0]["logprobs"]["top_logprobs"]] == [0] + [5] * 6 + [3] * 4, (
        "the echoed prompt's five alternatives, then the three named")
    render = httpx.post(f"{tiny.url}/v1/completions/render", timeout=30, json=body)
    assert (render.status_code, render.json()["error"]["param"]) == (400, "logprob_token_ids")
    missing = httpx.post(f"{tiny.url}/v1/completions", timeout=30, json={**body, "logprobs": None})
    assert (missing.status_code, missing.json()["error"]["param"]) == (400, "logprob_token_ids")
    beams = httpx.post(f"{tiny.url}/v1/completions", timeout=30, json={**body, "use_beam_search": True})
    assert (beams.status_code, beams.json()["error"]["param"]) == (400, "logprob_token_ids")


@pytest.fixture(scope="module")
def chat_api(smollm2_folder: Path) -> Iterator[Hosted]:  # noqa: F811 - converts the embedded model once
    with hosted_smollm2() as h:
        yield h


def test_a_chat_answer_lists_every_named_token_whatever_top_logprobs_says(chat_api: Hosted) -> None:
    client = chat_api.openai()
    model, messages = client.models.list().data[0].id, [{"role": "user", "content": "Is the sky blue? Yes or no."}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                           extra_body={"return_token_ids": True})
    first = plain.choices[0].token_ids[0]
    tokenizer = chat_api.server.frontend.tokenizer
    labels = [first, *tokenizer.encode("no", add_special_tokens=False)[:1]]
    named = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                           top_logprobs=1, extra_body={"logprob_token_ids": labels})
    entry = named.choices[0].logprobs.content[0]
    assert [alternative.token for alternative in entry.top_logprobs] == [tokenizer.decode([t], False) for t in labels]
    assert entry.top_logprobs[0].logprob == pytest.approx(plain.choices[0].logprobs.content[0].logprob, abs=1e-4)
    refused = httpx.post(f"{chat_api.url}/v1/chat/completions", timeout=30, json={
        "messages": messages, "logprob_token_ids": labels})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "logprob_token_ids")
    chat_api.assert_idle()
