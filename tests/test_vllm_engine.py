"""vllm.grpc.engine.VllmEngine on the scheduler's port, called with smg-grpc-proto's own stubs as a gateway would.

The echo executor (completion token i is prompt token i mod its length) makes every token predictable, so stop
strings, stop tokens, cached prefixes and aborts land where a test puts them. Made-up logprobs come from
``LogprobExecutor``.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc
from smg_grpc_proto.generated import common_pb2 as common
from tokenizers import Tokenizer

from common.step import PromptLogprobs, StepPlan, StepResult, TokenLogprobs
from executor_svc.core.request_table import RequestTable
from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.api.vllm_engine.requests import sampling_options
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import EOS_ID, HOST, GatedExecutor
from tests.test_service_loop import LogprobExecutor
from tests.test_service_options import TOKENIZER, echo

PROMPT = TOKENIZER.encode("Hello world, héllo wörld! The quick brown fox jumps.", add_special_tokens=False)


class ScoringExecutor(LogprobExecutor):
    """Also scores the prompt of each new request that asks, -1.0 a token, as a model does in its prefill."""

    def step(self, plan: StepPlan) -> StepResult:
        result = super().step(plan)
        for new in plan.new_requests:
            if new.sampling.num_prompt_logprobs is not None:
                scored = [TokenLogprobs(-1.0, [t, 7], [-1.0, -3.0]) for t in new.token_ids[1:]]
                result.prompt_logprobs.append(PromptLogprobs(new.request_id, 1, scored))
        return result


@pytest.fixture(scope="module")
def gate() -> GatedExecutor:
    return GatedExecutor(ScoringExecutor(echo()))


@pytest.fixture(scope="module", params=[False, True], ids=["in-process", "api-process"])
def served(gate: GatedExecutor, request: pytest.FixtureRequest) -> Iterator[Hosted]:
    """The scheduler's own VllmEngine, and the API process's (Generate written there, everything else proxied)."""
    with hosted(gate, api_process=request.param) as h:
        yield h


@pytest.fixture
def channel(served: Hosted, gate: GatedExecutor) -> Iterator[grpc.Channel]:
    """A channel to the scheduler; every test ends with the gate open and every block free."""
    with grpc.insecure_channel(f"{HOST}:{served.server.port}") as channel:
        yield channel
    gate.open.set()
    served.assert_idle()


@pytest.fixture
def engine(channel: grpc.Channel) -> vllm_grpc.VllmEngineStub:
    return vllm_grpc.VllmEngineStub(channel)


def echoed(prompt: list[int], count: int) -> list[int]:
    return [prompt[i % len(prompt)] for i in range(count)]


def request(prompt: list[int] = PROMPT, stream: bool = True, **sampling: object) -> vllm.GenerateRequest:
    params = vllm.SamplingParams(**{"temperature": 0, "ignore_eos": True, "max_tokens": 6, **sampling})
    return vllm.GenerateRequest(tokenized=vllm.TokenizedInput(input_ids=prompt), sampling_params=params,
                                stream=stream)


def split(responses: list[vllm.GenerateResponse]) -> tuple[list[vllm.GenerateStreamChunk], list[vllm.GenerateComplete]]:
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    return chunks, [r.complete for r in responses if r.WhichOneof("response") == "complete"]


def test_a_stream_is_chunks_of_new_tokens_then_a_complete_and_a_repeat_reports_its_cached_prefix(engine) -> None:
    chunks, (complete,) = split(list(engine.Generate(request())))
    assert [t for chunk in chunks for t in chunk.token_ids] == list(complete.output_ids) == echoed(PROMPT, 6)
    assert all(chunk.prompt_tokens == len(PROMPT) and chunk.completion_tokens == len(chunk.token_ids)
               for chunk in chunks)
    assert (complete.finish_reason, complete.prompt_tokens, complete.completion_tokens) == ("length", len(PROMPT), 6)
    assert complete.cached_tokens == 0 and complete.WhichOneof("matched_stop") is None
    _, (again,) = split(list(engine.Generate(request(stream=False))))
    assert again.cached_tokens == (len(PROMPT) - 1) // 4 * 4, "every full block but the prompt's last"
    assert list(again.output_ids) == echoed(PROMPT, 6)


def test_max_tokens_unset_or_past_the_room_is_the_room_the_prompt_leaves(engine, served: Hosted) -> None:
    # As vLLM's engine takes it (its servicer passes an unset max_tokens on as None): a gateway's chat request without
    # one must not stop at a default, nor one asking past the model's length be refused.
    room = served.server.frontend.ready().info.max_model_len - len(PROMPT)
    unset = vllm.GenerateRequest(tokenized=vllm.TokenizedInput(input_ids=PROMPT),
                                 sampling_params=vllm.SamplingParams(temperature=0, ignore_eos=True))
    for sent in (unset, request(stream=False, max_tokens=10_000)):
        _, (complete,) = split(list(engine.Generate(sent)))
        assert (complete.finish_reason, complete.completion_tokens) == ("length", room)


@pytest.mark.parametrize(("num_blocks", "longest"), [(256, 1024), (100, 401)])
def test_a_prompt_without_max_tokens_runs_to_the_room_it_leaves(num_blocks: int, longest: int) -> None:
    """Text or token ids: the model's length, or the KV cache where smaller (the last token needs no slot), less the
    prompt; not the gRPC API's default, and not refused for a cache smaller than the model's length."""
    executor = echo()
    executor.info = replace(executor.info, max_model_len=1024, num_blocks=num_blocks)
    executor.table = RequestTable(num_blocks, 4, executor.info.vocab_size, 1024)
    params = vllm.SamplingParams(temperature=0, ignore_eos=True)
    with hosted(executor) as api, grpc.insecure_channel(f"{HOST}:{api.server.port}") as channel:
        for sent in (vllm.GenerateRequest(text="Hello world", sampling_params=params),
                     vllm.GenerateRequest(tokenized=vllm.TokenizedInput(input_ids=PROMPT), sampling_params=params)):
            _, (complete,) = split(list(vllm_grpc.VllmEngineStub(channel).Generate(sent)))
            assert complete.finish_reason == "length" and complete.completion_tokens > 256
            assert complete.prompt_tokens + complete.completion_tokens == longest
        api.assert_idle()


def test_top_k_and_min_p_left_at_zero_are_unset_so_the_models_defaults_apply() -> None:
    unset, _ = sampling_options(vllm.SamplingParams(top_p=0.5))
    assert not unset.HasField("top_k") and not unset.HasField("min_p") and unset.top_p == 0.5
    given, _ = sampling_options(vllm.SamplingParams(top_k=5, min_p=0.25))
    assert (given.top_k, given.min_p) == (5, 0.25)


def test_not_streamed_each_choice_is_one_complete_with_all_its_tokens(engine) -> None:
    responses = list(engine.Generate(request(stream=False, n=2, seed=7, logprobs=2, prompt_logprobs=1)))
    chunks, completes = split(responses)
    assert chunks == [] and sorted(c.index for c in completes) == [0, 1]
    for complete in completes:
        assert list(complete.output_ids) == echoed(PROMPT, 6) and complete.prompt_tokens == len(PROMPT)
        assert list(complete.output_logprobs.token_ids) == echoed(PROMPT, 6)
        assert list(complete.output_logprobs.token_logprobs) == [-0.25] * 6
        assert list(complete.output_logprobs.top_logprobs[0].values) == [-0.25, -2.0]
    prompt_logprobs = completes[0].input_logprobs
    assert list(prompt_logprobs.token_ids) == PROMPT
    assert not prompt_logprobs.token_logprobs[0].HasField("value"), "the first prompt token has no logprob"
    assert [lp.value for lp in prompt_logprobs.token_logprobs[1:]] == [-1.0] * (len(PROMPT) - 1)
    assert prompt_logprobs.top_logprobs[1].token_ids[0] == PROMPT[1] and not prompt_logprobs.top_logprobs[0].values


def test_text_input_stop_strings_and_stop_tokens_say_what_matched(engine) -> None:
    text = "Hello world, héllo wörld!"
    ids = TOKENIZER.encode(text)
    by_text = vllm.GenerateRequest(text=text, sampling_params=vllm.SamplingParams(max_tokens=40, stop=["wörld"]))
    _, (complete,) = split(list(engine.Generate(by_text)))
    assert complete.finish_reason == "stop" and complete.matched_stop_str == "wörld"
    assert TOKENIZER.decode(list(complete.output_ids)).startswith("Hello world, héllo")
    stop_id = ids[3]
    _, (by_token,) = split(list(engine.Generate(request(ids, stop_token_ids=[stop_id], max_tokens=40))))
    assert (by_token.finish_reason, by_token.matched_token_id) == ("stop", stop_id)
    assert list(by_token.output_ids) == ids[:4]
    eos = request(ids + [EOS_ID], max_tokens=40, ignore_eos=False)
    _, (by_eos,) = split(list(engine.Generate(eos)))
    assert by_eos.finish_reason == "stop" and by_eos.WhichOneof("matched_stop") is None


def test_abort_ends_a_stream_with_abort_and_frees_its_blocks(engine, gate: GatedExecutor) -> None:
    gate.open.clear()
    gate.entered.clear()
    responses: list[vllm.GenerateResponse] = []
    reader = threading.Thread(target=lambda: responses.extend(engine.Generate(
        vllm.GenerateRequest(request_id="to-abort", tokenized=vllm.TokenizedInput(input_ids=PROMPT),
                             sampling_params=vllm.SamplingParams(max_tokens=100, ignore_eos=True), stream=True))))
    reader.start()
    assert gate.entered.wait(5)
    engine.Abort(vllm.AbortRequest(request_ids=["to-abort", "unknown"]))
    gate.open.set()
    reader.join(10)
    _, (complete,) = split(responses)
    assert complete.finish_reason == "abort" and len(complete.output_ids) < 100


def test_info_rpcs_describe_the_model_and_the_load_follows_the_queue(engine, gate: GatedExecutor) -> None:
    assert engine.HealthCheck(vllm.HealthCheckRequest()).healthy
    model = engine.GetModelInfo(vllm.GetModelInfoRequest())
    assert (model.served_model_name, model.max_context_length, model.vocab_size) == ("echo", 256, 300)
    assert model.is_generation and list(model.eos_token_ids) == [EOS_ID]
    server = engine.GetServerInfo(vllm.GetServerInfoRequest())
    assert (server.block_size, server.max_num_seqs, server.server_type) == (4, 256, "nanoserve-grpc")
    idle = engine.GetLoads(vllm.GetLoadsRequest()).loads[0]
    assert (idle.num_running_reqs, idle.num_waiting_reqs, idle.max_total_num_tokens) == (0, 0, 256 * 4)
    gate.open.clear()
    gate.entered.clear()
    readers = [threading.Thread(target=list, args=(engine.Generate(request(max_tokens=20)),)) for _ in range(3)]
    for reader in readers:
        reader.start()
    assert gate.entered.wait(5)
    # The loop is held inside a step: the requests show as they arrive, waiting.
    load_when(engine, lambda load: load.num_total_reqs == 3 and load.num_waiting_reqs >= 2)
    gate.steps_before_closing = 1  # two more steps, then held again: the loop has scheduled all three
    gate.open.set()
    busy = load_when(engine, lambda load: load.num_running_reqs == 3)
    assert busy.num_total_reqs == 3 and busy.token_usage > 0 and busy.num_used_tokens > 0
    gate.steps_before_closing = None
    gate.open.set()
    for reader in readers:
        reader.join(10)
    load_when(engine, lambda load: load.num_total_reqs == 0 and load.token_usage == 0)


def load_when(engine: vllm_grpc.VllmEngineStub, holds, timeout_s: float = 5.0) -> vllm.SchedulerLoad:
    """GetLoads' answer once ``holds`` is true of it (the load is published after each engine-loop iteration)."""
    deadline = time.monotonic() + timeout_s
    while not holds(load := engine.GetLoads(vllm.GetLoadsRequest()).loads[0]):
        assert time.monotonic() < deadline, f"GetLoads never showed it: {load}"
        time.sleep(0.01)
    return load


def test_get_tokenizer_streams_the_tokenizer_as_a_folder_zipped(engine) -> None:
    chunks = list(engine.GetTokenizer(common.GetTokenizerRequest()))
    data = b"".join(chunk.data for chunk in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and all(not c.sha256 for c in chunks[:-1])
    files = zipfile.ZipFile(io.BytesIO(data))
    tokenizer = Tokenizer.from_str(files.read("tokenizer.json").decode())
    assert tokenizer.encode("héllo wörld").ids == TOKENIZER.encode("héllo wörld")
    config = json.loads(files.read("tokenizer_config.json"))
    assert config["chat_template"] == files.read("chat_template.jinja").decode() and config["eos_token"]


def test_kv_events_stream_the_cache_and_a_resume_replays_what_was_missed(engine) -> None:
    events = engine.SubscribeKvEvents(common.SubscribeKvEventsRequest(), timeout=20)
    events.initial_metadata()  # subscribed
    prompt = TOKENIZER.encode("The quick brown fox jumps over the lazy dog.")
    list(engine.Generate(request(prompt)))
    first = next(events)
    stored = [e.stored for e in first.events if e.WhichOneof("data") == "stored"]
    assert [t for block in stored[0].blocks for t in block.token_ids] == prompt[:len(stored[0].blocks) * 4]
    assert stored[0].blocks[0].block_size == 4 and not stored[0].HasField("parent_block_hash")
    assert first.sequence_number >= 1 and first.events[0].event_id >= 1
    flushed = engine.FlushCache(common.FlushCacheRequest())
    assert flushed.success and "dropped" in flushed.message
    kinds: set[str] = set()
    while not kinds & {"cleared", "removed"}:
        last = next(events)
        kinds = {e.WhichOneof("data") for e in last.events}
    assert last.sequence_number > first.sequence_number
    events.cancel()
    replay = engine.SubscribeKvEvents(common.SubscribeKvEventsRequest(start_sequence_number=first.sequence_number),
                                      timeout=20)
    assert [next(replay).sequence_number for _ in range(2)] == [first.sequence_number, first.sequence_number + 1]
    replay.cancel()


@pytest.mark.parametrize(("build", "field"), [
    (lambda: request(temperature=-1), "sampling_params.temperature"),
    (lambda: request(top_p=2), "sampling_params.top_p"),
    (lambda: request(logprobs=-1), "sampling_params.logprobs"),
    (lambda: request(json_schema="{not json"), "sampling_params.json_schema"),
    (lambda: request(structural_tag="{}"), "sampling_params.structural_tag"),
    (lambda: request([5, 300]), "tokenized.input_ids"),
    (lambda: vllm.GenerateRequest(sampling_params=vllm.SamplingParams(max_tokens=2)), "input"),
    (lambda: vllm.GenerateRequest(text="hi", mm_inputs=vllm.MultimodalInputs()), "mm_inputs"),
    (lambda: vllm.GenerateRequest(text="hi", kv_transfer_params_json="{}"), "kv_transfer_params_json"),
    (lambda: vllm.GenerateRequest(text="hi", data_parallel_rank=2), "data_parallel_rank"),
])
def test_a_bad_generate_is_refused_naming_the_field_while_a_good_stream_completes(engine, gate: GatedExecutor,
                                                                                   build, field: str) -> None:
    gate.open.clear()
    gate.entered.clear()
    good: list[vllm.GenerateResponse] = []
    reader = threading.Thread(target=lambda: good.extend(engine.Generate(request(max_tokens=8))))
    reader.start()
    assert gate.entered.wait(5)
    with pytest.raises(grpc.RpcError) as refused:
        list(engine.Generate(build()))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith(f"{field}:"), refused.value.details()
    gate.open.set()
    reader.join(10)
    assert list(split(good)[1][0].output_ids) == echoed(PROMPT, 8)


def test_every_other_rpc_refuses_bad_input_or_what_it_cannot_do_clearly(engine, channel: grpc.Channel,
                                                                        gate: GatedExecutor) -> None:
    gate.open.clear()
    gate.entered.clear()
    good: list[vllm.GenerateResponse] = []
    reader = threading.Thread(target=lambda: good.extend(engine.Generate(request(max_tokens=8))))
    reader.start()
    assert gate.entered.wait(5)
    cases = [
        (lambda: engine.GetLoads(vllm.GetLoadsRequest(dp_rank=1)), grpc.StatusCode.INVALID_ARGUMENT, "dp_rank:"),
        (lambda: engine.FlushCache(common.FlushCacheRequest(timeout_s=-1)), grpc.StatusCode.INVALID_ARGUMENT,
         "timeout_s:"),
        (lambda: engine.Embed(vllm.EmbedRequest()), grpc.StatusCode.UNIMPLEMENTED, "Embed"),
        (lambda: engine.StartProfile(common.StartProfileRequest()), grpc.StatusCode.UNIMPLEMENTED, "profiling"),
        (lambda: engine.StopProfile(common.StopProfileRequest()), grpc.StatusCode.UNIMPLEMENTED, "profiling"),
    ]
    for call, code, named in cases:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == code and named in refused.value.details()
    for method in ("Generate", "GetLoads", "FlushCache", "SubscribeKvEvents", "Abort"):
        call = channel.unary_unary(f"/vllm.grpc.engine.VllmEngine/{method}")
        if method in ("Generate", "SubscribeKvEvents"):
            call = channel.unary_stream(f"/vllm.grpc.engine.VllmEngine/{method}")
        with pytest.raises(grpc.RpcError) as refused:
            result = call(b"\xff\xff\xff")
            list(result) if method in ("Generate", "SubscribeKvEvents") else result
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
    gate.open.set()
    reader.join(10)
    assert list(split(good)[1][0].output_ids) == echoed(PROMPT, 8), "the good stream completed meanwhile"


def test_streamed_prompt_logprobs_come_in_each_choices_first_chunk(engine) -> None:
    chunks, completes = split(list(engine.Generate(request(n=2, seed=3, prompt_logprobs=2, logprobs=0))))
    first = {}
    for chunk in chunks:
        first.setdefault(chunk.index, chunk)
    assert sorted(first) == [0, 1]
    for chunk in first.values():
        assert list(chunk.input_logprobs.token_ids) == PROMPT
        assert len(chunk.input_logprobs.top_logprobs) == len(PROMPT)
    later = [c for c in chunks if c not in first.values()]
    assert all(not c.HasField("input_logprobs") for c in later)
    assert all(c.output_logprobs.token_ids == c.token_ids and not c.output_logprobs.top_logprobs for c in chunks)
    assert sorted(c.index for c in completes) == [0, 1]


def test_without_a_tokenizer_text_and_get_tokenizer_are_refused_and_tokens_work() -> None:
    with hosted(ShadowExecutor(num_blocks=16, block_size=4, vocab_size=50)) as h, \
            grpc.insecure_channel(f"{HOST}:{h.server.port}") as channel:
        stub = vllm_grpc.VllmEngineStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.GetTokenizer(common.GetTokenizerRequest()))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(vllm.GenerateRequest(text="hi")))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.value.details().startswith("text:")
        _, (complete,) = split(list(stub.Generate(request([1, 2, 3], max_tokens=3))))
        assert len(complete.output_ids) == 3
        h.assert_idle()


def test_a_negative_seed_is_taken_as_its_unsigned_twin() -> None:
    # The protocol's seed is int32, into which gateways clamp a client's seed: vLLM takes a negative one as any other.
    assert sampling_options(vllm.SamplingParams(seed=-3))[0].seed == 2**32 - 3
    assert sampling_options(vllm.SamplingParams(seed=7))[0].seed == 7
    assert not sampling_options(vllm.SamplingParams(seed=-1))[0].HasField("seed"), "-1 is no seed, as vLLM reads it"
