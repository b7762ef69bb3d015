"""A decode step packed while the step before samples: its pending tokens come from that step's sampled tokens."""

from __future__ import annotations

import pytest

from common.step import SamplingSettings
from executor_svc.core.request_table import RequestState, ScheduledChunk
from executor_svc.runtime.model_input import prepare_input

BLOCK_SIZE = 4


def request(request_id: int, length: int) -> RequestState:
    tokens = [100 * request_id + i for i in range(length)]
    return RequestState(request_id, tokens, [request_id * 8 + b for b in range(8)], length - 1, SamplingSettings(),
                        length)


def running(state: RequestState) -> ScheduledChunk:
    """The chunk of the step before: it computes the last known token and samples the next one."""
    return ScheduledChunk(state, len(state.token_ids) - 1, 1)


def following(state: RequestState) -> ScheduledChunk:
    """The chunk of the step packed meanwhile: its input is the token the step before is sampling."""
    return ScheduledChunk(state, len(state.token_ids), 1)


@pytest.mark.parametrize(("before", "after"), [
    ([0, 1, 2], [0, 1, 2]),  # the same requests in the same order
    ([0, 1, 2], [0, 2]),  # request 1 finished
    ([0, 1, 2], [2, 0, 1]),  # reordered
    ([0, 1], [0, 1, 2]),  # request 2 joined: its token is known, not pending
], ids=["in-order", "one-left", "reordered", "one-joined"])
def test_pending_tokens_are_taken_from_the_step_before_in_any_order(before: list[int], after: list[int]) -> None:
    states = [request(i, 5 + i) for i in range(3)]
    step_before = [running(states[i]) for i in before]
    chunks = [following(states[i]) if i in before else running(states[i]) for i in after]
    inputs = prepare_input(chunks, BLOCK_SIZE)
    inputs.link(step_before)
    assert inputs.linked is not None
    assert inputs.linked_in_order == (before == after)
    assert inputs.num_sampled == len(after)
    sampled = [7000 + i for i in before]  # the step before's tokens, in its order
    inputs.fill_pending(sampled)
    expected = [7000 + i if i in before else states[i].token_ids[-1] for i in after]
    assert inputs.input_ids.tolist() == expected
    assert inputs.pending == []


def test_a_step_before_without_a_pending_token_leaves_the_input_unlinked() -> None:
    states = [request(i, 6) for i in range(2)]
    inputs = prepare_input([following(states[0]), following(states[1])], BLOCK_SIZE)
    inputs.link([running(states[0])])  # request 1's token is not sampled by that step
    assert inputs.linked is None and not inputs.linked_in_order
    states[0].token_ids.append(11)
    states[1].token_ids.append(12)
    inputs.fill_pending()  # from the requests, once the step before recorded its tokens
    assert inputs.input_ids.tolist() == [11, 12]
