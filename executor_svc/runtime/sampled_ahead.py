"""A decode step's greedy tokens taken on the device at its launch, so the step after it can be launched behind it.

Once every sampled row of a step only takes the argmax (``ModelInput.greedy_only``), nothing of its sampling needs
the host: the argmax is queued right after the forward, the tokens are copied to page-locked host memory without a
wait, and an event marks when they are there. The next step's input takes them on the device
(``ModelInput.fill_pending_from``), so it is queued before this step's tokens reach the host and the device goes
from one step to the next without waiting for the host to wake, read the tokens and launch (vLLM's async
scheduling, SGLang's overlap scheduler). ``finish`` waits for this step's event alone, not for the step queued
behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SampledAhead:
    """The step's tokens: ``on_device`` for the step behind it, ``host`` once ``ready`` (None: already there)."""

    on_device: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @classmethod
    def take(cls, logits: torch.Tensor) -> SampledAhead:
        """Each row's argmax, ties to the lowest id, as ``sampler.greedy_tokens`` takes it on a GPU (in float32,
        to which bfloat16 widens exactly); queued, not waited for, on a GPU."""
        tokens = logits.float().argmax(dim=-1)
        if not tokens.is_cuda:
            return cls(tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(tokens.device))  # the tokens' device, whichever is current
        return cls(tokens, host, ready)

    def token_ids(self) -> list[int]:
        """The tokens on the host, once the device has computed and copied them (and nothing queued after them)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
