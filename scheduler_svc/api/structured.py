"""Structured output at request entry: each StructuredOutput becomes one llguidance grammar, checked here.

The scheduler compiles with llguidance's own converters and validates the result against the model's
tokenizer (llguidance's view of the handshake's tokenizer.json), so a bad schema, regex or grammar is
refused with llguidance's message before it is queued, and the executor only ever receives grammars it
can build a matcher from. The grammar (llguidance's JSON form) travels in ``SamplingParams.grammar``.
"""

from __future__ import annotations

import json
from weakref import WeakKeyDictionary

import llguidance
from llguidance import gbnf_to_lark

from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.core.errors import InvalidRequest
from scheduler_svc.core.tokenizer import ModelTokenizer

FIELD = "structured_output"
# No free whitespace between JSON tokens: a small model would otherwise pad with newlines until max_tokens.
# Applied before the schema's own "x-guidance" options, so a schema can opt back in.
JSON_DEFAULTS = {"whitespace_flexible": False}
ANY_OBJECT = '{"type": "object"}'

# Built once per handshake's tokenizer (slow for a large vocabulary), then shared by every request.
_guidance_tokenizers: WeakKeyDictionary[ModelTokenizer, dict[int, llguidance.LLTokenizer]] = WeakKeyDictionary()


def guidance_tokenizer(tokenizer: ModelTokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer over the executor's tokenizer.json, one mask bit per logit (``vocab_size``)."""
    by_vocab = _guidance_tokenizers.setdefault(tokenizer, {})
    cached = by_vocab.get(vocab_size)
    if cached is None:
        eos = tokenizer.tokenizer.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
        cached = by_vocab[vocab_size] = llguidance.LLTokenizer(
            tokenizer.tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos
        )
    return cached


def json_schema_grammar(schema: str) -> str:
    """The grammar of a JSON Schema given as JSON text; raises InvalidRequest when the text is not JSON."""
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{FIELD}.json_schema", f"not valid JSON: {e}") from e
    except RecursionError as e:
        raise InvalidRequest(f"{FIELD}.json_schema", "nested deeper than the JSON parser's recursion limit") from e
    if not isinstance(parsed, dict):
        raise InvalidRequest(f"{FIELD}.json_schema", "the schema must be a JSON object ({} accepts any JSON value)")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)


def as_lark(grammar: str) -> str:
    """A Lark grammar as it is, or a GBNF one (llama.cpp's EBNF, ``root ::= ...``, which vLLM takes too) in Lark."""
    try:
        return gbnf_to_lark.any_to_lark(grammar)
    except Exception as e:  # GbnfToLarkError, or a bare Exception for a grammar without a start (or root) rule
        raise InvalidRequest(f"{FIELD}.grammar", f"not a Lark or GBNF grammar: {e}") from e


def lark_grammar(lark: str) -> str:
    """A Lark grammar in llguidance's JSON form, the one form the executor's SamplingParams.grammar carries."""
    return json.dumps({"grammars": [{"lark_grammar": lark}]})


def choice_grammar(choices: list[str]) -> str:
    """An alternation of the choices as literals (llguidance's "choice" format)."""
    if not choices:
        raise InvalidRequest(f"{FIELD}.choice", "the choice list is empty; give at least one choice")
    if any(not c for c in choices):
        raise InvalidRequest(f"{FIELD}.choice", "choices must not be empty strings")
    return lark_grammar(llguidance.grammar_from("choice", json.dumps(choices)))


def to_grammar(structured: pb.StructuredOutput) -> tuple[str, str] | None:
    """(the field the caller set, its grammar not yet validated); None when nothing constrains the output."""
    kind = structured.WhichOneof("kind")
    if kind == "json_schema":
        grammar = json_schema_grammar(structured.json_schema)
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(structured.regex)
    elif kind == "choice":
        grammar = choice_grammar(list(structured.choice.choices))
    elif kind == "grammar":
        grammar = lark_grammar(as_lark(structured.grammar))
    elif kind == "json_object" and structured.json_object:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_DEFAULTS)
    else:
        return None
    return f"{FIELD}.{kind}", grammar


def compile_grammar(
    structured: pb.StructuredOutput, tokenizer: ModelTokenizer | None, vocab_size: int
) -> str | None:
    """The checked llguidance grammar of ``structured``, or None; raises InvalidRequest naming the bad field."""
    compiled = to_grammar(structured)
    if compiled is None:
        return None
    field, grammar = compiled
    if tokenizer is None:
        raise InvalidRequest(FIELD, "this executor has no tokenizer, which structured output needs")
    try:
        guidance = guidance_tokenizer(tokenizer, vocab_size)
    except ValueError as e:  # a tokenizer with more tokens than the model has logits
        raise InvalidRequest(FIELD, f"llguidance cannot use this model's tokenizer: {e}") from e
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, guidance)
    if is_error:
        raise InvalidRequest(field, messages[0])
    return grammar
