"""An Anthropic Messages request as the chat request it amounts to (``messages_api.inputs``), as vLLM converts it:
tool choice, thinking and output settings in chat's shapes, and a bad block refused naming its place."""

from __future__ import annotations

import pytest

from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.messages_api.inputs import chat_request, renamed
from scheduler_svc.api.http.messages_api.schemas import MessagesRequest

WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}


def chat_of(**body: object):
    return chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 9,
                                                        "messages": [{"role": "user", "content": "Hi"}], **body}))


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    (None, "auto", None), ({"type": "auto"}, "auto", True), ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
     {"type": "function", "function": {"name": "get_weather"}}, False)])
def test_tool_choice_in_chats_shape(choice: dict | None, expected: object, parallel: bool | None):
    chat = chat_of(tools=[WEATHER], **({"tool_choice": choice} if choice else {}))
    assert chat.tool_choice == expected and chat.parallel_tool_calls is parallel
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]
    assert chat_of().tool_choice is None and chat_of().tools is None


def test_settings_in_chats_shape():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_of(stop_sequences=["END"], temperature=0.2, top_p=0.9, top_k=5,
                   output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "high"})
    assert (chat.max_completion_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k) == (
        9, ["END"], 0.2, 0.9, 5)
    assert chat.response_format.json_schema.schema_ == schema and chat.reasoning_effort == "high"
    assert chat_of(thinking={"type": "disabled"}).reasoning_effort == "none"
    enabled = {"type": "enabled", "budget_tokens": 2048}
    assert chat_of(max_tokens=4096, thinking=enabled).reasoning_effort is None
    assert chat_of(max_tokens=4096, thinking=enabled).thinking_token_budget is None, "the server reads no thinking"
    thinking = chat_request(MessagesRequest.model_validate({"model": "m", "max_tokens": 4096, "thinking": enabled,
                                                           "messages": [{"role": "user", "content": "Hi"}]}),
                            thinks=True)
    assert thinking.thinking_token_budget == 2048
    with pytest.raises(ApiError, match="budget_tokens: must be less than max_tokens"):
        chat_of(thinking=enabled)


def test_a_system_message_inside_the_conversation_stays_in_its_place():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = chat_of(messages=[{"role": "user", "content": "Hi"}, {"role": "system", "content": "Now in French."},
                             {"role": "user", "content": parts}])
    assert [(m.role, m.content if isinstance(m.content, str) else [p.text for p in m.content])
            for m in chat.messages] == [("user", "Hi"), ("system", "Now in French."), ("user", ["a", "b"])]


@pytest.mark.parametrize(("messages", "says"), [
    ([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}],
     "messages[0].content[0].input: must be an object"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 3}]}],
     "messages[0].content[0].tool_use_id: must be a string"),
    ([{"role": "user", "content": ["Hi"]}], "messages[0].content[0]: a content block is an object"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                    "content": [{"type": "image", "source": {}}]}]}],
     "messages[0].content[0].content[0]: only text blocks are supported in a tool result"),
])
def test_a_bad_block_is_refused_naming_its_place(messages: list, says: str):
    with pytest.raises(ApiError) as refused:
        chat_of(messages=messages)
    assert refused.value.status == 400 and str(refused.value).startswith(says)


def test_chat_refusals_are_named_as_the_messages_api_names_them():
    error = renamed(ApiError(400, "max_completion_tokens: prompt of 3 tokens + max_tokens 9", "max_completion_tokens"))
    assert (str(error), error.detail.param) == ("max_tokens: prompt of 3 tokens + max_tokens 9", "max_tokens")


def test_blocks_read_as_leniently_as_vllm_reads_them():
    chat = chat_of(messages=[
        {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": None}, {"type": "text"},
                                          {"type": "tool_use", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "content": "done"}]}],
        system="x-anthropic-billing-header: kept when the whole system prompt is a string",
        tools=[{"name": "f", "input_schema": {"properties": {}}}], output_config={"effort": "xhigh"})
    system, user, assistant, tool = chat.messages
    assert system.content.startswith("x-anthropic-billing-header") and user.content == "Hi"
    assert assistant.content is None and assistant.reasoning is None and assistant.tool_calls[0]["id"]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "", "done")
    assert chat.tools[0].function.parameters == {"type": "object", "properties": {}}
    assert chat.reasoning_effort == "xhigh"
