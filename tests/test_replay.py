"""Record and replay (docs/replay.md): a session through the real scheduler (chunked prefill, prefix hits,
preemptions, n > 1, structured output, logprobs, an executor restart and a resumed stream) replays identically on
the shadow-KV executor and on the model; an executor that samples one token otherwise is caught at that request,
step and position."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from common.recording import Recording
from common.replay import ExecutorGone
from common.step import CachedRequests, NewRequest, SamplingSettings, StepPlan, StepResult
from common.step_codec import plan_from_proto
from executor_svc.core.request_table import ScheduledChunk
from executor_svc.fakes.shadow import ShadowExecutor, next_token
from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from executor_svc.runtime.registry import DEFAULT_MODEL
from executor_svc.runtime.replay import model_executor, shadow_executor
from nanoserve.v1 import recording_pb2 as rpb
from scheduler_svc.engine.recorder import Recorder
from tests.model_fixtures import smollm2_folder  # noqa: F401
from tests.replay_helpers import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    model_args,
    record_session,
    recorded,
    replay,
)
from tests.service_fixtures import CHATML_TEMPLATE, EOS_ID, TOKENIZER_VOCAB_SIZE, byte_level_tokenizer
from tests.shadow_helpers import RestartingExecutor

REGEX = "[a-c]{2,8}"
# About 46 KiB of float32 KV per SmolLM2 token: as few blocks of 4 tokens as the shadow session has.
MODEL_KV_BYTES = NUM_BLOCKS * BLOCK_SIZE * 46 * 1024


def shadow() -> ShadowExecutor:
    return ShadowExecutor(NUM_BLOCKS, BLOCK_SIZE, TOKENIZER_VOCAB_SIZE, (EOS_ID,),
                          tokenizer_json=byte_level_tokenizer().to_str(), chat_template=CHATML_TEMPLATE)


def plans(directory: Path) -> list[StepPlan]:
    recording = Recording(directory)
    return [plan_from_proto(r.plan) for s in recording.sessions for r in recording.records(s)
            if r.WhichOneof("entry") == "plan"]


def assert_the_session_has_everything(directory: Path, stats) -> None:
    """The recording holds what the session was built to exercise."""
    assert stats.num_preemptions > 0 and stats.num_prefix_cache_hit_tokens > 0
    assert stats.num_executor_restarts == 1
    recorded_plans = plans(directory)
    new = [n for p in recorded_plans for n in p.new_requests]
    assert any(n.num_scheduled_tokens < len(n.token_ids) - n.num_computed_tokens for n in new), "no chunked prefill"
    assert any(n.num_computed_tokens > 0 for n in new), "no prefix hit"
    assert any(n.sampling.grammar for n in new), "no structured output"
    assert any(n.num_prompt_tokens is not None for n in new), "no request came back with its completion"


@pytest.fixture(scope="module")
def shadow_recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("shadow-recording")
    outputs, stats = record_session(RestartingExecutor(shadow, {12}), directory, REGEX, TOKENIZER_VOCAB_SIZE)
    assert all(outputs), "a request ended without tokens"
    assert_the_session_has_everything(directory, stats)
    return directory


def test_a_session_replays_identically_on_the_shadow_executor(shadow_recording: Path):
    report = replay(shadow_recording, shadow_executor(recorded(shadow_recording)))
    assert report.identical, (report.issues, report.diverged)
    assert report.num_restarts == 1 and report.num_compared == report.num_identical > 20
    assert len(report.requests) >= 10 and all(r.num_tokens > 0 for r in report.requests.values())
    assert not report.warnings


def test_a_session_replays_identically_on_the_model(smollm2_folder, tmp_path: Path):  # noqa: F811
    def make() -> ModelExecutor:
        return ModelExecutor(ExecutorOptions(dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=MODEL_KV_BYTES,
                                             threads=2))

    executor = RestartingExecutor(make, {10})
    vocab = executor.get_info().vocab_size
    outputs, stats = record_session(executor, tmp_path, REGEX, vocab, logprobs=True)
    assert_the_session_has_everything(tmp_path, stats)
    replaying = model_executor(recorded(tmp_path), model_args(DEFAULT_MODEL, MODEL_KV_BYTES))
    report = replay(tmp_path, replaying)
    assert report.identical, (report.issues, report.diverged)
    assert report.num_restarts == 1 and report.num_compared == report.num_identical
    diffs = [r.max_logprob_diff for r in report.requests.values() if r.max_logprob_diff is not None]
    assert diffs and max(diffs) == 0.0, "the logprobs of the same model and plans differ"


class AlteredShadow(ShadowExecutor):
    """A shadow executor whose sampler gets one token wrong, request ``request_id``'s in plan ``step_id``: as a
    changed kernel would, it keeps that token, so the request's context parts from the recorded one there."""

    def __init__(self, step_id: int, request_id: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.target = (step_id, request_id)
        self.step_id = 0
        self.altered: tuple[int, int] | None = None  # (recorded token, altered token)

    def step(self, plan: StepPlan) -> StepResult:
        self.step_id = plan.step_id
        return super().step(plan)

    def forward(self, chunks: list[ScheduledChunk], inputs: object | None = None) -> StepResult:
        result = super().forward(chunks, inputs)
        for i, chunk in enumerate(chunks):
            if chunk.samples and (self.step_id, chunk.state.request_id) == self.target:
                token = result.token_ids[i]
                result.token_ids[i] = (token + 1) % self.info.vocab_size
                self.altered = (token, result.token_ids[i])
        return result


def answered_by_the_instance_shaken_hands_with(recording: Recording) -> set[int]:
    """The plans with a recorded result from the instance of the handshake before it: not one that the restarted
    executor answered before the scheduler shook hands with it (the replay does not compare those)."""
    answered, instance = set(), ""
    for record in (r for s in recording.sessions for r in recording.records(s)):
        entry = record.WhichOneof("entry")
        if entry == "handshake":
            instance = record.handshake.instance_id
        elif entry == "result" and record.result.instance_id == instance:
            answered.add(record.result.step_id)
    return answered


def test_an_altered_executor_diverges_at_the_request_step_and_position_it_altered(shadow_recording: Path):
    answered = answered_by_the_instance_shaken_hands_with(Recording(shadow_recording))
    # Prefills that sample (a prompt's last chunk) in plans whose results were recorded: one from the middle.
    candidates = [(plan.step_id, new) for plan in plans(shadow_recording) if plan.step_id in answered
                  for new in plan.new_requests
                  if new.num_computed_tokens + new.num_scheduled_tokens == len(new.token_ids)]
    step_id, new = candidates[len(candidates) // 2]
    info = recorded(shadow_recording)
    altered = AlteredShadow(step_id, new.request_id, num_blocks=info.num_blocks, block_size=info.block_size,
                            vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids)
    report = replay(shadow_recording, altered)
    assert altered.altered is not None, "the altered plan was never run"
    assert not report.identical
    (diverged,) = report.diverged
    d = diverged.divergence
    assert (diverged.request_id, d.step_id, d.position) == (new.request_id, step_id, len(new.token_ids))
    assert (d.recorded, d.replayed) == altered.altered


def test_a_session_with_speculation_replays_identically(tmp_path: Path):
    """n-gram proposals (many rejected) through chunked prefill, preemption, a restart and a resume: each
    verification's tokens are attributed to their request as the recorded executor sampled them."""
    # One step per plan, one at a time: a sequence with a decode in flight proposes only when its tokens before it
    # matched, so under overlap how many proposals come depends on timing (a loaded machine recorded none).
    config = dict(speculative="ngram", ngram_min=1, ngram_max=2, num_speculative_tokens=3,
                  speculative_disable_by_batch_size=64, num_scheduler_steps=1, overlap=False)
    outputs, stats = record_session(RestartingExecutor(shadow, {12}), tmp_path, REGEX, TOKENIZER_VOCAB_SIZE, **config)
    assert all(outputs) and stats.num_spec_drafts > 0
    assert any(p.cached_requests.num_draft_tokens for p in plans(tmp_path))
    report = replay(tmp_path, shadow_executor(recorded(tmp_path)))
    assert report.identical, (report.issues, report.diverged)
    assert report.num_restarts == 1 and len(report.requests) >= 10
    assert sum(r.num_tokens for r in report.requests.values()) >= sum(map(len, outputs))


def test_a_plan_the_restarted_executor_answered_is_noted_not_compared(tmp_path: Path):
    """With overlap the plan after the one that failed was sent already, and the executor that came back ran it: a
    new request whose prefix it never held read empty slots. The scheduler drops that answer on recovering, so the
    replay sends the plan but holds none of its tokens against it."""
    first, restarted = shadow(), shadow()
    greedy = SamplingSettings(temperature=0)
    prompt = list(range(1, 9))
    hit = [*prompt[:BLOCK_SIZE], 9, 9, 9]  # its first block is the first request's
    plans = [StepPlan(1, True, new_requests=[NewRequest(1, prompt, greedy, [0, 1], 0, len(prompt))]),
             StepPlan(2, cached_requests=CachedRequests([1], [len(prompt)], [1], [1], [2])),
             StepPlan(3, True, new_requests=[NewRequest(2, hit, greedy, [0, 3], BLOCK_SIZE, len(hit) - BLOCK_SIZE)])]
    recorder = Recorder(tmp_path)
    recorder.start()
    recorder.begin(first.get_info(), 0)
    recorder.put("plan", plans[0])
    recorder.put("result", first.step(plans[0]))
    recorder.put("plan", plans[1])
    recorder.put("plan", plans[2])
    recorder.put("failure", rpb.StepFailure(step_id=2, error="ConnectionLost: executor process killed"))
    answer = restarted.step(plans[2])
    recorder.put("result", answer)
    recorder.handshake(restarted.get_info())
    recorder.put("reset", rpb.ExecutorReset())
    recorder.stop()
    assert answer.token_ids != [next_token(np.array(hit), TOKENIZER_VOCAB_SIZE, None)], "the slots read the same"

    report = replay(tmp_path, shadow_executor(recorded(tmp_path)))
    assert report.identical and report.num_compared == report.num_identical == 1, report
    assert report.num_restarts == 1
    assert [(i.step_id, i.replayed, i.difference) for i in report.issues] == [(2, "ran", False), (3, "ran", False)]
    assert restarted.get_info().instance_id in report.issues[1].recorded


class GoneAfter(ShadowExecutor):
    """A shadow executor that can no longer be reached from its ``gone_at``-th step on."""

    def __init__(self, gone_at: int, **shadow: object) -> None:
        super().__init__(**shadow)
        self.gone_at, self.steps = gone_at, 0

    def step(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        if self.steps >= self.gone_at:
            raise ExecutorGone("UNAVAILABLE: the executor went away")
        return super().step(plan)


def test_an_executor_that_goes_away_stops_the_replay_rather_than_refusing_every_plan_after(shadow_recording: Path):
    info = recorded(shadow_recording)
    gone = GoneAfter(3, num_blocks=info.num_blocks, block_size=info.block_size, vocab_size=info.vocab_size,
                     eos_token_ids=info.eos_token_ids)
    with pytest.raises(ExecutorGone):
        replay(shadow_recording, gone)
    assert gone.steps == 3, "plans were still sent to an executor that was gone"
