"""A mixed step's packed batch: decode rows first with each half's attention metadata, and the sampled rows, prompt
rows and pending tokens still in the plan's order."""

from __future__ import annotations

import pickle

import torch

from common.step import SamplingSettings
from executor_svc.core.request_table import RequestState, ScheduledChunk
from executor_svc.runtime.model_input import prepare_input

BLOCK_SIZE = 4


def request(request_id: int, length: int) -> RequestState:
    tokens = [100 * request_id + i for i in range(length)]
    return RequestState(request_id, tokens, [request_id * 8 + b for b in range(8)], 0, SamplingSettings(), length)


# The plan's order: a new 6-token prompt, a decode, a middle chunk of a long prompt (3 tokens after 4 cached, not
# the last: it does not sample), a decode.
PROMPT, DECODE, MIDDLE, OTHER = request(0, 6), request(1, 9), request(2, 20), request(3, 2)
CHUNKS = [ScheduledChunk(PROMPT, 0, 6), ScheduledChunk(DECODE, 8, 1), ScheduledChunk(MIDDLE, 4, 3),
          ScheduledChunk(OTHER, 1, 1)]


def test_decode_rows_come_first_with_their_own_metadata() -> None:
    inputs = prepare_input(CHUNKS, BLOCK_SIZE)
    assert inputs.input_ids.tolist() == [108, 301, *range(0, 6), 204, 205, 206]
    assert inputs.positions.tolist() == [8, 1, *range(0, 6), 4, 5, 6]
    meta, split = inputs.meta, inputs.meta.mixed
    # The whole step is still a valid prefill, for a backend's prefill to run as it is.
    assert meta.is_prefill and meta.cu_seqlens_q.tolist() == [0, 1, 2, 8, 11]
    assert meta.cu_seqlens_k.tolist() == [0, 9, 11, 17, 24]
    assert split is not None and split.num_decodes == 2
    assert not split.decode.is_prefill and split.decode.context_lens.tolist() == [9, 2]
    assert split.decode.block_tables.tolist() == meta.block_tables[:2].tolist()
    prefill = split.prefill
    assert prefill.is_prefill and prefill.cu_seqlens_q.tolist() == [0, 6, 9]
    assert prefill.cu_seqlens_k.tolist() == [0, 6, 13]
    assert (prefill.max_seqlen_q, prefill.max_seqlen_k, prefill.has_cached_context) == (6, 7, True)
    assert prefill.block_tables.tolist() == meta.block_tables[2:].tolist()
    assert torch.equal(prefill.slot_mapping, meta.slot_mapping[2:])
    assert meta.slot_mapping[:2].tolist() == [10 * BLOCK_SIZE, 24 * BLOCK_SIZE + 1]  # blocks 8 + 8 // 4 and 24
    # Under tensor parallelism the step reaches the other ranks pickled.
    copied = pickle.loads(pickle.dumps(inputs.meta))
    assert copied.mixed.num_decodes == 2 and torch.equal(copied.mixed.prefill.cu_seqlens_k, prefill.cu_seqlens_k)


def test_sampled_and_scored_rows_stay_in_the_plans_order() -> None:
    # Prompt-logprob rows counted in the plan's order: the prompt's first 5 and the middle chunk's 3.
    inputs = prepare_input(CHUNKS, BLOCK_SIZE, [0, 1, 2, 3, 4, 7, 8, 9])
    assert inputs.logits_indices.tolist() == [7, 0, 1]  # the prompt's last row, then the decodes; not the middle
    assert inputs.prompt_rows.tolist() == [2, 3, 4, 5, 6, 8, 9, 10]
    assert inputs.input_ids[inputs.prompt_rows].tolist() == [0, 1, 2, 3, 4, 204, 205, 206]


def test_pending_decode_tokens_are_filled_at_their_packed_rows() -> None:
    decode, other = request(1, 8), request(3, 1)
    before = [ScheduledChunk(other, 0, 1), ScheduledChunk(decode, 7, 1)]  # the step before samples their next tokens
    chunks = [ScheduledChunk(PROMPT, 0, 6), ScheduledChunk(decode, 8, 1), ScheduledChunk(other, 1, 1)]
    inputs = prepare_input(chunks, BLOCK_SIZE)
    assert [row for row, _, _ in inputs.pending] == [0, 1]
    inputs.link(before)
    inputs.fill_pending([7000, 7001])  # the step before's tokens, in its order: other's, then decode's
    assert inputs.input_ids.tolist() == [7001, 7000, *range(0, 6)]
    assert inputs.logits_indices.tolist() == [7, 0, 1]
