"""Vocab-parallel token embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.layers.linear import LinearBase
from executor_svc.runtime.distributed import all_gather_last_dim, all_reduce, divide, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.shard_size = divide(vocab_size, tp_size())
        self.vocab_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)

    def load(self, param_name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        self.weight.data.copy_(loaded.narrow(0, self.vocab_start, self.shard_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * mine.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding, LinearBase):
    """Logits of the given hidden rows, gathered over the ranks' vocabulary slices."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(self.matmul(hidden, None))
