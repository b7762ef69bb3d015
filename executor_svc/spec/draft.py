"""The executor's draft model: it proposes a verification row's tokens when the plan leaves them to it.

Two kinds (docs/executor.md):

- a model of its own (``--speculative-model FOLDER``), with the target's tokenizer and vocabulary. Its paged KV
  cache has its own tensors and the target's block ids and block tables, and is kept in step by running it over
  every input the target runs (``mirror``: prefill chunks, decode rows and verification rows alike), so every
  token the target has computed, prefix-cache hits included, is computed in the draft too;
- an early exit of the target (``--speculative-draft-layers N``): its first N decoder layers, then its final norm
  and LM head. Those layers' weights are the target's and, fed the same tokens, so are their keys and values: it
  reads and writes the target's own KV cache for them, and needs neither memory nor a mirror of its own.

``propose`` makes k tokens for each row in k decode passes batched across rows. Its draws use the sampler with the
row's temperature, top-k/p, min-p and seed at the position the target samples the same token at, so a seeded row's
proposal and the target's draw share their noise (a coupled draw: more acceptance, never a different output; the
verification alone decides what is emitted).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from common.step import SamplingSettings
from executor_svc.attention.base import AttentionBackend, AttentionMetadata
from executor_svc.core.request_table import ScheduledChunk
from executor_svc.cpu.choice import KernelChoice
from executor_svc.runtime.config import ExecutorOptions, ModelConfig, UnsupportedModel
from executor_svc.runtime.loader import load_model
from executor_svc.runtime.model_input import ModelInput, pad_block_tables
from executor_svc.runtime.registry import resolve_model
from executor_svc.sample.sampler import Sampler


class DraftModel:
    """Proposes tokens; holds the draft's model and, for a model of its own, its KV cache."""

    def __init__(self, model_id: str, model: nn.Module, num_layers: int, own_cache: bool) -> None:
        self.model_id = model_id
        self.model = model  # a LlamaForCausalLM-like module: ``.model`` (embed, layers, norm) and ``compute_logits``
        self.num_layers = num_layers
        self.own_cache = own_cache
        self.kv_cache: torch.Tensor | None = None
        self.sampler = Sampler()

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """The KV bytes a block costs the draft beside the target's (0 for an early exit: it shares the target's)."""
        if not self.own_cache:
            return 0
        c = self.model.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype.itemsize * block_size

    def attach_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        if not self.own_cache:
            return
        c = self.model.config
        shape = (2, c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def mirror(self, inp: ModelInput) -> None:
        """Compute the target's step input in the draft's own cache (nothing for an early exit)."""
        if self.own_cache and self.kv_cache is not None:
            self.model(inp.input_ids, inp.positions, inp.meta)

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.own_cache:
            return self.model.compute_logits(self.model(input_ids, positions, meta))
        body = self.model.model
        hidden, residual = body.embed_tokens(input_ids), None
        for layer in body.layers[: self.num_layers]:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = body.norm(hidden, residual)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def propose(self, chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> None:
        """Fill ``drafts`` of every verification chunk that has none: pass i feeds each row its token at position
        ``start + i`` (its last token, then its proposals) and draws the next."""
        rows = [c for c in chunks if c.num_drafts and c.drafts is None]
        for chunk in rows:
            chunk.drafts = []
        for i in range(max((c.num_drafts for c in rows), default=0)):
            live = [c for c in rows if c.num_drafts > i]
            n = len(live)
            positions = np.fromiter((c.start + i for c in live), np.int64, count=n)
            tokens = [c.drafts[-1] if i else c.state.token_ids[c.start] for c in live]
            tables = pad_block_tables([c.state.block_table for c in live])
            slots = tables.numpy()[np.arange(n), positions // block_size].astype(np.int64) * block_size
            meta = AttentionMetadata(False, torch.from_numpy(slots + positions % block_size), tables,
                                     context_lens=torch.from_numpy((positions + 1).astype(np.int32)))
            logits = self._logits(torch.tensor(tokens, device=device), torch.from_numpy(positions).to(device),
                                  meta.to(device))
            settings = [proposal_settings(c.state.sampling) for c in live]
            drawn = self.sampler(logits, settings, (positions + 1).tolist()).token_ids
            for chunk, token_id in zip(live, drawn, strict=True):
                chunk.drafts.append(token_id)


def proposal_settings(sampling: SamplingSettings) -> SamplingSettings:
    """What a draft draw uses of a row's settings: the distribution's shape and the seed (no processors, grammar or
    logprobs: a proposal they would change is rejected by the verification, which applies them)."""
    return SamplingSettings(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.seed)


def early_exit_draft(model_id: str, target: nn.Module, num_layers: int) -> DraftModel:
    total = len(target.model.layers)
    if not 1 <= num_layers < total:
        raise UnsupportedModel(f"--speculative-draft-layers must be in [1, {total - 1}] for a model of {total} "
                               f"decoder layers, got {num_layers}")
    return DraftModel(f"{model_id}:first-{num_layers}-layers", target, num_layers, own_cache=False)


def check_same_vocabulary(target_folder: Path, draft_folder: Path, target: ModelConfig, draft: ModelConfig,
                          max_model_len: int) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's, or that cannot reach its length."""
    if draft.vocab_size != target.vocab_size:
        raise UnsupportedModel(f"the draft model's vocabulary has {draft.vocab_size} tokens, the served model's "
                               f"{target.vocab_size}: a draft model needs the same tokenizer")
    if draft.max_position_embeddings < max_model_len:
        raise UnsupportedModel(f"the draft model reaches {draft.max_position_embeddings} positions, fewer than the "
                               f"served max_model_len {max_model_len}")
    vocabularies = [_vocabulary(folder / "tokenizer.json") for folder in (target_folder, draft_folder)]
    if None not in vocabularies and vocabularies[0] != vocabularies[1]:
        raise UnsupportedModel(f"{draft_folder}/tokenizer.json maps tokens to other ids than the served model's: a "
                               "draft model needs the same tokenizer")


def _vocabulary(path: Path) -> tuple[object, object] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
    return (data.get("model") or {}).get("vocab"), added


def check_draft_options(options: ExecutorOptions) -> bool:
    """Whether the options ask for a draft model; refused before any model or worker starts where it cannot run."""
    if options.speculative_model and options.speculative_draft_layers:
        raise UnsupportedModel("give --speculative-model or --speculative-draft-layers, not both")
    if not (options.speculative_model or options.speculative_draft_layers):
        return False
    if options.tensor_parallel_size > 1:
        raise UnsupportedModel("a draft model runs with tensor-parallel size 1 only; serve without "
                               "--speculative-model/--speculative-draft-layers (n-gram proposals from the scheduler "
                               "still work)")
    return True


def build_draft(options: ExecutorOptions, target_folder: Path, target: nn.Module, backend: AttentionBackend,
                device: torch.device, dtype: torch.dtype, kernels: KernelChoice | None,
                max_model_len: int) -> DraftModel | None:
    """The draft model the options ask for, loaded (None: no speculative flag)."""
    if not check_draft_options(options):
        return None
    if options.speculative_draft_layers:
        return early_exit_draft(options.model, target, options.speculative_draft_layers)
    folder = resolve_model(options.speculative_model)
    config = ModelConfig.from_folder(folder)
    check_same_vocabulary(target_folder, folder, target.config, config, max_model_len)
    model = load_model(folder, config, backend, device, dtype, kernels)
    return DraftModel(options.speculative_model, model, config.num_layers, own_cache=True)
