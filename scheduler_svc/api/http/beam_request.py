"""vLLM's ``use_beam_search`` on the completion endpoints: the search's settings (``api.beam_search``), and the
parameters a search cannot honour refused, naming them, rather than silently dropped.

As vLLM's, the search reads the model's own logprobs, so ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
``seed`` change nothing; unlike vLLM's, it also ends beams at ``stop_token_ids``, keeps ``min_tokens``, streams (each
choice whole, once the search ended) and scores the prompt (``prompt_logprobs``, ``echo`` with ``logprobs``).
"""

from __future__ import annotations

import math

from common.sampling import MAX_LOGPROBS
from scheduler_svc.api.beam_search import BeamSettings
from scheduler_svc.api.http import schemas
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.translated import Translated
from scheduler_svc.core.beam_search import CANDIDATES_PER_BEAM

# The most beams: each step asks for CANDIDATES_PER_BEAM alternatives per beam, at most MAX_LOGPROBS.
MAX_BEAMS = MAX_LOGPROBS // CANDIDATES_PER_BEAM


def refused(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what} is not supported with use_beam_search", param)


def settings(body: schemas.GenerationParameters, t: Translated) -> BeamSettings | None:
    """The request's beam search, or None where it samples; a parameter the search would ignore is refused."""
    if not body.use_beam_search:
        return None
    width = 1 if body.n is None else body.n
    if not 1 <= width <= MAX_BEAMS:
        raise ApiError(400, f"n: 1 to {MAX_BEAMS} beams with use_beam_search, got {width}", "n")
    length_penalty = 1.0 if body.length_penalty is None else body.length_penalty
    if not math.isfinite(length_penalty):
        raise ApiError(400, f"length_penalty: must be a finite number, got {length_penalty}", "length_penalty")
    for param, given, what in (
            ("stop", body.stop, "stop strings"),
            ("logit_bias", body.logit_bias, "a logit bias"),
            ("allowed_token_ids", body.allowed_token_ids is not None, "allowed_token_ids"),
            ("bad_words", body.bad_words, "bad_words"),
            ("presence_penalty", body.presence_penalty not in (None, 0), "a presence penalty"),
            ("frequency_penalty", body.frequency_penalty not in (None, 0), "a frequency penalty"),
            ("repetition_penalty", body.repetition_penalty not in (None, 1), "a repetition penalty"),
            ("thinking_token_budget", body.thinking_token_budget not in (None, -1), "a thinking budget"),
            ("logprob_token_ids", body.logprob_token_ids, "logprob_token_ids"),
            ("repetition_detection", body.repetition_detection is not None, "repetition detection")):
        if given:
            raise refused(param, what)
    if any(request.HasField("structured_output") for request in t.requests):
        param = t.renames.get("structured_output", "structured_outputs")
        raise refused("tool_choice", "a forced tool choice") if param == "tools" else refused(param, "a grammar")
    return BeamSettings(width, length_penalty, bool(body.include_stop_str_in_output), t.top_logprobs)
