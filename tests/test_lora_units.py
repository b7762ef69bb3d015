"""LoRA bookkeeping without a model: the scheduler's adapter names and ids across an executor restart, the block
hashes of adapters, --max-loras admission, and the executor's --lora-modules flag."""

from __future__ import annotations

from argparse import ArgumentTypeError

import pytest

from common.step import LoraAdapterInfo
from executor_svc.__main__ import build_parser, options_from_args
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.sequence import FinishReason, Sequence
from scheduler_svc.engine.adapters import Adapters
from tests.conftest import assert_all_blocks_free

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_a_restarted_executor_renumbers_adapters_and_requests_follow_by_name() -> None:
    adapters = Adapters([LoraAdapterInfo(1, "a1"), LoraAdapterInfo(2, "a2")], "base")
    assert (adapters.lora_id(None), adapters.lora_id("base"), adapters.lora_id("a2")) == (0, 0, 2)
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'a3'") as refused:
        adapters.lora_id("a3")
    assert refused.value.field == "lora"
    seqs = [Sequence(i, [5, 6, 7], PARAMS, 4, lora_id=lora_id) for i, lora_id in enumerate((1, 2, 0))]
    lost = adapters.renumber(seqs, [LoraAdapterInfo(1, "a2")])  # a1 was loaded at run time: gone with the executor
    assert lost == [seqs[0]]
    assert [seq.lora_id for seq in seqs[1:]] == [1, 0]


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
