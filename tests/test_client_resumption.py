"""The client's resume bookkeeping (``client.failover.Resumption``) without a server: what each resend asks for and
what the caller is handed when a stream breaks."""

from __future__ import annotations

import grpc

from client.failover import Resumption
from client.request_builder import build_request
from nanoserve.v1 import generation_pb2 as pb


class Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def pieces(responses: list[pb.GenerateResponse]) -> list[tuple[list[int], str, int]]:
    return [(list(r.token_ids), r.text, r.finish_reason) for r in responses]


def test_a_resend_carries_the_tokens_received_and_asks_for_no_prompt_logprobs_or_ids_again():
    request = build_request(token_ids=[1, 2], max_tokens=5, prompt_logprobs=2, return_prompt_token_ids=True)
    resumption = Resumption(request, timeout=None)
    first = resumption.attempt()
    assert first.prompt_logprobs == 2 and first.return_prompt_token_ids
    resumption.receive(pb.GenerateResponse(token_ids=[7], text="a"))
    again = resumption.attempt()
    assert list(again.resume.completion_token_ids) == [7]
    assert not again.HasField("prompt_logprobs"), "the prompt's logprobs would come twice"
    assert not again.return_prompt_token_ids, "so would its token ids"


def test_an_abort_held_back_is_handed_over_when_the_stream_then_fails():
    # A draining scheduler's last response (an ABORT with tokens) is held until the stream's end says whether it
    # drained; a stream that then breaks (UNAVAILABLE) hands its tokens over before the resend carries on after them.
    resumption = Resumption(build_request(token_ids=[1], max_tokens=9), timeout=None)
    resumption.attempt()
    assert pieces(resumption.receive(pb.GenerateResponse(token_ids=[5], text="a"))) == [([5], "a", 0)]
    assert resumption.receive(pb.GenerateResponse(token_ids=[6, 7], text="bc",
                                                  finish_reason=pb.FINISH_REASON_ABORT)) == []
    delay, rest = resumption.retry_delay(Failed(grpc.StatusCode.UNAVAILABLE))
    assert delay is not None and pieces(rest) == [([6, 7], "bc", pb.FINISH_REASON_UNSPECIFIED)]
    assert list(resumption.attempt().resume.completion_token_ids) == [5, 6, 7]


def test_other_failures_are_raised_with_nothing_to_hand_over():
    resumption = Resumption(build_request(token_ids=[1], max_tokens=9), timeout=None)
    resumption.attempt()
    resumption.receive(pb.GenerateResponse(token_ids=[6], text="b", finish_reason=pb.FINISH_REASON_ABORT))
    assert resumption.retry_delay(Failed(grpc.StatusCode.INTERNAL)) == (None, [])
