"""Structured output on the real model: every completion follows its grammar, whichever way it was scheduled.

SmolLM2-135M samples (temperature 1, seeded, and greedy) against 50 random JSON Schemas, regexes,
choice lists and Lark grammars through the in-process Engine and the ModelExecutor: with multi-step
decode, and with overlap across forced preemptions (a tiny KV cache) and an executor restart, where a
matcher that did not replay the completion tokens would start the grammar over. Outputs are checked
with other libraries than llguidance (json + jsonschema, re, lark), and each must end with EOS: a
grammar that lets the model run into max_tokens would hide a truncated output.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import lark
import pytest

from executor_svc.runtime.config import ExecutorOptions
from executor_svc.runtime.model_executor import ModelExecutor
from nanoserve.v1 import generation_pb2 as pb
from scheduler_svc.api.structured import compile_grammar
from scheduler_svc.core.sampling import SamplingParams
from scheduler_svc.core.scheduler import SchedulerConfig
from scheduler_svc.core.sequence import FinishReason, Sequence
from scheduler_svc.core.tokenizer import ChatMessage, ModelTokenizer
from scheduler_svc.engine.engine import Engine, ExecutorRestarted
from tests.conftest import assert_all_blocks_free
from tests.model_fixtures import smollm2_folder  # noqa: F401
from tests.shadow_helpers import ConnectionLost, RestartingExecutor

MAX_TOKENS = 160
# About 46 KiB of float32 KV per token: room for every request at once, or for a few only (preemptions).
ROOMY_KV_BYTES = 512 << 20
TINY_KV_BYTES = 18 << 20
WORDS = ("name", "id", "city", "score", "tags", "level", "color", "size", "owner", "note")

REGEXES = [
    r"[a-z]{2,6}-[0-9]{3}",
    r"(yes|no), because [a-z ]{1,20}\.",
    r"[A-Z][a-z]{1,8} [0-9]{1,2}(st|nd|rd|th)",
    r"\d{4}-\d{2}-\d{2}",
    r"#[0-9a-f]{6}",
    r"(ha){1,4}!",
]
CHOICES = [["yes", "no"], ["red", "green", "blue"], ["Paris", "London", "Tokyo", "New York"],
           ["1", "22", "333"], ["héllo wörld", "a \"quoted\" one"]]
LARK = [
    'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[0-9]{1,2}/',
    'start: item (", " item)? (", " item)?\nitem: /[a-z]{1,6}/',
    'start: "let " NAME " = " NUM ";"\nNAME: /[a-z]{1,5}/\nNUM: /[1-9][0-9]{0,2}/',
]


def leaf(rng: random.Random, depth: int) -> dict:
    """One bounded property schema: every output it allows is short, so the model reaches EOS."""
    kinds = ["string", "integer", "number", "boolean", "enum", "array"] + (["object"] if depth < 1 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 8)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice((9, 99, 999))}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["a", "b", "small", "large", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": leaf(rng, 1), "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    return random_schema(rng, depth + 1)


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    names = [f"{word}{i}" for i, word in enumerate(rng.sample(WORDS, rng.randint(1, 3)))]
    return {
        "type": "object",
        "properties": {name: leaf(rng, depth) for name in names},
        "required": sorted(rng.sample(names, rng.randint(1, len(names)))),
        "additionalProperties": False,
    }


@dataclass
class Case:
    """One request: its constraint, the check of its output text and how it samples."""

    structured: pb.StructuredOutput
    check: Callable[[str], None]
    temperature: float
    seed: int


def json_check(schema: dict) -> Callable[[str], None]:
    return lambda text: jsonschema.validate(json.loads(text), schema)


def regex_check(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"

    return check


def choice_check(choices: list[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert text in choices, f"{text!r} is none of {choices}"

    return check


def lark_check(grammar: str) -> Callable[[str], None]:
    parser = lark.Lark(grammar, start="start")
    return lambda text: parser.parse(text)


def sampled(yes: int) -> float:
    """Temperature 1 for a sampled case, 0 (greedy) for the others."""
    return 1.0 if yes else 0.0


def corpus(num_schemas: int, seed: int) -> list[Case]:
    """``num_schemas`` random JSON Schemas, then every regex, choice list and Lark grammar; greedy and sampled."""
    rng = random.Random(seed)
    cases = []
    for i in range(num_schemas):
        schema = random_schema(rng)
        cases.append(Case(pb.StructuredOutput(json_schema=json.dumps(schema)), json_check(schema), sampled(i % 3), i))
    for i, pattern in enumerate(REGEXES):
        cases.append(Case(pb.StructuredOutput(regex=pattern), regex_check(pattern), sampled(i % 2), 100 + i))
    for i, choices in enumerate(CHOICES):
        cases.append(Case(pb.StructuredOutput(choice=pb.ChoiceList(choices=choices)), choice_check(choices),
                          sampled(i % 2), 200 + i))
    for i, grammar in enumerate(LARK):
        cases.append(Case(pb.StructuredOutput(grammar=grammar), lark_check(grammar), sampled((i + 1) % 2), 300 + i))
    cases.append(Case(pb.StructuredOutput(json_object=True), lambda text: isinstance(json.loads(text), dict), 0.0, 400))
    return cases


PROMPTS = {
    "json_schema": "Describe a thing you like as a small JSON object.",
    "json_object": "Reply with a JSON object with one key, \"answer\", set to yes or no.",
    "regex": "Give a short answer.",
    "choice": "Pick one.",
    "grammar": "Write a short expression.",
}


def make_executor(kv_bytes: int) -> ModelExecutor:
    return ModelExecutor(ExecutorOptions(dtype="float32", kv_cache_memory=kv_bytes, threads=2))


def add_requests(engine: Engine, tokenizer: ModelTokenizer, cases: list[Case]) -> list[Sequence]:
    """Queue every case as the service would: its grammar compiled and checked by the scheduler."""
    seqs = []
    for case in cases:
        grammar = compile_grammar(case.structured, tokenizer, engine.info.vocab_size)
        prompt = tokenizer.encode_chat([ChatMessage("user", PROMPTS[case.structured.WhichOneof("kind")])])
        params = SamplingParams(temperature=case.temperature, seed=case.seed, max_tokens=MAX_TOKENS, grammar=grammar)
        seqs.append(engine.add_request(prompt, params))
    return seqs


def assert_conforms(engine: Engine, tokenizer: ModelTokenizer, cases: list[Case], seqs: list[Sequence]) -> None:
    eos = set(engine.info.eos_token_ids)
    failures = []
    for case, seq in zip(cases, seqs, strict=True):
        text = tokenizer.decode(seq.completion_token_ids)
        try:
            assert seq.finish_reason == FinishReason.STOP and seq.completion_token_ids[-1] in eos, "no EOS"
            case.check(text)
        except (AssertionError, ValueError, jsonschema.ValidationError, lark.exceptions.LarkError) as e:
            failures.append(f"{case.structured} -> {text!r}: {e}")
    assert not failures, "\n".join(failures)


def assert_idle(engine: Engine, executor: ModelExecutor) -> None:
    assert_all_blocks_free(engine.block_manager)
    assert len(executor.table) == 0, "the executor still holds requests the scheduler finished"


@pytest.fixture(scope="module")
def roomy_executor(smollm2_folder) -> ModelExecutor:  # noqa: F811
    return make_executor(ROOMY_KV_BYTES)


@pytest.fixture(scope="module")
def tokenizer(roomy_executor: ModelExecutor) -> ModelTokenizer:
    return ModelTokenizer.from_info(roomy_executor.get_info())


def test_fifty_schemas_regexes_choices_and_grammars_conform_with_multi_step_decode(roomy_executor, tokenizer):
    cases = corpus(50, seed=0)
    engine = Engine(roomy_executor, SchedulerConfig(num_scheduler_steps=8))
    seqs = add_requests(engine, tokenizer, cases)
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert engine.scheduler.num_preemptions == 0, "the roomy cache holds every request at once"
    assert_conforms(engine, tokenizer, cases, seqs)
    assert_idle(engine, roomy_executor)


def test_the_readmes_example_schema_gives_conforming_output(roomy_executor, tokenizer):
    """``nanoserve generate --json-schema examples/person.schema.json`` (README): the file is a schema the scheduler
    takes, and greedy output follows it."""
    schema = json.loads((Path(__file__).parent.parent / "examples" / "person.schema.json").read_text())
    cases = [Case(pb.StructuredOutput(json_schema=json.dumps(schema)), json_check(schema), 0.0, 0)]
    engine = Engine(roomy_executor, SchedulerConfig())
    seqs = add_requests(engine, tokenizer, cases)
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert_conforms(engine, tokenizer, cases, seqs)
    assert_idle(engine, roomy_executor)


@pytest.mark.parametrize(("num_scheduler_steps", "die_at"), [(1, 30), (8, 6)], ids=["overlap", "overlap-multi-step"])
def test_outputs_conform_across_preemptions_and_an_executor_restart(tokenizer, num_scheduler_steps, die_at):
    cases = corpus(12, seed=num_scheduler_steps)
    executor = RestartingExecutor(lambda: make_executor(TINY_KV_BYTES), {die_at})
    engine = Engine(executor, SchedulerConfig(num_scheduler_steps=num_scheduler_steps), overlap=True)
    seqs = add_requests(engine, tokenizer, cases)
    replayed = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except (ConnectionLost, ExecutorRestarted):
            replayed = sum(1 for seq in seqs if not seq.is_finished and seq.num_completion_tokens)
            assert engine.recover() == ([], [])
    engine.step()
    assert executor.restarts == 1
    assert replayed, "the restart came before any request had completion tokens to replay"
    assert engine.scheduler.num_preemptions > 0, "the tiny cache should force preemptions"
    assert_conforms(engine, tokenizer, cases, seqs)
    assert_idle(engine, executor.inner)
