"""The API process's pacing (``api.pacing``, ``--api-process-cpu-share``): a step's outputs go to their streams at once
while writing them costs the process less than its share of a core, and wait for the next ones when it costs more, so
that a stream then reads them in one message; nothing is lost or reordered either way."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest

from scheduler_svc.api.api_process import Call, Link
from scheduler_svc.api.pacing import PacedReading, WritePacer, default_share, share_of, usable_cores
from scheduler_svc.api.process_link import HEADER, encode_outputs, pack
from scheduler_svc.core.outputs import RequestOutput
from scheduler_svc.core.sequence import FinishReason


class Clocks:
    """A wall clock and a CPU clock the test moves by hand."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def pacer(self, share: float) -> WritePacer:
        return WritePacer(share, clock=lambda: self.wall, cpu=lambda: self.cpu)


def test_nothing_is_held_while_the_process_spends_less_than_its_share():
    clocks = Clocks()
    pacer = clocks.pacer(0.5)
    clocks.wall, clocks.cpu = 0.010, 0.004  # 40 % of a core over 10 ms
    assert pacer.delay() == 0.0


def test_outputs_are_held_until_the_cpu_spent_is_the_share_of_the_time():
    clocks = Clocks()
    pacer = clocks.pacer(0.4)
    clocks.wall, clocks.cpu = 0.005, 0.004  # 4 ms of CPU in 5 ms: due at 10 ms
    assert pacer.delay() == pytest.approx(0.005)
    clocks.wall = 0.009
    assert pacer.delay() == pytest.approx(0.001)
    pacer.handed_on()  # counted afresh from here
    clocks.wall, clocks.cpu = 0.014, 0.005
    assert pacer.delay() == 0.0


@pytest.mark.parametrize(("cores", "share"), [(2, 0.2), (4, 0.4), (8, 0.8), (10, 1.0), (64, 1.0), (0.5, 0.05)])
def test_the_default_share_is_a_tenth_of_the_machine_at_most_a_core(cores: float, share: float):
    assert default_share(cores) == pytest.approx(share)


def test_a_share_given_is_kept_and_none_takes_the_machines_default():
    assert share_of(0.3) == 0.3
    assert share_of(None) == pytest.approx(default_share(usable_cores()))


@pytest.mark.parametrize(("cpu_max", "cores"), [("150000 100000", 1.5), ("max 100000", None), ("400000 100000", 4.0),
                                                 (None, None), ("garbled", None)])
def test_a_containers_cpu_limit_below_its_affinity_bounds_the_cores(tmp_path, cpu_max: str | None,
                                                                     cores: float | None):
    """cgroup v2: the process's group from /proc/self/cgroup, its quota over its period in cpu.max ("max": none)."""
    (tmp_path / "cgroup").write_text("0::/kubepods/pod1/c1\n")
    group = tmp_path / "root" / "kubepods" / "pod1" / "c1"
    group.mkdir(parents=True)
    if cpu_max is not None:
        (group / "cpu.max").write_text(cpu_max + "\n")
    affinity = float(len(os.sched_getaffinity(0)))
    expected = affinity if cores is None else min(affinity, cores)
    assert usable_cores(tmp_path / "cgroup", tmp_path / "root") == expected


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_zero_to_one_is_refused(share: float):
    with pytest.raises(ValueError, match="share"):
        WritePacer(share)


class Sent:
    """The link's writer: what this process sends the scheduler, kept but not looked at here."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False


def token(token_id: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(text=f"<{token_id}>", token_ids=[token_id], finish_reason=finish)


def feed(reader: asyncio.StreamReader, outputs: list[RequestOutput]) -> None:
    """One step's outputs of call 0, as the scheduler sends them over the link."""
    reader.feed_data(pack(("outputs", encode_outputs([(0, output) for output in outputs]))))


def taken(outputs: list[RequestOutput]) -> list[tuple]:
    return [(output.token_ids, output.finish_reason) for output in outputs]


STEPS = [[token(1)], [token(2)], [token(3, FinishReason.LENGTH)]]


def open_link(pacer: WritePacer | None) -> tuple[asyncio.StreamReader, Link, Call]:
    """A link whose frames the test feeds, with one call (key 0) reading a token at a time."""
    reader = asyncio.StreamReader()
    link = Link(reader, Sent(), pacer)  # type: ignore[arg-type]
    call = link.calls[0] = Call(1)
    return reader, link, call


async def over_share(cpu_s: float) -> tuple[asyncio.StreamReader, Call, asyncio.Task]:
    """A paced link (share 0.5) running, whose process then spent ``cpu_s`` of CPU with no wall time passing."""
    clocks = Clocks()
    reader, link, call = open_link(clocks.pacer(0.5))
    run = asyncio.create_task(link.run())
    await asyncio.sleep(0)  # the link runs: the pacer counts from here
    clocks.cpu = cpu_s
    return reader, call, run


async def stop(reader: asyncio.StreamReader, run: asyncio.Task) -> None:
    reader.feed_data(pack(("stop", 0.0)))
    await run


def test_steps_held_back_reach_a_stream_as_one_take_in_order_after_the_first_token():
    async def main() -> list[list]:
        reader, call, run = await over_share(0.25)  # the last hand-over cost 250 ms of CPU: hold for 500 ms
        for outputs in STEPS:  # each read by the link before the next comes
            feed(reader, outputs)
            await asyncio.sleep(0.01)
        takes = [taken(await call.outbox.take()), taken(await call.outbox.take())]
        await stop(reader, run)
        return takes

    # The first token is never held; the two steps after it come as one take, once the hold is over.
    assert asyncio.run(main()) == [[([1], None)], [([2], None), ([3], FinishReason.LENGTH)]]


@pytest.mark.parametrize("paced", [False, True])
def test_steps_go_at_once_without_a_pacer_or_within_the_share(paced: bool):
    async def main() -> list[list]:
        reader, link, call = open_link(Clocks().pacer(0.5) if paced else None)
        run = asyncio.create_task(link.run())
        takes = []
        for outputs in STEPS:
            feed(reader, outputs)
            takes.append(taken(await call.outbox.take()))
        await stop(reader, run)
        return takes

    assert asyncio.run(main()) == [[([1], None)], [([2], None)], [([3], FinishReason.LENGTH)]]


def test_outputs_held_at_the_stop_still_reach_their_stream():
    async def main() -> list[tuple]:
        reader, call, run = await over_share(100.0)  # held far longer than the test
        feed(reader, [token(6)])
        first = taken(await asyncio.wait_for(call.outbox.take(), timeout=5))
        feed(reader, [token(7), token(8, FinishReason.STOP)])
        take = asyncio.create_task(call.outbox.take())
        await asyncio.sleep(0.01)
        assert not take.done(), "the outputs were not held"
        await stop(reader, run)
        return [first, taken(await take)]

    assert asyncio.run(main()) == [[([6], None)], [([7], None), ([8], FinishReason.STOP)]]


def test_the_cpu_the_process_spent_starting_holds_nothing_back():
    async def main() -> list[tuple]:
        clocks = Clocks()
        reader, link, call = open_link(clocks.pacer(0.5))
        clocks.cpu = 100.0  # starting the servers, before the link runs
        run = asyncio.create_task(link.run())
        feed(reader, [token(1)])
        first = taken(await asyncio.wait_for(call.outbox.take(), timeout=5))
        await stop(reader, run)
        return first

    assert asyncio.run(main()) == [([1], None)]


def test_a_requests_first_outputs_go_at_once_while_later_ones_are_held():
    async def main() -> tuple[list, bool]:
        reader, call, run = await over_share(100.0)  # everything but a first token is held
        feed(reader, [token(1), token(2)])  # the request's first frame (two choices' worth, say): both at once
        first = taken(await asyncio.wait_for(call.outbox.take(), timeout=5))
        feed(reader, [token(3)])
        take = asyncio.create_task(call.outbox.take())
        await asyncio.sleep(0.01)
        held = not take.done()
        await stop(reader, run)
        await take
        return first, held

    assert asyncio.run(main()) == ([([1], None), ([2], None)], True)


def test_the_reading_is_what_a_held_hand_over_gave_each_stream_as_a_power_of_two():
    clocks = Clocks()
    reading = PacedReading(settle_s=0.25, clock=lambda: clocks.wall)
    assert reading.handed_on(False, 256, 256) is None  # nothing held, and nothing was: 1 stands
    assert reading.handed_on(True, 256 * 13, 256) == 8  # 13 tokens each: 8 at a time
    assert reading.handed_on(True, 256 * 9, 256) is None
    assert reading.handed_on(True, 256 * 5, 256) is None  # under 8 but not under half of it: kept
    assert reading.handed_on(True, 256 * 3, 256) == 2
    assert reading.handed_on(True, 256 * 40, 256) == 32
    assert reading.value == 32


def test_the_reading_goes_back_to_one_once_outputs_have_gone_at_once_for_a_while():
    clocks = Clocks()
    reading = PacedReading(settle_s=0.25, clock=lambda: clocks.wall)
    assert reading.handed_on(True, 64, 4) == 16
    clocks.wall = 0.2
    assert reading.handed_on(False, 4, 4) is None  # at once, but held 200 ms ago
    clocks.wall = 0.3
    assert reading.handed_on(False, 4, 4) == 1
    assert reading.handed_on(False, 4, 4) is None


def frames_sent(sent: Sent) -> list[tuple]:
    """The frames a link wrote to the scheduler, in order."""
    frames, data = [], bytes(sent.data)
    while data:
        size = HEADER.unpack(data[:HEADER.size])[0]
        frames.append(pickle.loads(data[HEADER.size:HEADER.size + size]))
        data = data[HEADER.size + size:]
    return frames


def test_a_paced_link_tells_the_scheduler_what_each_stream_took_at_a_time():
    async def main() -> tuple[list, list]:
        clocks = Clocks()
        reader = asyncio.StreamReader()
        sent = Sent()
        link = Link(reader, sent, clocks.pacer(0.5))  # type: ignore[arg-type]
        calls = [link.calls.setdefault(key, Call(1)) for key in (0, 1)]
        run = asyncio.create_task(link.run())
        await asyncio.sleep(0)
        for step in range(6):  # the first step goes at once; the CPU spent then holds the next five for 40 ms
            reader.feed_data(pack(("outputs", encode_outputs([(key, token(step)) for key in (0, 1)]))))
            await asyncio.sleep(0)
            clocks.cpu = 0.02
        read = []
        for call in calls:
            read.append([])
            while len(read[-1]) < 6:
                read[-1] += taken(await asyncio.wait_for(call.outbox.take(), timeout=5))
        await stop(reader, run)
        return read, [frame for frame in frames_sent(sent) if frame[0] == "reading"]

    read, readings = asyncio.run(main())
    assert read == [[([step], None) for step in range(6)]] * 2
    assert readings == [("reading", 4)]  # 5 tokens each in the held hand-over
