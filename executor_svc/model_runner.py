"""Owns the model and its paged KV cache; turns a step's scheduled chunks into one forward pass.

A step's chunks become one packed batch: their tokens, positions, cache slots
and per-request lengths, built with a few tensor ops (no Python loop over the
context). Only rows whose chunk reaches its request's last token get logits,
which the sampler turns into tokens. Under tensor parallelism rank 0 prepares
the batch and broadcasts it; every rank runs the same forward on its shards.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from executor_svc import kernel_probe
from executor_svc.attention import get_backend
from executor_svc.attention.base import AttentionMetadata
from executor_svc.config import DEFAULT_CPU_KV_CACHE_BYTES, ExecutorOptions, ModelConfig, UnsupportedModel
from executor_svc.constraints import GrammarConstraints
from executor_svc.distributed import all_reduce_min, broadcast_object, init_group, tp_rank, tp_size
from executor_svc.kernel_choice import ALL_C
from executor_svc.loader import load_model
from executor_svc.malloc import keep_heap_memory
from executor_svc.prompt_logprobs import ScoredRun, prompt_logprobs, score_rows
from executor_svc.requests import RequestState, ScheduledChunk
from executor_svc.sampler import Sampler, SamplerOutput
from executor_svc.values import PromptLogprobs, SamplingSettings

log = logging.getLogger("nanoserve.executor")


@dataclass
class ModelInput:
    """One step's packed batch; built on CPU by rank 0 and broadcast under tensor parallelism."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Rows of the packed batch whose logits are sampled (the last token of each sampling chunk).
    logits_indices: torch.Tensor
    # Rows scored for prompt logprobs (``prompt_logprobs.score_rows``); their logits follow the sampled ones'.
    prompt_rows: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    # (row, request, position) of input tokens still being sampled by the step before when this was packed.
    pending: list[tuple[int, RequestState, int]] = field(default_factory=list)

    def fill_pending(self) -> None:
        """Put in the tokens the step before sampled; call it once that step has run (its tokens recorded).

        Written through numpy into the (CPU) tensor's memory: it is on the accelerator's path, and at 256 rows
        this takes 8 us against 27 us through ``torch.tensor`` and a copy (W5, ``bench.overlap``)."""
        if self.pending:
            ids = self.input_ids.numpy()
            tokens = [state.token_ids[pos] for _, state, pos in self.pending]
            if len(self.pending) == len(ids):  # a decode step after a decode step: every row
                ids[:] = tokens
            else:
                ids[[row for row, _, _ in self.pending]] = tokens
            self.pending = []

    def to(self, device: torch.device) -> ModelInput:
        if device.type == "cpu":
            return self
        meta = AttentionMetadata(**{
            name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for name, value in vars(self.meta).items()
        })
        return ModelInput(
            self.input_ids.to(device, non_blocking=True),
            self.positions.to(device, non_blocking=True),
            meta,
            self.logits_indices.to(device, non_blocking=True),
            self.prompt_rows.to(device, non_blocking=True),
        )


def rank_device(device: str, rank: int) -> torch.device:
    """A bare "cuda" means this rank's own GPU."""
    d = torch.device(device)
    return torch.device("cuda", rank) if d.type == "cuda" and d.index is None else d


def pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """[num_seqs, max_blocks] int32, padded with -1, from one flat array and a mask.

    Built in numpy and shared with torch: 113 us for 256 tables of 33 blocks against 426 us with torch ops,
    a third of a 256-sequence decode step's input (W5, bench.overlap).
    """
    lengths = np.fromiter(map(len, tables), np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, count=int(lengths.sum()))
    padded = np.full((len(tables), int(lengths.max())), -1, dtype=np.int32)
    padded[np.arange(padded.shape[1]) < lengths[:, None]] = flat
    return torch.from_numpy(padded)


def prepare_input(chunks: list[ScheduledChunk], block_size: int, prompt_rows: list[int] = ()) -> ModelInput:
    """Pack the chunks; a step where every chunk is one token runs as decode. ``prompt_rows`` are also scored.

    Packed while the step before still runs, a decode chunk's token is the one that step is sampling: it goes in
    ``pending`` for ``ModelInput.fill_pending``."""
    if not prompt_rows and all(c.num_tokens == 1 for c in chunks):
        return _decode_input(chunks, block_size)
    num_tokens = torch.tensor([c.num_tokens for c in chunks])
    starts = torch.tensor([c.start for c in chunks])
    ends = starts + num_tokens
    block_tables = pad_block_tables([c.state.block_table for c in chunks])
    token_ids = list(itertools.chain.from_iterable(c.state.token_ids[c.start : c.end] for c in chunks))
    pending = _pending_tokens(chunks, token_ids) if len(token_ids) < int(num_tokens.sum()) else []
    input_ids = torch.tensor(token_ids, dtype=torch.int64)
    is_decode = bool((num_tokens == 1).all())
    cu_q = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(num_tokens, 0, out=cu_q[1:])
    if is_decode:
        seq_index, positions = torch.arange(len(chunks)), starts
    else:
        seq_index = torch.repeat_interleave(torch.arange(len(chunks)), num_tokens)
        positions = torch.arange(int(cu_q[-1])) - (cu_q[:-1] - starts)[seq_index]
    slot_mapping = block_tables[seq_index, positions // block_size].long() * block_size + positions % block_size
    samples = torch.tensor([c.samples for c in chunks])
    logits_indices = (cu_q[1:] - 1)[samples]
    if is_decode:
        meta = AttentionMetadata(False, slot_mapping, block_tables, context_lens=ends.int())
    else:
        cu_k = torch.zeros(len(chunks) + 1, dtype=torch.int32)
        torch.cumsum(ends, 0, out=cu_k[1:])
        meta = AttentionMetadata(
            True,
            slot_mapping,
            block_tables,
            cu_seqlens_q=cu_q.int(),
            cu_seqlens_k=cu_k,
            max_seqlen_q=int(num_tokens.max()),
            max_seqlen_k=int(ends.max()),
            has_cached_context=bool((starts > 0).any()),
        )
    return ModelInput(input_ids, positions, meta, logits_indices, torch.tensor(prompt_rows, dtype=torch.int64), pending)


def _decode_input(chunks: list[ScheduledChunk], block_size: int) -> ModelInput:
    """``prepare_input`` for one token per chunk, in numpy: at 256 chunks 125 us against 330 us with torch's small
    ops, and what is left runs beside the step before (W5, ``bench.overlap``)."""
    n = len(chunks)
    starts = np.fromiter([c.start for c in chunks], np.int64, count=n)
    block_tables = pad_block_tables([c.state.block_table for c in chunks])
    slots = block_tables.numpy()[np.arange(n), starts // block_size].astype(np.int64) * block_size + starts % block_size
    token_ids, pending = [0] * n, []
    for i, c in enumerate(chunks):  # one read of each token list: the step before may append to it meanwhile
        ids = c.state.token_ids
        if c.start < len(ids):
            token_ids[i] = ids[c.start]
        else:
            pending.append((i, c.state, c.start))
    samples = np.flatnonzero(np.fromiter([c.samples for c in chunks], np.bool_, count=n))
    meta = AttentionMetadata(False, torch.from_numpy(slots), block_tables,
                             context_lens=torch.from_numpy((starts + 1).astype(np.int32)))
    return ModelInput(torch.tensor(token_ids, dtype=torch.int64), torch.from_numpy(starts), meta,
                      torch.from_numpy(samples), torch.empty(0, dtype=torch.int64), pending)


def _pending_tokens(chunks: list[ScheduledChunk], token_ids: list[int]) -> list[tuple[int, RequestState, int]]:
    """Rebuild ``token_ids`` with a 0 for each token not sampled yet; return where those go."""
    token_ids.clear()
    pending = []
    for chunk in chunks:
        known = chunk.state.token_ids[chunk.start : chunk.end]
        missing = range(chunk.start + len(known), chunk.end)
        token_ids += known
        pending += [(len(token_ids) + i, chunk.state, pos) for i, pos in enumerate(missing)]
        token_ids += [0] * len(missing)
    return pending


class PreparedInput(NamedTuple):
    model_input: ModelInput
    runs: list[ScoredRun]


class ModelRunner:
    def __init__(self, folder: str | Path, options: ExecutorOptions) -> None:
        self.options = options
        self.config = ModelConfig.from_folder(folder)
        self.config.check_tensor_parallel(tp_size())
        self.device = rank_device(options.resolved_device(), tp_rank())
        self.dtype = getattr(torch, options.resolved_dtype())
        if self.device.type == "cpu":
            # Ranks on one CPU share its cores instead of each taking all of them.
            torch.set_num_threads(options.threads or max(1, torch.get_num_threads() // tp_size()))
            keep_heap_memory()
        self.max_model_len = options.max_model_len or self.config.max_position_embeddings
        if self.max_model_len > self.config.max_position_embeddings:
            raise UnsupportedModel(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.config.max_position_embeddings}"
            )
        self.block_size = options.block_size
        self.backend = get_backend(options.attention_backend, self.device)
        on_cpu = self.device.type == "cpu"
        kernels_cache = kernel_probe.choice_cache(self._kernel_shape()) if on_cpu else None
        known = kernel_probe.known_choice(options.cpu_kernels, kernels_cache) if on_cpu else ALL_C
        self.model = load_model(folder, self.config, self.backend, self.device, self.dtype, known)
        self.graphs = None  # before the CUDA memory profile, whose forward runs eagerly
        self.num_blocks = self._allocate_kv_cache()
        self.kernels = ALL_C
        if on_cpu:
            self.kernels = kernel_probe.settle(self.model, self.backend, known, options.cpu_kernels, kernels_cache,
                                               self.dtype)
        self.sampler = Sampler(eos_token_ids=self.config.eos_token_ids)
        self.constraints = GrammarConstraints(Path(folder) / "tokenizer.json", self.config.vocab_size,
                                              self.config.eos_token_ids)
        if self.device.type == "cuda" and not options.enforce_eager:
            self.graphs = DecodeGraphs.capture(self.model, self.max_model_len, self.block_size, self.device)

    def _kernel_shape(self) -> tuple[object, ...]:
        """What the CPU kernel choice depends on besides the machine: it is cached under these."""
        c = self.config
        return (self.dtype, torch.get_num_threads(), tp_size(), self.backend.name, self.block_size, c.hidden_size,
                c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size)

    def _block_bytes(self) -> int:
        c = self.config
        per_token = 2 * c.num_layers * (c.num_kv_heads // tp_size()) * c.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _kv_budget(self) -> int:
        if self.options.kv_cache_memory:
            return self.options.kv_cache_memory
        if self.device.type == "cpu":
            return DEFAULT_CPU_KV_CACHE_BYTES
        return self._profile_free_cuda_memory()

    @torch.inference_mode()
    def _profile_free_cuda_memory(self) -> int:
        """Free memory share left for the KV cache after a forward over a long prefill."""
        num_tokens = min(self.max_model_len, 8192)
        num_blocks = -(-num_tokens // self.block_size)
        self._attach_kv_cache(num_blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        state = RequestState(0, [0] * num_tokens, list(range(num_blocks)), 0, SamplingSettings(), num_tokens)
        self.execute(prepare_input([ScheduledChunk(state, 0, num_tokens)], self.block_size))
        self._attach_kv_cache(0)
        torch.cuda.synchronize(self.device)
        stats = torch.cuda.memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        activations = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        return int(total * self.options.gpu_memory_utilization - (total - free) - activations)

    def _attach_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        shape = (2, c.num_layers, num_blocks, self.block_size, c.num_kv_heads // tp_size(), c.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _allocate_kv_cache(self) -> int:
        num_blocks = all_reduce_min(self._kv_budget() // self._block_bytes(), self.device)
        if num_blocks < 1:
            raise MemoryError(f"no memory left for a single KV block of {self._block_bytes()} bytes")
        self._attach_kv_cache(num_blocks)
        return num_blocks

    @torch.inference_mode()
    def execute(self, model_input: ModelInput) -> torch.Tensor:
        """Forward pass on this rank; logits [sampled rows, vocab] (identical on every rank)."""
        inp = model_input.to(self.device)
        hidden = self.graphs.run(inp) if self.graphs is not None and not inp.meta.is_prefill else None
        if hidden is None:
            hidden = self.model(inp.input_ids, inp.positions, inp.meta)
        rows = torch.cat([inp.logits_indices, inp.prompt_rows]) if len(inp.prompt_rows) else inp.logits_indices
        return self.model.compute_logits(hidden[rows])

    def prepare(self, chunks: list[ScheduledChunk]) -> PreparedInput:
        """Rank 0: the step's packed input and the prompt-logprob runs it scores (``run`` makes it if not given)."""
        rows, runs = score_rows(chunks, list(itertools.accumulate((c.num_tokens for c in chunks[:-1]), initial=0)))
        return PreparedInput(prepare_input(chunks, self.block_size, rows), runs)

    def run(
        self, chunks: list[ScheduledChunk], prepared: PreparedInput | None = None
    ) -> tuple[SamplerOutput, list[PromptLogprobs], float, float]:
        """Rank 0: forward + sample; returns the sampler output, the prompt logprobs asked for, and the forward
        and sample milliseconds."""
        t0 = time.perf_counter()
        model_input, runs = prepared or self.prepare(chunks)
        model_input.fill_pending()
        if tp_size() > 1:
            broadcast_object(model_input)
        logits = self.execute(model_input)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        scored = prompt_logprobs(logits[len(model_input.logits_indices):], runs) if runs else []
        logits = logits[: len(model_input.logits_indices)]
        sampled = [c for c in chunks if c.samples]
        states = [c.state for c in sampled]
        constrained = self.constraints.mask(logits, states)
        output = self.sampler(logits, [s.sampling for s in states], [c.end for c in sampled], states)
        if constrained:
            self.constraints.advance(states, constrained, output.token_ids)
        t2 = time.perf_counter()
        return output, scored, (t1 - t0) * 1e3, (t2 - t1) * 1e3

    def stop_workers(self) -> None:
        """Rank 0: release the other ranks from their step loop."""
        if tp_size() > 1:
            broadcast_object(None)


def worker_main(rank: int, world_size: int, init_method: str, folder: str, options: ExecutorOptions) -> None:
    """A tensor-parallel rank > 0: load its shards, then run every step rank 0 broadcasts."""
    init_group(rank, world_size, init_method, rank_device(options.resolved_device(), rank))
    runner = ModelRunner(folder, options)
    while (model_input := broadcast_object(None)) is not None:
        runner.execute(model_input)


class DecodeGraphs:
    """CUDA graphs of the decode forward for a ladder of batch sizes; other batches run eagerly.

    A batch is padded to the next captured size: padded rows store to slot -1
    (which backends skip) and attend to one token of block 0; their outputs are
    dropped. A backend whose decode cannot be captured (host syncs) leaves the
    runner eager, with a log line saying so.
    """

    SIZES = (1, 2, 4, 8, *range(16, 257, 16))

    def __init__(self, model: torch.nn.Module, max_model_len: int, block_size: int, device: torch.device) -> None:
        n = self.SIZES[-1]
        self.model = model
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, -(-max_model_len // block_size)), dtype=torch.int32, device=device)
        self.outputs = torch.empty(n, model.config.hidden_size, dtype=model.lm_head.weight.dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    @classmethod
    def capture(
        cls, model: torch.nn.Module, max_model_len: int, block_size: int, device: torch.device
    ) -> DecodeGraphs | None:
        graphs = cls(model, max_model_len, block_size, device)
        try:
            graphs._capture_all()
        except RuntimeError as e:
            log.warning("decode runs eagerly: CUDA graph capture failed (%s)", e)
            return None
        return graphs

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            False, self.slot_mapping[:size], self.block_tables[:size], context_lens=self.context_lens[:size]
        )
        return self.model(self.input_ids[:size], self.positions[:size], meta)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.SIZES):
            self._forward(size)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[:size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, inp: ModelInput) -> torch.Tensor | None:
        """Replay the graph for this decode batch; None when no captured size fits it."""
        n = inp.input_ids.shape[0]
        size = next((s for s in self.SIZES if s >= n), None)
        width = inp.meta.block_tables.shape[1]
        if size is None or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(inp.input_ids)
        self.positions[:n].copy_(inp.positions)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n].copy_(inp.meta.slot_mapping)
        self.context_lens.fill_(1)
        self.context_lens[:n].copy_(inp.meta.context_lens)
        self.block_tables.zero_()
        self.block_tables[:n, :width].copy_(inp.meta.block_tables.clamp_min(0))
        self.graphs[size].replay()
        return self.outputs[:n]
