"""The engine's turn (``scheduler_svc.engine.turn``), and streams whose writing falls behind the engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import grpc

from executor_svc.fakes.shadow import ShadowExecutor, reference_generate
from executor_svc.service import build_server
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.executor_client import RemoteExecutor, StepStream
from scheduler_svc.engine.turn import Turn
from tests.service_fixtures import assert_idle_async, collect, in_process_scheduler, token_request

VOCAB = 50


# Bounds on a wait that must not happen, or must end at once: each is a third of what the bug costs (a turn's whole
# ``LONG`` wait), so a loaded machine's delays stay far below it and a missed wake-up or a wait too many still fails.
LONG = 30.0
AT_ONCE = LONG / 3


def timed_give_way(turn: Turn, since: float | None = None) -> float:
    """Seconds from ``since`` (by default the call) until ``give_way`` returns."""
    start = time.monotonic() if since is None else since
    turn.give_way()
    return time.monotonic() - start


def end_later(turn: Turn, delay_s: float, ended: threading.Event | None = None) -> tuple[threading.Timer, float]:
    """End ``turn`` on a timer in ``delay_s``, setting ``ended`` just before."""

    def end() -> None:
        if ended is not None:
            ended.set()
        turn.end()

    ender = threading.Timer(delay_s, end)
    started = time.monotonic()
    ender.start()
    return ender, started


def test_the_event_loop_goes_on_at_once_when_no_turn_is_taken():
    turn = Turn(max_wait_s=LONG)
    assert timed_give_way(turn) < AT_ONCE
    turn.end()  # ending a turn never taken changes nothing
    turn.take()
    turn.end()
    assert timed_give_way(turn) < AT_ONCE


def test_the_event_loop_waits_for_a_turn_to_end():
    turn = Turn(max_wait_s=LONG)
    turn.take()
    ended = threading.Event()
    ender, started = end_later(turn, 0.2, ended)
    waited = timed_give_way(turn, since=started)
    assert ended.is_set(), "the event loop went on before the turn ended"
    ender.join()
    assert waited < AT_ONCE, "the end of the turn did not wake the event loop"


def test_a_turn_never_ended_holds_the_event_loop_back_once_and_briefly():
    max_wait_s = 1.0
    turn = Turn(max_wait_s=max_wait_s)
    taken = time.monotonic()
    turn.take()
    turn.take()  # a result arriving during the turn does not extend it
    assert max_wait_s <= timed_give_way(turn, since=taken) < max_wait_s + AT_ONCE
    assert timed_give_way(turn) < max_wait_s / 2  # its time is up: every later call goes on at once


def test_after_each_wait_the_event_loop_has_as_long_again_to_itself():
    turn = Turn(max_wait_s=LONG)
    turn.take()
    ender, _ = end_later(turn, 0.3)
    waited = timed_give_way(turn)
    ender.join()
    turn.take()  # the next turn, at once: not given way to within the event loop's own time
    assert timed_give_way(turn) < AT_ONCE
    time.sleep(waited)
    ended = threading.Event()
    ender, started = end_later(turn, 0.2, ended)
    assert timed_give_way(turn, since=started) < AT_ONCE  # past it, the turn is given way to again
    assert ended.is_set(), "past its own time, the event loop did not give way to the turn"
    ender.join()


class CountingTurn(Turn):
    def __init__(self) -> None:
        super().__init__()
        self.taken = self.ended = 0

    def take(self) -> None:
        self.taken += 1
        super().take()

    def end(self) -> None:
        self.ended += 1
        super().end()


def test_the_executor_stream_takes_the_turn_with_each_result_and_ends_it_with_each_plan_sent():
    server, port = build_server(ShadowExecutor(64, 4, VOCAB, (0,)), "127.0.0.1", 0)
    server.start()
    turn = CountingTurn()
    remote = RemoteExecutor(f"127.0.0.1:{port}", turn=turn)
    try:
        engine = Engine(remote, SchedulerConfig(4, 64, num_scheduler_steps=1), overlap=True)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        engine.generate([[1, 2, 3], [4, 5]], [params, params])
    finally:
        remote.close()
        server.stop(None)
    assert turn.taken == engine.num_steps > 0
    assert turn.ended >= engine.num_steps  # every plan sent, the drops after the last result's included


def test_a_stream_written_late_gets_every_token_in_order_in_fewer_responses_with_its_end_and_usage():
    """The event loop held up while the engine runs on (as when writing the streams falls behind): the stream's next
    response carries every token produced since its last one, then the finish and the usage, exactly as read one by
    one."""
    prompt, max_tokens = [3, 1, 4, 1, 5], 12

    async def run() -> list[pb.GenerateResponse]:
        async with in_process_scheduler(ShadowExecutor(64, 4, VOCAB, (0,))) as s:
            call = s.stub.Generate(token_request(prompt, max_tokens, ignore_eos=True))
            responses = [await call.read()]
            time.sleep(0.5)  # the event loop blocked: the engine thread computes the rest meanwhile
            while (response := await call.read()) is not grpc.aio.EOF:
                responses.append(response)
            await assert_idle_async(s.stub)
            return responses

    responses = asyncio.run(run())
    joined = collect(responses)
    assert joined.token_ids == reference_generate(prompt, max_tokens, VOCAB, {0}, True)
    assert len(responses) < max_tokens
    assert joined.finish_reason == pb.FINISH_REASON_LENGTH
    assert (joined.usage.prompt_tokens, joined.usage.completion_tokens) == (len(prompt), max_tokens)



class SlowSender:
    """A stub whose StepStream call asks for each plan ``delay_s`` after the one before, as gRPC's sending thread does
    when it waits for the GIL."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.ended = threading.Event()  # set: the call ends, with no result

    def StepStream(self, plans: Iterator[object]) -> Iterator[object]:  # noqa: N802 - gRPC's method name
        def send() -> None:
            time.sleep(self.delay_s)
            for _ in plans:
                time.sleep(self.delay_s)

        threading.Thread(target=send, daemon=True).start()
        return iter(self.ended.wait, True)


def test_submit_returns_once_the_plan_is_on_its_way():
    """The engine loop processes the step before's outputs once the plan is sent: until gRPC's sending thread has taken
    it, ``submit`` waits, else the plan waits for the GIL behind that work while the executor idles."""
    stub = SlowSender(delay_s=0.2)
    stream = StepStream(stub, Turn(), hand_over_s=LONG)
    for plan in ("plan 1", "plan 2"):
        start = time.monotonic()
        stream.submit(plan)
        assert time.monotonic() - start >= 0.15  # without the wait: at once
    stub.ended.set()
