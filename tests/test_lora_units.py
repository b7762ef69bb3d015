"""LoRA bookkeeping without a model: the scheduler's adapter names and ids across an executor restart, the block
hashes of adapters, --max-loras admission, and the executor's --lora-modules flag."""

from __future__ import annotations

import dataclasses
from argparse import ArgumentTypeError

import pytest

from common.executor import LoraRefused
from common.step import ExecutorInfo, LoraAdapterInfo
from executor_svc.__main__ import build_parser, options_from_args
from executor_svc.fakes.shadow import ShadowExecutor
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.request import PreparedRequest
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import FinishReason, Sequence
from scheduler_svc.engine.adapters import Adapters
from scheduler_svc.engine.admission import Admission, QueueLimits
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.live_requests import LiveRequests, RequestHandle
from scheduler_svc.engine.metrics import Metrics
from tests.conftest import assert_all_blocks_free

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class AdapterExecutor:
    """The executor's adapter calls, as the scheduler sees them: ids never reused, an unload refused while the
    executor still holds a request through the adapter (``holding``), a load from the folder ``refuse`` refused."""

    def __init__(self, first_id: int = 1, refuse: str = "") -> None:
        self.ids = iter(range(first_id, 100))
        self.held: dict[str, LoraAdapterInfo] = {}
        self.holding: set[int] = set()
        self.refuse = refuse

    def load_lora(self, name: str, path: str) -> LoraAdapterInfo:
        if path == self.refuse:
            raise LoraRefused(f"{path} has no adapter_config.json")
        adapter = self.held[name] = LoraAdapterInfo(next(self.ids), name, path, 4)
        return adapter

    def unload_lora(self, name: str) -> LoraAdapterInfo:
        if self.held[name].lora_id in self.holding:
            raise LoraRefused(f"adapter {name!r} serves running requests", "FAILED_PRECONDITION")
        return self.held.pop(name)


def restarted(executor: AdapterExecutor, started_with: list[LoraAdapterInfo]) -> ExecutorInfo:
    executor.held = {a.name: a for a in started_with}
    return ExecutorInfo(lora_adapters=tuple(started_with), runtime_lora=True, tensor_parallel_size=1)


def test_a_restarted_executor_renumbers_adapters_loads_run_time_ones_again_and_requests_follow_by_name() -> None:
    executor = AdapterExecutor(first_id=2)
    adapters = Adapters([LoraAdapterInfo(1, "a1", "/a1")], "base", runtime=True)
    for name in ("a2", "a3"):
        adapters.load(executor, name, f"/{name}")
    assert (adapters.lora_id(None), adapters.lora_id("base"), adapters.lora_id("a2")) == (0, 0, 2)
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'a4'") as refused:
        adapters.lora_id("a4")
    assert refused.value.field == "lora"
    seqs = [Sequence(i, [5, 6, 7], PARAMS, 4, lora_id=lora_id) for i, lora_id in enumerate((1, 2, 3, 0))]
    # The new executor was started with a1 only; a2 and a3 were loaded at run time, and a3's folder is gone since.
    executor = AdapterExecutor(first_id=2, refuse="/a3")
    lost = adapters.renumber(executor, seqs, restarted(executor, [LoraAdapterInfo(1, "a1", "/a1")]))
    assert lost == [seqs[2]]
    assert adapters.names() == ["a1", "a2"] and sorted(executor.held) == ["a1", "a2"]
    assert [seq.lora_id for seq in (seqs[0], seqs[1], seqs[3])] == [1, 2, 0]


def test_an_unload_refuses_new_requests_at_once_and_retires_once_the_last_request_through_it_is_dropped() -> None:
    executor = AdapterExecutor()
    adapters = Adapters([], "base", runtime=True)
    a1 = adapters.load(executor, "a1", "/a1")
    live = [Sequence(0, [5, 6, 7], PARAMS, 4, lora_id=a1.lora_id)]
    assert adapters.unload("a1") == a1
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'a1'"):
        adapters.lora_id("a1")
    with pytest.raises(LoraRefused, match="being unloaded") as busy:
        adapters.load(executor, "a1", "/a1")
    assert busy.value.code == "FAILED_PRECONDITION"
    with pytest.raises(LoraRefused) as missing:
        adapters.unload("a1")
    assert missing.value.code == "NOT_FOUND"
    adapters.retire(executor, live)  # a request still runs through it
    assert "a1" in executor.held and adapters.name_of(a1.lora_id) == "a1"
    executor.holding.add(a1.lora_id)
    adapters.retire(executor, [])  # it ended, but the executor holds it until the next plan drops it
    assert "a1" in executor.held and adapters.retiring
    executor.holding.clear()
    adapters.retire(executor, [])
    assert not executor.held and not adapters.retiring
    assert adapters.load(executor, "a1", "/a1").lora_id == 2


def test_an_unload_is_refused_where_the_executor_cannot_unload() -> None:
    adapters = Adapters([LoraAdapterInfo(1, "a1", "/a1")], "base", runtime=False)
    with pytest.raises(LoraRefused, match="--runtime-lora") as refused:
        adapters.unload("a1")
    assert refused.value.code == "FAILED_PRECONDITION" and adapters.lora_id("a1") == 1


def test_an_in_place_load_replaces_an_idle_adapter_and_keeps_it_when_the_replacement_does_not_fit() -> None:
    executor = AdapterExecutor()
    adapters = Adapters([], "base", runtime=True)
    a1 = adapters.load(executor, "a1", "/a1")
    busy = [Sequence(0, [5, 6, 7], PARAMS, 4, lora_id=a1.lora_id)]
    with pytest.raises(LoraRefused, match="replace it once they finish"):
        adapters.load(executor, "a1", "/a1-v2", busy, inplace=True)
    replaced = adapters.load(executor, "a1", "/a1-v2", [], inplace=True)
    assert (replaced.lora_id, replaced.path) == (2, "/a1-v2") and adapters.lora_id("a1") == 2
    executor.refuse = "/broken"
    with pytest.raises(LoraRefused, match="no adapter_config.json"):
        adapters.load(executor, "a1", "/broken", [], inplace=True)
    assert adapters.by_name["a1"].path == "/a1-v2" and executor.held["a1"].path == "/a1-v2"


def test_adapters_hash_the_same_tokens_apart() -> None:
    manager = BlockManager(16, 4)
    tokens = list(range(10, 23))
    first = Sequence(0, tokens, PARAMS, 4, lora_id=1)
    manager.allocate(first, manager.can_allocate(first))
    manager.hash_blocks(first, 0, len(tokens))
    assert manager.can_allocate(Sequence(1, tokens, PARAMS, 4, lora_id=1)) == 3  # the same adapter hits
    assert manager.can_allocate(Sequence(2, tokens, PARAMS, 4, lora_id=2)) == 0
    assert manager.can_allocate(Sequence(3, tokens, PARAMS, 4)) == 0
    manager.deallocate(first)
    assert_all_blocks_free(manager)


def test_max_loras_admits_in_arrival_order_and_the_head_waits_for_its_turn() -> None:
    scheduler = Scheduler(SchedulerConfig(max_loras=2), BlockManager(64, 4), {2}, 64)
    for seq_id, lora_id in enumerate((1, 2, 3, 1, 0)):
        scheduler.add(Sequence(seq_id, [5, 6, 7, 8, 9], PARAMS, 4, lora_id=lora_id))
    seqs, is_prefill = scheduler.schedule()
    # Adapter 3 would be a third: it waits at the head, and nothing behind it (adapter 1, the base model) overtakes it.
    assert is_prefill and [seq.lora_id for seq in seqs] == [1, 2]
    for seq in seqs:
        scheduler.finish(seq, FinishReason.LENGTH)
    seqs, _ = scheduler.schedule()
    assert [seq.lora_id for seq in seqs] == [3, 1, 0]
    for seq in seqs:
        scheduler.finish(seq, FinishReason.LENGTH)
    assert_all_blocks_free(scheduler.block_manager)


def test_lora_modules_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["--lora-modules", "a"])
    assert "an adapter is NAME=PATH, got 'a'" in capsys.readouterr().err
    with pytest.raises(ArgumentTypeError, match="'a' is given twice"):
        options_from_args(build_parser({}).parse_args(["--lora-modules", "a=/x", "a=/y"]))
    ok = options_from_args(build_parser({}).parse_args(["--lora-modules", "a=/x", "b=/y,c=/z"]))
    assert ok.lora_modules == {"a": "/x", "b": "/y", "c": "/z"}


def test_a_restart_makes_the_replacements_and_unloads_made_since_again() -> None:
    started = LoraAdapterInfo(1, "a1", "/a1-v1", 4)
    executor = AdapterExecutor(first_id=2)
    executor.held = {"a1": started, "a2": LoraAdapterInfo(9, "a2", "/a2", 4)}
    adapters = Adapters([started, executor.held["a2"]], "base", runtime=True)
    adapters.load(executor, "a1", "/a1-v2", inplace=True)
    adapters.unload("a2")
    adapters.retire(executor, [])
    executor = AdapterExecutor(first_id=2)  # started with --lora-modules a1=/a1-v1 a2=/a2, as before
    adapters.renumber(executor, [], restarted(executor, [started, LoraAdapterInfo(2, "a2", "/a2", 4)]))
    assert adapters.names() == ["a1"] and adapters.by_name["a1"].path == "/a1-v2"
    assert {name: a.path for name, a in executor.held.items()} == {"a1": "/a1-v2"}


def test_the_other_choices_of_a_request_run_through_its_adapter_unloaded_while_the_first_computed_its_prompt() -> None:
    executor = ShadowExecutor()
    executor.info = dataclasses.replace(executor.info, lora_adapters=(LoraAdapterInfo(1, "a1", "/a1", 4),),
                                        runtime_lora=True)
    executor.table.lora_ids = frozenset({1})
    unloads = []
    executor.unload_lora = lambda name: unloads.append(name) or LoraAdapterInfo(1, "a1", "/a1", 4)
    engine = Engine(executor)
    live = LiveRequests(Admission(QueueLimits()), Metrics("m", lambda: None, lambda: engine.info))
    params = SamplingParams(temperature=1.0, max_tokens=4, n=2, ignore_eos=True)
    handle = RequestHandle(PreparedRequest("r", list(range(3, 40)), params, lora="a1"), None, 0.0)
    live.start(engine, handle, 0, None)
    engine.unload_lora("a1")
    adapter_of = {}
    while engine.has_unfinished() or engine.has_drops_to_send():
        outputs = engine.step()
        adapter_of.update({out.seq.seq_id: out.seq.lora_id for out in outputs})
        live.process(engine, outputs, None)  # choice 1 starts here, once choice 0's prompt is computed
    assert list(adapter_of.values()) == [1, 1], "both choices, through a1"
    assert unloads == ["a1"] and not engine.adapters.retiring
    assert engine.adapters.name_of(1) == "a1", "a retired adapter's cache events still name it"
    assert_all_blocks_free(engine.block_manager)
