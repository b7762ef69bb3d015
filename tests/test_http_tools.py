"""Tool calling through the OpenAI API, driven by the real ``openai`` SDK against an in-process scheduler whose echo
executor answers each chat with the text of its last message: so a test writes the model's answer, and sees it read
into ``tool_calls`` as vLLM reads it, whole and streamed, with vLLM's finish reasons and tool-call ids; the template
(Qwen2.5's tool format, after the echoed part) shows that ``tools``, earlier calls and tool results reach it.
Without --enable-auto-tool-choice a tool_choice "auto" is refused; "required" and a named function are held to
vLLM's schema, which the GenerateRequest carries."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from common.step import ExecutorInfo
from executor_svc.fakes.shadow_server import EchoExecutor
from nanoserve.v1 import generation_pb2 as pb
from tests.http_fixtures import Hosted, hosted
from tests.service_fixtures import byte_level_tokenizer

# Qwen2.5's tool format (its published template, shortened): tools in the system turn, calls as <tool_call> JSON,
# results as <tool_response> in a user turn.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The echo executor repeats the prompt from its start: the last message, then EOS, ends the answer there.
ECHO_LAST = "{{ messages[-1]['content'] }}<|endoftext|>"
MARKERS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<|python_tag|>"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{16}")


def tokenizer() -> Tokenizer:
    """The tests' byte-level BPE, with the markers as single tokens as in Qwen's (not special: they stay in text)."""
    tok = byte_level_tokenizer()
    tok.add_tokens(MARKERS)
    return tok


TOKENIZER = tokenizer()


def echo_last(template: str = ECHO_LAST + QWEN_TOOLS_TEMPLATE) -> EchoExecutor:
    return EchoExecutor(ExecutorInfo(
        instance_id="tools", model_id="tools", vocab_size=TOKENIZER.get_vocab_size(), eos_token_ids=(0,),
        max_model_len=2048, block_size=16, num_blocks=1024, tokenizer_json=TOKENIZER.to_str(), chat_template=template))


AUTO = {"NANOSERVE_ENABLE_AUTO_TOOL_CHOICE": "true"}


@contextlib.contextmanager
def serving(env: dict[str, str], api_process: bool = True,
            template: str = ECHO_LAST + QWEN_TOOLS_TEMPLATE) -> Iterator[Hosted]:
    """A scheduler started with the flags ``env`` gives in their environment form (``NANOSERVE_TOOL_CALL_PARSER``)."""
    flags: dict[str, object] = {name.removeprefix("NANOSERVE_").lower(): value for name, value in env.items()}
    if "enable_auto_tool_choice" in flags:
        flags["enable_auto_tool_choice"] = flags["enable_auto_tool_choice"] == "true"
    with hosted(echo_last(template), api_process=api_process, **flags) as h:
        yield h


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def hermes_api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    with serving({**AUTO, "NANOSERVE_TOOL_CALL_PARSER": "hermes"}, request.param) as h:
        yield h


@pytest.fixture(scope="module", params=[True, False], ids=["api-process", "in-scheduler"])
def llama_api(request: pytest.FixtureRequest) -> Iterator[Hosted]:
    """The API process gathers several tokens a delta (its pacing); in the scheduler's process, a token is one."""
    with serving({**AUTO, "NANOSERVE_TOOL_CALL_PARSER": "llama3_json"}, request.param) as h:
        yield h


@pytest.fixture(scope="module")
def plain_api() -> Iterator[Hosted]:
    """No tool flags: "auto" is refused."""
    with serving({}) as h:
        yield h


@pytest.fixture
def api(hermes_api: Hosted) -> Iterator[Hosted]:
    yield hermes_api
    hermes_api.assert_idle()


def answering(text: str, **options: object) -> dict:
    """A chat request whose answer (from the echo executor) is ``text``."""
    return {"model": "tools", "messages": [{"role": "user", "content": text}], **options}


def streamed_calls(chunks: list) -> tuple[str, dict[int, dict], list[str | None]]:
    """The content, each call (by index: id, name, arguments joined) and the finish reasons of a stream."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                joined = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id:
                    assert joined["id"] is None, "a call's id comes once"
                    joined["id"] = call.id
                if call.function and call.function.name:
                    joined["name"] = call.function.name
                joined["arguments"] += (call.function.arguments or "") if call.function else ""
            finishes.append(choice.finish_reason)
    return content, calls, finishes


HERMES_ANSWER = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def test_auto_reads_hermes_calls_whole_and_streamed(api: Hosted):
    client = api.openai()
    reply = client.chat.completions.create(**answering(HERMES_ANSWER, tools=TOOLS))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert all(CALL_ID.fullmatch(c.id) and c.type == "function" for c in calls) and calls[0].id != calls[1].id
    chunks = list(client.chat.completions.create(**answering(HERMES_ANSWER, tools=TOOLS, stream=True)))
    content, streamed, finishes = streamed_calls(chunks)
    assert content == "Let me check." and finishes[-1] == "tool_calls"
    assert [(streamed[i]["name"], streamed[i]["arguments"]) for i in (0, 1)] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert all(CALL_ID.fullmatch(streamed[i]["id"]) for i in (0, 1))


def test_an_answer_without_calls_is_content_and_stops(api: Hosted):
    client = api.openai()
    reply = client.chat.completions.create(**answering("No tool is needed.", tools=TOOLS))
    assert (reply.choices[0].message.content, reply.choices[0].message.tool_calls) == ("No tool is needed.", None)
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**answering("No tool is needed.", tools=TOOLS, stream=True)))
    assert streamed_calls(chunks) == ("No tool is needed.", {}, [None] * (len(chunks) - 1) + ["stop"])


def test_tool_choice_none_leaves_calls_in_the_content(api: Hosted):
    reply = api.openai().chat.completions.create(**answering(HERMES_ANSWER, tools=TOOLS, tool_choice="none"))
    assert reply.choices[0].message.content == HERMES_ANSWER and reply.choices[0].finish_reason == "stop"


def test_a_cut_call_is_content_whole_and_its_name_streamed(api: Hosted):
    """max_tokens cuts the call's JSON: whole, the parser reads no call (the text is content); streamed, the call's
    name and the arguments so far went out, and the finish is "length", as on vLLM."""
    client = api.openai()
    cut = len(TOKENIZER.encode('Hi<tool_call>\n{"name": "get_weather", "arguments": {"ci').ids)
    reply = client.chat.completions.create(**answering(HERMES_ANSWER.replace("Let me check.", "Hi"), tools=TOOLS,
                                                       max_tokens=cut))
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.endswith('"arguments": {"ci')
    chunks = list(client.chat.completions.create(**answering(HERMES_ANSWER.replace("Let me check.", "Hi"),
                                                             tools=TOOLS, max_tokens=cut, stream=True)))
    content, calls, finishes = streamed_calls(chunks)
    assert (content, calls[0]["name"], calls[0]["arguments"], finishes[-1]) == ("Hi", "get_weather", '{"ci', "length")


def test_parallel_tool_calls_false_keeps_the_first(api: Hosted):
    client = api.openai()
    reply = client.chat.completions.create(**answering(HERMES_ANSWER, tools=TOOLS, parallel_tool_calls=False))
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]
    chunks = list(client.chat.completions.create(**answering(HERMES_ANSWER, tools=TOOLS, parallel_tool_calls=False,
                                                             stream=True)))
    assert list(streamed_calls(chunks)[1]) == [0]


def test_n_choices_are_read_each_on_its_own(api: Hosted):
    reply = api.openai().chat.completions.create(**answering(HERMES_ANSWER, tools=TOOLS, n=2))
    assert [len(c.message.tool_calls) for c in reply.choices] == [2, 2]
    ids = {call.id for c in reply.choices for call in c.message.tool_calls}
    assert len(ids) == 4


def test_llama3_json_calls_whole_and_streamed(llama_api: Hosted):
    client = llama_api.openai()
    answer = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
              '{"name": "get_time", "arguments": {"zone": "UTC"}}')
    reply = client.chat.completions.create(**answering(answer, tools=TOOLS))
    message = reply.choices[0].message
    assert message.content is None and reply.choices[0].finish_reason == "tool_calls"
    expected = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "UTC"}')]
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == expected
    content, calls, finishes = streamed_calls(list(client.chat.completions.create(
        **answering(answer, tools=TOOLS, stream=True))))
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in (0, 1)] == expected
    assert content == "" and finishes[-1] == "tool_calls"
    plain = client.chat.completions.create(**answering("It is sunny.", tools=TOOLS))
    assert (plain.choices[0].message.content, plain.choices[0].finish_reason) == ("It is sunny.", "stop")
    llama_api.assert_idle()


@pytest.mark.parametrize("streamed", [False, True])
def test_required_reads_the_schemas_array(plain_api: Hosted, streamed: bool):
    """The echo executor ignores the grammar: the answer written here is what the grammar would let through."""
    answer = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}])
    request = answering(answer, tools=TOOLS, tool_choice="required", stream=streamed)
    reply = plain_api.openai().chat.completions.create(**request)
    if streamed:
        content, calls, finishes = streamed_calls(list(reply))
        got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
        assert content == "" and finishes[-1] == "tool_calls"
        assert got == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]  # as generated
    else:
        message = reply.choices[0].message
        assert message.content == "" and reply.choices[0].finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
            ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    plain_api.assert_idle()


@pytest.mark.parametrize("streamed", [False, True])
def test_a_named_function_takes_the_answer_as_its_arguments(plain_api: Hosted, streamed: bool):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    request = answering('{"city": "Oslo"}', tools=TOOLS, tool_choice=choice, stream=streamed)
    reply = plain_api.openai().chat.completions.create(**request)
    if streamed:
        content, calls, finishes = streamed_calls(list(reply))
        assert (calls[0]["name"], calls[0]["arguments"], finishes[-1]) == ("get_weather", '{"city": "Oslo"}', "stop")
        assert CALL_ID.fullmatch(calls[0]["id"]) and content == ""
    else:
        (call,) = reply.choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments, reply.choices[0].finish_reason) == (
            "get_weather", '{"city": "Oslo"}', "stop")
    plain_api.assert_idle()


def test_forced_choices_carry_vllms_schema(hermes_api: Hosted, seen: list[pb.GenerateRequest]):
    client = hermes_api.openai()
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}, "auto", "none"):
        client.chat.completions.create(**answering("[]", tools=TOOLS, tool_choice=choice, max_tokens=2,
                                                   parallel_tool_calls=False if choice == "required" else None))
    required, named, auto, none = (json.loads(r.structured_output.json_schema) if r.HasField("structured_output")
                                   else None for r in seen)
    assert required == {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"]},
        {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}}}, "required": ["name", "parameters"]}]}}
    assert named == {"type": "object", "properties": {}} and auto is None and none is None
    # hermes keeps its tags in the text where a tool may be called (vLLM's adjustment)
    assert [r.skip_special_tokens if r.HasField("skip_special_tokens") else None for r in seen] == [
        False, False, False, None]
    hermes_api.assert_idle()


def test_tools_and_earlier_calls_reach_the_template(api: Hosted):
    """The render route shows the prompt: the tools as vLLM dumps them, the assistant's call with its arguments as
    an object, the tool's answer."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call-1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call-1", "content": "Sunny"}]
    rendered = api.openai().post("/chat/completions/render", cast_to=object, body={
        "model": "tools", "messages": messages, "tools": TOOLS, "tool_choice": "none"})
    prompt = TOKENIZER.decode(rendered["token_ids"], skip_special_tokens=False)
    tool_json = json.dumps({"type": "function", "function": {**WEATHER["function"]}}, ensure_ascii=False)
    assert prompt.startswith("Sunny<|endoftext|><|im_start|>system\nYou are a helpful assistant.")
    assert f"<tools>\n{tool_json}\n" in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nSunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in prompt
    # and the next turn answers from it
    reply = api.openai().chat.completions.create(model="tools", messages=messages, tools=TOOLS)
    assert reply.choices[0].message.content == "Sunny"
    # /tokenize renders it the same way, as vLLM's does, and names the tokens when asked
    tokenized = httpx.post(f"{api.url}/tokenize", json={"messages": messages, "tools": TOOLS,
                                                        "return_token_strs": True}, timeout=30).json()
    assert tokenized["tokens"] == rendered["token_ids"] and tokenized["count"] == len(rendered["token_ids"])
    assert tokenized["token_strs"] == [TOKENIZER.id_to_token(t) for t in rendered["token_ids"]]
    opened = httpx.post(f"{api.url}/tokenize", json={"messages": messages[:1] + [{"role": "assistant",
                        "content": "It is"}], "continue_final_message": True, "add_generation_prompt": False}).json()
    assert TOKENIZER.decode(opened["tokens"], skip_special_tokens=False).endswith("<|im_start|>assistant\nIt is")


def test_an_answers_message_goes_back_as_the_next_turn(api: Hosted):
    """The SDK's message object (with its calls) and the tool's answer, sent back: the template shows both."""
    client = api.openai()
    first = client.chat.completions.create(**answering(HERMES_ANSWER, tools=TOOLS))
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": HERMES_ANSWER}, first.choices[0].message,
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]
    rendered = client.post("/chat/completions/render", cast_to=object, body={
        "model": "tools", "messages": [m if isinstance(m, dict) else m.model_dump() for m in messages],
        "tools": TOOLS})
    prompt = TOKENIZER.decode(rendered["token_ids"], skip_special_tokens=False)
    assert ('<|im_start|>assistant\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nSunny\n</tool_response>") in prompt
    second = client.chat.completions.create(model="tools", messages=messages, tools=TOOLS)
    assert second.choices[0].message.content == "Sunny" and second.choices[0].finish_reason == "stop"


REFUSED = [
    ({"tools": []}, "tools", "`tools` must not be an empty array"),
    ({"tool_choice": "required"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Invalid value for `tool_choice`: sometimes!"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "Invalid value for `function`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice", "Expected field `name`"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "does not match any of the specified `tools`"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
      "extra_body": {"structured_outputs": {"regex": "a+"}}}, "structured_outputs", "not both"),
    ({"functions": [{"name": "f"}]}, "functions", "older form"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
      "tool_choice": "required"}, "tools", "tools: "),  # parameters llguidance cannot compile
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": ["not an object"]}], "tools": TOOLS,
      "tool_choice": "none"}, "messages", "messages[0].tool_calls[0]: assistant tool_calls entries must be objects."),
]


@pytest.mark.parametrize(("options", "param", "words"), REFUSED)
def test_bad_tool_input_is_a_400_naming_the_field(plain_api: Hosted, options: dict, param: str, words: str):
    with pytest.raises(openai.BadRequestError) as refused:
        plain_api.openai().chat.completions.create(**{**answering("hi"), **options})
    assert (refused.value.status_code, refused.value.param) == (400, param)
    assert refused.value.body["message"].startswith(param) and words in refused.value.body["message"]


def test_auto_needs_the_flags_as_on_vllm(plain_api: Hosted):
    """Tools without a tool_choice mean "auto", which this server (no flags) refuses with vLLM's reason."""
    for choice in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as refused:
            plain_api.openai().chat.completions.create(**answering("hi", tools=TOOLS, **choice))
        assert refused.value.param == "tool_choice" and refused.value.body["message"] == (
            'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
    reply = plain_api.openai().chat.completions.create(**answering("hi", tools=TOOLS, tool_choice="none"))
    assert reply.choices[0].message.content == "hi"

