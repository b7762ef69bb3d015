"""The greedy path's argmax (``sampler.greedy_tokens``): on the CPU the C kernel, whose ids are torch.argmax's."""

from __future__ import annotations

import pytest
import torch

from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.sample.sampler import greedy_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_are_torch_argmax_ties_nans_and_infinities_included(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 49152 + 7, generator=gen).to(dtype)
    logits[1, 300] = logits[1, 9000] = logits[1, 40000] = 50  # a tie: the lowest id
    logits[2] = float("-inf")  # every token masked: id 0
    logits[3, 70] = float("inf")
    logits[4, 123], logits[4, 5000] = float("nan"), 1e4  # a NaN wins, as in torch
    logits[5, -1] = 60  # the last id, past the last whole chunk
    logits[6] = 3.0  # all equal
    expected = logits.float().argmax(dim=-1).tolist()
    assert greedy_tokens(logits) == expected
    assert expected[1] == 300 and expected[2] == 0 and expected[4] == 123 and expected[5] == logits.shape[1] - 1
    wide = torch.zeros(12, logits.shape[1] + 5, dtype=dtype)
    wide[:, 2 : 2 + logits.shape[1]] = logits
    assert greedy_tokens(wide[:, 2 : 2 + logits.shape[1]]) == expected  # rows strided in a wider tensor
    assert greedy_tokens(logits[:1, :9]) == logits[:1, :9].float().argmax(dim=-1).tolist()  # one small row


def test_other_dtypes_and_no_kernel_take_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(3, 100).half()
    assert greedy_tokens(logits) == logits.float().argmax(dim=-1).tolist()
    monkeypatch.setattr(cpu_kernels, "kernel_library", lambda *flags: None)
    assert greedy_tokens(logits.float()) == logits.float().argmax(dim=-1).tolist()
