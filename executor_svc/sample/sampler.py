"""Turns the last-position logits of a batch into one token id per request.

Rows with logits processors (min_tokens, logit bias, penalties: ``executor_svc.sample.logits_processors``) have
them applied first, in float32. Pipeline for a sampled row (all in float32): logits / temperature, then min-p,
top-k, top-p (vLLM's order: min-p keeps the tokens within its share of the best one's probability, the others
see what it kept; Hugging Face's applies min-p last), then one draw. Greedy rows
(temperature below ``common.sampling.GREEDY_BELOW``) take the argmax, ties to the lowest id.
Rows come as plain ``SamplingSettings``; logprobs leave as plain ``TokenLogprobs``.

A draw is an exponential race, ``argmax(probs / q)`` with ``q ~ Exp(1)`` per
vocab entry, which picks token i with probability ``probs[i]`` and lets every
row of the batch be drawn with one argmax. A seeded request's ``q`` comes from
a generator seeded by a hash of (seed, position), so its tokens are a pure
function of its own logits, seed and position: independent of the rest of the
batch, of earlier steps, of preemption/recompute and of executor restarts on
the same kind of device. (Only rounding in the filters can depend on the batch,
far less than the model's own logits do.) Unseeded rows share the sampler's
one generator.

Logprobs follow vLLM's default ("raw_logprobs"): log_softmax of the model's
logits before processors, temperature and filters, so they describe the model, not the
sampling settings, and are the same for greedy and sampled rows; a structured-output row's come after its
grammar's mask (``constraints``), as vLLM's do: the tokens the grammar bans are -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from common.step import SamplingSettings, TokenLogprobs
from executor_svc.cpu import kernels as cpu_kernels
from executor_svc.sample.logits_processors import RequestTokens, apply_logits_processors

# Top-p without top-k first ranks only this many best tokens; a row whose nucleus may be wider sorts the vocabulary.
NUCLEUS_WINDOW = 1024
# Top-k keeps the tokens tied with its k-th best found among this many more (Hugging Face and vLLM keep every tie:
# bfloat16 logits tie often); ranking no further keeps a GPU step's sampling free of waits on the device.
TIE_MARGIN = 8


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Shaped like StepResult.logprobs: one entry per row (None for rows that did
    # not ask) when any row asked, otherwise no entries at all.
    logprobs: list[TokenLogprobs | None]
    # With rows that verified proposals (``executor_svc/spec/verify.py``): each row's number of tokens, in order.
    counts: list[int] = field(default_factory=list)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax, ties to the lowest id: on the CPU through the C kernel
    (``executor_svc/cpu/csrc/fused_ops.c``), faster than torch's CPU argmax in both dtypes."""
    library = cpu_kernels.kernel_library() if logits.is_cpu else None
    if (library is not None and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.stride(-1) == 1 and logits.shape[1] > 0):
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        library.argmax_rows(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
                            logits.dtype == torch.bfloat16, torch.get_num_threads())
        return out.tolist()
    # float32 first: the same argmax (bfloat16 widens exactly), and faster on the CPU than in bfloat16.
    return logits.float().argmax(dim=-1).tolist()


def small_tensor(values: list, device: torch.device) -> torch.Tensor:
    """A step's few per-row values on ``device``: to a GPU through page-locked memory, so that the copy does not wait
    for the work queued before it (a copy from pageable memory waits for the stream first)."""
    tensor = torch.tensor(values)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor.to(device)


def seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """The generator of a seeded request's draw at ``position``; it depends on nothing else."""
    return torch.Generator(device=device).manual_seed(xxhash.xxh64_intdigest(position.to_bytes(8, "little"), seed))


class Sampler:
    def __init__(self, seed: int | None = None, eos_token_ids: Sequence[int] = ()) -> None:
        """``seed`` fixes the generator of unseeded rows (tests); None draws one from the OS.

        ``eos_token_ids`` are the model's, which min_tokens masks unless a request ignores EOS.
        """
        self.seed = seed
        self.eos_token_ids = tuple(eos_token_ids)
        self.generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingSettings],
        positions: Sequence[int],
        requests: Sequence[RequestTokens] = (),
    ) -> SamplerOutput:
        """Sample row i of ``logits`` [batch, vocab] with ``rows[i]`` at context position ``positions[i]``.

        ``requests[i]`` holds row i's tokens; needed only when some row has logits processors.
        """
        if all(row.plain_greedy for row in rows):
            return SamplerOutput(greedy_tokens(logits), [])
        raw = logits = logits.float()
        if any(row.has_logits_processors for row in rows):
            logits = apply_logits_processors(raw, rows, requests, self.eos_token_ids)
        token_ids = self.token_tensor(logits, rows, positions)
        return SamplerOutput(token_ids.tolist(), token_logprobs(raw, token_ids, rows))

    def token_tensor(self, logits: torch.Tensor, rows: Sequence[SamplingSettings],
                     positions: Sequence[int]) -> torch.Tensor:
        """Each row's token, where ``logits`` are (float32, its processors applied): the argmax of a greedy row, a
        draw for the others. On a GPU nothing waits for the device, but for a top-p row's check of its window
        (``rank_and_mask``): a step's tokens can be taken at its launch (``runtime/sampled_ahead.py``)."""
        sampled = [i for i, row in enumerate(rows) if not row.greedy]
        if len(sampled) == len(rows):
            return self.draw(logits, rows, list(positions))
        token_ids = logits.argmax(dim=-1)
        if sampled:
            index = small_tensor(sampled, logits.device)
            drawn = self.draw(
                logits.index_select(0, index), [rows[i] for i in sampled], [positions[i] for i in sampled]
            )
            token_ids.index_copy_(0, index, drawn)
        return token_ids

    def draw(self, logits: torch.Tensor, rows: Sequence[SamplingSettings], positions: list[int]) -> torch.Tensor:
        """One token per row: the exponential race over the filtered probabilities."""
        probs = filtered_probs(logits, rows)
        return probs.div_(self.exponential_noise(probs, rows, positions)).argmax(dim=-1)

    def global_generator(self, device: torch.device) -> torch.Generator:
        generator = self.generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self.generators[device] = generator
        return generator

    def exponential_noise(
        self, probs: torch.Tensor, rows: Sequence[SamplingSettings], positions: list[int]
    ) -> torch.Tensor:
        """Exp(1) noise shaped like ``probs``: per-(seed, position) for seeded rows, shared otherwise."""
        noise = torch.empty_like(probs)
        unseeded = [i for i, row in enumerate(rows) if row.seed is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self.global_generator(probs.device))
        elif unseeded:
            index = small_tensor(unseeded, probs.device)
            draws = torch.empty(len(unseeded), probs.shape[1], device=probs.device)
            noise.index_copy_(0, index, draws.exponential_(generator=self.global_generator(probs.device)))
        for i, (row, position) in enumerate(zip(rows, positions, strict=True)):
            if row.seed is not None:
                noise[i].exponential_(generator=seeded_generator(row.seed, position, probs.device))
        # exponential_ may return exactly 0, and 0 / 0 would let a filtered-out token win the argmax.
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def filtered_probs(logits: torch.Tensor, rows: Sequence[SamplingSettings]) -> torch.Tensor:
    """Probabilities after temperature, min-p, top-k and top-p; filtered tokens get exactly 0."""
    device = logits.device
    vocab = logits.shape[1]
    logits = logits / small_tensor([row.temperature for row in rows], device).unsqueeze(1)
    # Above 1 min-p would drop even the best token.
    min_p = [min(row.min_p, 1.0) for row in rows]
    if any(m > 0 for m in min_p):
        # Masked logits keep the rows without min-p bit-identical to a batch without it.
        probs = logits.softmax(dim=-1)
        threshold = small_tensor(min_p, device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits.masked_fill_(probs < threshold, float("-inf"))
    ranked = [i for i, row in enumerate(rows) if 0 < row.top_k < vocab or row.top_p < 1.0]
    if ranked:
        top_k = [rows[i].top_k if 0 < rows[i].top_k < vocab else vocab for i in ranked]
        # 1 disables top-p; an infinite threshold keeps float error in the cumsum from dropping the tail.
        top_p = [rows[i].top_p if rows[i].top_p < 1.0 else float("inf") for i in ranked]
        if len(ranked) == len(rows):
            logits = top_k_top_p(logits, top_k, top_p)
        else:
            index = small_tensor(ranked, device)
            logits.index_copy_(0, index, top_k_top_p(logits.index_select(0, index), top_k, top_p))
    return logits.softmax(dim=-1)


def top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask to -inf all but each row's ``top_k`` best tokens, then all outside its top-``top_p`` nucleus.

    Top-k keeps the k best tokens and those tied with the k-th among the next
    ``TIE_MARGIN`` (which of more ties is unspecified). The nucleus is the smallest set of best tokens whose share of
    the top-k mass (the whole row's without top-k) reaches top_p; the best
    token is always kept. Only as many best tokens as the filters can keep are
    ranked, sparing a sort of the whole vocabulary where possible.
    """
    vocab = logits.shape[1]
    if max(top_k) < vocab:
        return rank_and_mask(logits, min(vocab, max(top_k) + TIE_MARGIN), top_k, top_p)
    if vocab > NUCLEUS_WINDOW:
        masked = rank_and_mask(logits, NUCLEUS_WINDOW, top_k, top_p)
        if masked is not None:
            return masked
    return rank_and_mask(logits, vocab, top_k, top_p)


def rank_and_mask(logits: torch.Tensor, width: int, top_k: list[int], top_p: list[float]) -> torch.Tensor | None:
    """``top_k_top_p`` ranking only the best ``width`` tokens; None when some row may keep more than those."""
    device, vocab = logits.device, logits.shape[1]
    k = small_tensor(top_k, device).unsqueeze(1)
    p = small_tensor(top_p, device).unsqueeze(1)
    if width < vocab:
        ordered, order = logits.topk(width, dim=-1)
    else:
        ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    kth = ordered.gather(1, (k - 1).clamp(max=width - 1))  # a row without top-k masks nothing: k is the vocabulary
    ordered.masked_fill_((torch.arange(width, device=device) >= k) & (ordered < kth), float("-inf"))
    log_mass = ordered.logsumexp(dim=-1, keepdim=True)
    if max(top_k) == vocab:
        log_mass = torch.where(k < vocab, log_mass, logits.logsumexp(dim=-1, keepdim=True))
    shares = ordered.sub(log_mass).exp_()
    cumulative = shares.cumsum(dim=-1)
    # The nucleus fits in the window when the row's top-k does, or when the window's share reaches top_p.
    if width < vocab and not bool(((k <= width) | ((k == vocab) & (cumulative[:, -1:] >= p))).all()):
        return None
    outside = cumulative.sub_(shares) >= p
    outside[:, 0] = False
    ordered.masked_fill_(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, ordered)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingSettings]
) -> list[TokenLogprobs | None]:
    """Raw-distribution logprobs of each row's token and its top n (or the tokens it named), for the rows that
    asked."""
    asked = [row.num_logprobs for row in rows]
    if all(n is None for n in asked):
        return []
    logprobs = logits.log_softmax(dim=-1)
    chosen, ranks = chosen_and_ranks(logprobs, token_ids)
    n_max = min(max((n or 0 for n, row in zip(asked, rows, strict=True) if not row.logprob_token_ids), default=0),
                logits.shape[1])
    top_values, top_ids = logprobs.topk(n_max, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    if named := [i for i, row in enumerate(rows) if row.logprob_token_ids]:  # one gather, one copy from the device
        width = max(len(rows[i].logprob_token_ids) for i in named)
        index = [list(rows[i].logprob_token_ids) + [0] * (width - len(rows[i].logprob_token_ids)) for i in named]
        values = logprobs[named].gather(1, torch.tensor(index, device=logprobs.device)).tolist()
        for i, row_values in zip(named, values, strict=True):
            top_ids[i], top_values[i] = list(rows[i].logprob_token_ids), row_values[:len(rows[i].logprob_token_ids)]
    return [
        None if n is None else TokenLogprobs(chosen[i], top_ids[i][:n], top_values[i][:n], ranks[i])
        for i, n in enumerate(asked)
    ]


def chosen_and_ranks(logprobs: torch.Tensor, token_ids: torch.Tensor) -> tuple[list[float], list[int]]:
    """Each row's logprob at its token, and the token's rank as vLLM counts it: the tokens at least as likely, itself
    included (tokens tied with it share the last of their ranks). One copy from the device for both."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs >= chosen).sum(dim=-1)
    both = torch.stack([chosen.squeeze(1), ranks.to(chosen.dtype)]).tolist()
    return both[0], [int(rank) for rank in both[1]]
