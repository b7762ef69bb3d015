"""A decode step's tokens taken on the device at its launch, so the step after it can be launched behind it.

Once no row of a step asks for logprobs, logits processors or a grammar (``ModelInput.samples_on_device``), nothing
of its sampling needs the host: the sampler's argmax or draw (``Sampler.token_tensor``) is queued right after the
forward, the tokens are copied to page-locked host memory without a wait, and an event marks when they are there.
The next step's input takes them on the device (``ModelInput.fill_pending_from``), so it is queued before this
step's tokens reach the host and the device goes from one step to the next without waiting for the host to wake,
read the tokens and launch (vLLM's async scheduling, SGLang's overlap scheduler). ``finish`` waits for this step's
event alone, not for the step queued behind it. A top-p row whose nucleus may be wider than the sampler's window is
the one exception: checking that waits for the device (``sampler.rank_and_mask``), and its launch with it.
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
    def of(cls, tokens: torch.Tensor) -> SampledAhead:
        """``tokens`` (a step's, as the sampler queued them) and their copy to the host, queued too on a GPU."""
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
