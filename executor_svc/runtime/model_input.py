"""A step's packed batch: the tokens, positions, cache slots and per-request lengths of its chunks.

Built on the CPU with a few numpy and tensor ops (no Python loop over the context), often while the step
before still runs: the tokens that step is sampling are filled in at launch (``ModelInput.fill_pending``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from executor_svc.attention.base import AttentionMetadata, MixedSplit, to_device
from executor_svc.core.request_table import RequestState, ScheduledChunk


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
    # Rows of ``pending`` and, for each, the index of its token among the step before's sampled tokens (``link``).
    linked: tuple[np.ndarray, np.ndarray] | None = None
    # ``input_ids``' memory as numpy, taken when linked: just after a wait for the device the core runs cold, and
    # ``Tensor.numpy()`` is then slow enough to delay the launch (W5).
    ids: np.ndarray | None = None
    # Linked with every row pending and row i taking the step before's i-th token (a decode step after a decode step
    # of the same requests): ``fill_pending`` then assigns the tokens whole, with no index arrays. With
    # ``num_sampled``, the launch after a wait comes sooner and the accelerator idles less between steps (W5).
    linked_in_order: bool = False
    # Each row's adapter id (0: the base model), in packed order; None when no row has one (``executor_svc/lora``).
    lora_ids: torch.Tensor | None = None
    # A decode step whose every row samples, without logprobs, logits processors or a grammar (each needs the host:
    # the tokens recorded, or logprobs read): a device can sample it at launch and launch the step after it behind it
    # (``TableExecutor.samples_ahead``).
    samples_on_device: bool = False
    # ``len(logits_indices)``, counted when packed: a cold tensor's ``len`` is slow after a wait.
    num_sampled: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_sampled = len(self.logits_indices)

    def link(self, before: list[ScheduledChunk] | None) -> None:
        """Note where each pending token comes in the sampled tokens of ``before`` (the step before's chunks), so
        that ``fill_pending`` can take them from there before that step's tokens are recorded; not linked when
        some token is not found there (or ``before`` is None)."""
        if not self.pending:
            self.linked = (np.empty(0, np.int64), np.empty(0, np.int64))
            return
        if before is None:
            return
        index = {id(chunk.state): i for i, chunk in enumerate(before)}
        sources = []
        for _, state, pos in self.pending:  # the step before samples position ``end`` of each chunk that samples
            i = index.get(id(state))
            if i is None or before[i].end != pos:
                return
            sources.append(i)
        self.linked = np.fromiter((row for row, _, _ in self.pending), np.int64), np.array(sources, np.int64)
        self.ids = self.input_ids.numpy()
        # Pending rows ascend, so as many as the rows are every row, in order.
        self.linked_in_order = len(self.pending) == len(self.ids) == len(before) and sources == [*range(len(before))]

    def fill_pending(self, sampled_before: list[int] | None = None) -> None:
        """Put in the tokens the step before sampled: from ``sampled_before``, its tokens in order, where ``linked``;
        else from the requests, once that step's tokens are recorded.

        Written through numpy into the (CPU) tensor's memory: it is on the accelerator's path, and this is faster
        than ``torch.tensor`` and a copy (W5, ``bench.overlap``)."""
        if not self.pending:
            return
        ids = self.input_ids.numpy() if self.ids is None else self.ids
        if sampled_before is not None and self.linked_in_order:
            ids[:] = sampled_before
        elif sampled_before is not None:
            rows, sources = self.linked
            ids[rows] = np.asarray(sampled_before, np.int64)[sources]
        else:
            tokens = [state.token_ids[pos] for _, state, pos in self.pending]
            if len(self.pending) == len(ids):  # a decode step after a decode step: every row
                ids[:] = tokens
            else:
                ids[[row for row, _, _ in self.pending]] = tokens
        self.pending = []

    def fill_pending_from(self, input_ids: torch.Tensor, sampled_before: torch.Tensor) -> None:
        """``fill_pending`` on the device: the pending rows of ``input_ids`` (this input's copy there) take the step
        before's tokens from ``sampled_before`` (its sampled rows' tokens, there too), without a wait."""
        if not self.pending:
            return
        if self.linked_in_order:
            input_ids.copy_(sampled_before)
        else:
            rows, sources = (to_device(torch.from_numpy(a), input_ids.device, True) for a in self.linked)
            input_ids[rows] = sampled_before[sources]
        self.pending = []

    def to(self, device: torch.device, pinned: bool = False) -> ModelInput:
        """A copy on ``device``; ``pinned``: through page-locked memory, so that no copy waits for the steps the
        device still computes (a copy from pageable memory waits for the stream first)."""
        if device.type == "cpu":
            return self
        return ModelInput(
            to_device(self.input_ids, device, pinned),
            to_device(self.positions, device, pinned),
            self.meta.to(device, pinned),
            to_device(self.logits_indices, device, pinned),
            to_device(self.prompt_rows, device, pinned),
            lora_ids=self.lora_ids,
        )


def pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """[num_seqs, max_blocks] int32, padded with -1, from one flat array and a mask.

    Built in numpy and shared with torch: with torch ops this was a large share of a 256-sequence decode step's
    input (W5, bench.overlap).
    """
    lengths = np.fromiter(map(len, tables), np.int64, count=len(tables))
    flat = np.fromiter(itertools.chain.from_iterable(tables), np.int32, count=int(lengths.sum()))
    padded = np.full((len(tables), int(lengths.max())), -1, dtype=np.int32)
    padded[np.arange(padded.shape[1]) < lengths[:, None]] = flat
    return torch.from_numpy(padded)


class DecodeTables:
    """A decode step's padded block tables, made from the step before's: only rows whose table changed are written.

    From one decode step to the next most requests keep their table (a request gains a block every ``block_size``
    tokens), and rebuilding all of them was most of the executor's input preparation at 256 sequences and one step
    per plan (W5 ``api``). A row is reused when its state's ``table_version`` and length are those it was written
    with; versions are unique over all states, so a new request never matches an old one. The array handed out is
    never written again: a step may still read it while the next is prepared.
    """

    def __init__(self) -> None:
        self._last: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # versions, lengths, padded table

    def pad(self, states: list) -> torch.Tensor:
        n = len(states)
        versions = np.fromiter([s.table_version for s in states], np.int64, count=n)
        lengths = np.fromiter([len(s.block_table) for s in states], np.int64, count=n)
        last, width = self._last, int(lengths.max())
        if last is None or len(last[0]) != n or last[2].shape[1] > width:
            table = pad_block_tables([s.block_table for s in states]).numpy()
        else:
            old_versions, old_lengths, old = last
            if old.shape[1] == width:
                table = old.copy()
            else:
                table = np.full((n, width), -1, dtype=np.int32)
                table[:, : old.shape[1]] = old
            for i in np.flatnonzero((versions != old_versions) | (lengths != old_lengths)).tolist():
                row = states[i].block_table
                table[i, : len(row)] = row
                table[i, len(row) :] = -1
        self._last = (versions, lengths, table)
        return torch.from_numpy(table)


def prepare_input(chunks: list[ScheduledChunk], block_size: int, prompt_rows: list[int] = (),
                  tables: DecodeTables | None = None) -> ModelInput:
    """Pack the chunks; a step where every chunk is one token runs as decode. ``prompt_rows`` (rows in the chunks'
    order) are also scored.

    A step with one-token chunks beside longer ones is mixed (``AttentionMetadata.mixed``): its one-token chunks are
    packed first, and ``logits_indices`` and the prompt rows point into that order, so the sampled tokens still come
    in the chunks' order. Packed while the step before still runs, a decode chunk's token is the one that step is
    sampling: it goes in ``pending`` for ``ModelInput.fill_pending``. ``tables``: an executor's, to reuse the block
    tables of its decode step before."""
    if not prompt_rows and all(c.num_tokens == 1 + c.num_drafts for c in chunks):
        if not any(c.num_drafts for c in chunks):
            return _decode_input(chunks, block_size, tables)
        verification = _verification_input(chunks, block_size)
        if verification is not None:
            return verification
    order = _decodes_first(chunks)
    packed = chunks if order is None else [chunks[i] for i in order]
    num_tokens = torch.tensor([c.num_tokens for c in packed])
    starts = torch.tensor([c.start for c in packed])
    ends = starts + num_tokens
    block_tables = pad_block_tables([c.state.block_table for c in packed])
    token_ids = list(itertools.chain.from_iterable(c.input_tokens() for c in packed))
    pending = _pending_tokens(packed, token_ids) if len(token_ids) < int(num_tokens.sum()) else []
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
    # Each chunk's first row and token count, in the chunks' order.
    first_rows = cu_q[:-1] if order is None else cu_q[:-1][_inverse(order)]
    lengths = num_tokens if order is None else torch.tensor([c.num_tokens for c in chunks])
    logits_indices = _logits_rows(chunks, first_rows, lengths)
    scored = torch.tensor(prompt_rows, dtype=torch.int64)
    if order is not None and len(scored):
        scored = _packed_rows(scored, lengths, first_rows)
    if is_decode:
        meta = AttentionMetadata(False, slot_mapping, block_tables, context_lens=ends.int())
    else:
        meta = _prefill_meta(slot_mapping, block_tables, num_tokens, starts, cu_q)
        d = int((num_tokens == 1).sum())  # the decode rows, packed first
        if d:
            decode = AttentionMetadata(False, slot_mapping[:d], block_tables[:d], context_lens=ends[:d].int())
            prefill = _prefill_meta(slot_mapping[d:], block_tables[d:], num_tokens[d:], starts[d:], cu_q[d:] - d)
            meta.mixed = MixedSplit(d, decode, prefill)
    lora_ids = _lora_ids(packed, num_tokens)
    return ModelInput(input_ids, positions, meta, logits_indices, scored, pending, lora_ids=lora_ids)


def _logits_rows(chunks: list[ScheduledChunk], first_rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The packed rows whose logits are sampled, in the chunks' order: the last of each chunk that samples, and
    every row of a verification chunk (its last token, then each proposal: ``executor_svc/spec``)."""
    samples = torch.tensor([c.samples for c in chunks])
    if not any(c.num_drafts for c in chunks):
        return (first_rows + lengths - 1)[samples]
    counts = torch.tensor([1 + c.num_drafts for c in chunks]) * samples
    ends = torch.repeat_interleave(first_rows + lengths, counts)
    back = torch.repeat_interleave(torch.cumsum(counts, 0), counts) - torch.arange(int(counts.sum()))
    return ends - back


def _lora_ids(packed: list[ScheduledChunk], num_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
    """Each row's adapter id, ``num_tokens`` rows per chunk (one when None); None when every row is the base
    model's, whose steps then run as without adapters."""
    ids = [c.state.lora_id for c in packed]
    if not any(ids):
        return None
    ids = torch.tensor(ids, dtype=torch.int64)
    return ids if num_tokens is None else torch.repeat_interleave(ids, num_tokens)


def _prefill_meta(slot_mapping: torch.Tensor, block_tables: torch.Tensor, num_tokens: torch.Tensor,
                  starts: torch.Tensor, cu_q: torch.Tensor) -> AttentionMetadata:
    ends = starts + num_tokens
    cu_k = torch.zeros(len(ends) + 1, dtype=torch.int32)
    torch.cumsum(ends, 0, out=cu_k[1:])
    return AttentionMetadata(
        True,
        slot_mapping,
        block_tables,
        cu_seqlens_q=cu_q.int(),
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(num_tokens.max()),
        max_seqlen_k=int(ends.max()),
        has_cached_context=bool((starts > 0).any()),
    )


def _decodes_first(chunks: list[ScheduledChunk]) -> list[int] | None:
    """Chunk indices with the one-token chunks first (each group in the chunks' order); None when that is the
    chunks' own order."""
    singles = [i for i, c in enumerate(chunks) if c.num_tokens == 1]
    if singles == list(range(len(singles))):
        return None
    return singles + [i for i, c in enumerate(chunks) if c.num_tokens != 1]


def _inverse(order: list[int]) -> torch.Tensor:
    """Where each chunk went in the packed order."""
    where = torch.empty(len(order), dtype=torch.int64)
    where[torch.tensor(order)] = torch.arange(len(order))
    return where


def _packed_rows(rows: torch.Tensor, lengths: torch.Tensor, first_rows: torch.Tensor) -> torch.Tensor:
    """``rows`` counted in the chunks' order, as rows of the packed batch (``lengths``, ``first_rows``: each chunk's
    token count and first packed row, in the chunks' order)."""
    chunk = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[rows]
    starts = torch.cumsum(lengths, 0) - lengths
    return first_rows[chunk] + rows - starts[chunk]


def _decode_input(chunks: list[ScheduledChunk], block_size: int, tables: DecodeTables | None = None) -> ModelInput:
    """``prepare_input`` for one token per chunk, in numpy, cheaper than torch's small ops; what is left runs beside
    the step before (W5, ``bench.overlap``)."""
    n = len(chunks)
    starts = np.fromiter([c.start for c in chunks], np.int64, count=n)
    states = [c.state for c in chunks]
    block_tables = (pad_block_tables([s.block_table for s in states]) if tables is None
                    else tables.pad(states))
    slots = block_tables.numpy()[np.arange(n), starts // block_size].astype(np.int64) * block_size + starts % block_size
    token_ids, pending = [0] * n, []
    for i, c in enumerate(chunks):  # one read of each token list: the step before may append to it meanwhile
        ids = c.state.token_ids
        if c.start < len(ids):
            token_ids[i] = ids[c.start]
        else:
            pending.append((i, c.state, c.start))
    sampled = [c.samples for c in chunks]
    samples = np.flatnonzero(np.fromiter(sampled, np.bool_, count=n))
    meta = AttentionMetadata(False, torch.from_numpy(slots), block_tables,
                             context_lens=torch.from_numpy((starts + 1).astype(np.int32)))
    on_device = all(sampled) and all(settings.num_logprobs is None and not settings.has_logits_processors
                                     and settings.grammar is None for settings in (c.state.sampling for c in chunks))
    return ModelInput(torch.tensor(token_ids, dtype=torch.int64), torch.from_numpy(starts), meta,
                      torch.from_numpy(samples), torch.empty(0, dtype=torch.int64), pending,
                      lora_ids=_lora_ids(chunks), samples_on_device=on_device)


def _verification_input(chunks: list[ScheduledChunk], block_size: int) -> ModelInput | None:
    """``prepare_input`` for decode and verification chunks: a verification chunk's 1 + k tokens run as 1 + k decode
    rows on its block table, row j attending to the context up to its own position (each layer stores every row's
    KV before any row attends). The step then runs as decode (the C decode stack on a CPU, where a prefill-shaped
    pass of a few rows costs twice a decode step: ``bench.spec``), and each row's logits are those plain decoding
    computes at its position. None when a token is still being sampled by the step before."""
    token_ids = list(itertools.chain.from_iterable(c.input_tokens() for c in chunks))
    rows = np.fromiter((c.num_tokens for c in chunks), np.int64, count=len(chunks))
    if len(token_ids) != int(rows.sum()):
        return None
    seq = np.repeat(np.arange(len(chunks)), rows)
    offsets = np.arange(len(token_ids)) - np.repeat(np.cumsum(rows) - rows, rows)
    positions = np.repeat(np.fromiter((c.start for c in chunks), np.int64, count=len(chunks)), rows) + offsets
    tables = pad_block_tables([c.state.block_table for c in chunks])
    slots = tables.numpy()[seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    samples = np.repeat(np.fromiter((c.samples for c in chunks), np.bool_, count=len(chunks)), rows)
    meta = AttentionMetadata(False, torch.from_numpy(slots), tables[torch.from_numpy(seq)],
                             context_lens=torch.from_numpy((positions + 1).astype(np.int32)))
    return ModelInput(torch.tensor(token_ids, dtype=torch.int64), torch.from_numpy(positions), meta,
                      torch.from_numpy(np.flatnonzero(samples)), lora_ids=_lora_ids(chunks, torch.from_numpy(rows)))


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
