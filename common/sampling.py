"""The one table of sampling defaults and limits: what an unset field means and what range a set one may take.

Both services read it: the scheduler to fill and check a request's parameters as they enter, the executor for the
defaults of a plan's absent fields and the ranges its logits processors rely on. The proto comments, the CLI help
and docs/client.md are tested against it (tests/test_defaults.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MAX_LOGPROBS = 20
# vLLM's bound on logprob_token_ids: the tokens whose logprobs a request names.
MAX_LOGPROB_TOKEN_IDS = 128
# repetition_detection's longest pattern: every token of such a request is checked against each size up to it.
MAX_REPETITION_PATTERN = 1024
# truncate_prompt_tokens' largest value, which carries vLLM's -1: the model's length less the one token an answer needs.
TO_MODEL_LENGTH = 2**32 - 1
# Every generated token is checked against every stop string: bound that work per request, as TGI does.
MAX_STOP_STRINGS = 16
# Stop token ids are a set looked up once per token; the bound keeps a request's plan-side state small.
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16
# Presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]; a logit bias in [-MAX_LOGIT_BIAS, ...].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# Temperatures below this are greedy: dividing by them would overflow the logits.
GREEDY_BELOW = 1e-5

# Field -> default. max_tokens is further capped by the room the prompt leaves in the model's length.
DEFAULTS: dict[str, object] = {
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "seed": None,
    "logprobs": None,
    "max_tokens": 256,
    "ignore_eos": False,
    "stop": (),
    "stop_token_ids": (),
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "n": 1,
    "min_tokens": 0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """The model's own defaults (its generation_config.json, as vLLM's ``--generation-config auto`` takes them): each
    one set replaces its ``DEFAULTS`` entry for a request that leaves that field unset. None: the model gives none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # generation_config.json's max_new_tokens.
    max_tokens: int | None = None

    def given(self) -> dict[str, float | int]:
        """The fields set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
