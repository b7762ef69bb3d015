"""A request as it enters the engine: its prompt as token ids, its parameters filled and checked."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.sampling import SamplingParams


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Completion tokens a client resumes with (GenerateRequest.resume); they follow the prompt.
    resumed_token_ids: list[int] = field(default_factory=list)
    # Tokens each choice gathers before its stream carries them (GenerateRequest.stream_interval); None: the
    # server's --stream-interval.
    stream_interval: int | None = None
    # The LoRA adapter it runs through, by name (GenerateRequest.lora); "": the base model.
    lora: str = ""
    # Lower runs first under --request-order priority (GenerateRequest.priority); refused in arrival order unless 0.
    priority: int = 0
    # The caller asked for the prompt's token ids back (GenerateRequest.return_prompt_token_ids).
    return_prompt_token_ids: bool = False
    # Its prefix cache's salt (GenerateRequest.cache_salt): its prompt hits only blocks computed under it; "": none.
    cache_salt: str = ""
