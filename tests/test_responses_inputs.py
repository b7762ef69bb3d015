"""A Responses API request as the chat request it amounts to (``responses_api.inputs``), as vLLM reads it: input
items joined into chat messages, the conversation a stored response continues, tools, tool choice and text format in
chat's shapes, a last message in progress continued; and every bad item refused naming its place."""

from __future__ import annotations

import pytest

from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.responses_api.inputs import conversation, output_messages, renamed
from scheduler_svc.api.http.responses_api.schemas import (
    FunctionCallItem,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
)
from scheduler_svc.api.http.responses_api.store import ResponseStore, Stored

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def chat_of(auto_parser: str = "hermes", history: list | None = None, **body: object):
    return conversation(ResponsesRequest.model_validate({"model": "m", **body}), history, auto_parser, False)


def test_a_string_input_is_one_user_message_after_the_instructions():
    c = chat_of(input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_k=3)
    chat = c.chat
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_k, chat.add_generation_prompt) == (7, 0.5, 3, True)
    assert chat.tools is None and chat.tool_choice == "none" and chat.response_format is None


def test_items_join_as_vllm_joins_them():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"type": "message", "role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny and rain."}]},
    ]
    messages = chat_of(input=items, tools=[WEATHER]).messages
    call = [{"id": f"c{i}", "type": "function",
             "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
            for i, city in ((1, "Paris"), (2, "Rome"))]
    assert messages == [
        {"role": "developer", "content": "Rules."}, {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "reasoning": "Two.", "tool_calls": call},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny and rain."}]


def test_tools_tool_choice_and_text_format_in_chats_shapes():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_of(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                   text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}},
                   parallel_tool_calls=False, include=["message.output_text.logprobs"], top_logprobs=3,
                   reasoning={"effort": "low"}, truncation="auto").chat
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER["parameters"]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format.json_schema.schema_ == schema and chat.response_format.json_schema.name == "out"
    assert (chat.parallel_tool_calls, chat.logprobs, chat.top_logprobs) == (False, True, 3)
    assert chat.reasoning_effort == "low"
    assert chat.truncate_prompt_tokens == -1
    assert chat_of(input="x", text={"format": {"type": "json_object"}}).chat.response_format.type == "json_object"
    assert chat_of(input="x", top_logprobs=3).chat.logprobs is False  # top_logprobs counts only with include
    assert chat_of(input="x", structured_outputs={"regex": "[0-9]+"}).chat.structured_outputs.regex == "[0-9]+"


def test_auto_without_a_parser_answers_in_text_as_on_vllm():
    assert chat_of("", input="x", tools=[WEATHER]).chat.tool_choice == "none"
    assert chat_of("hermes", input="x", tools=[WEATHER]).chat.tool_choice == "auto"
    assert chat_of("", input="x", tools=[WEATHER], tool_choice="required").chat.tool_choice == "required"


def test_the_instructions_go_first_and_are_not_kept_with_the_conversation():
    history = [{"role": "developer", "content": "In French."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Salut"}]
    c = chat_of(input="Again", instructions="New rules.", history=history)
    assert c.messages == [*history, {"role": "user", "content": "Again"}]  # what a later request continues
    assert [m.content for m in c.chat.messages] == ["New rules.", "In French.", "Hi", "Salut", "Again"]


def test_a_call_joining_the_stored_conversation_leaves_what_is_kept_as_it_was():
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Let me check."}]
    kept = [dict(m) for m in history]
    c = chat_of(input=[{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}],
                history=history, tools=[WEATHER])
    assert c.messages[-1]["tool_calls"][0]["id"] == "c1" and history == kept


def test_a_stored_answer_is_the_assistants_turn_without_its_thinking():
    output = [ReasoningItem(id="rs", content=[ReasoningText(text="hmm")]),
              MessageItem(id="m", status="completed", content=[OutputText(text="Let me check.")]),
              FunctionCallItem(id="f", call_id="c1", name="get_weather", arguments="{}", status="completed")]
    assert output_messages(output) == [{"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]


def test_a_last_assistant_message_in_progress_is_continued():
    items = [{"role": "user", "content": "Count"},
             {"type": "message", "role": "assistant", "status": "incomplete", "content": [
                 {"type": "output_text", "text": "1, 2,"}]}]
    chat = chat_of(input=items).chat
    assert (chat.continue_final_message, chat.add_generation_prompt) == (True, False)
    assert chat_of(input=items[:1]).chat.continue_final_message is False


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": [{"type": "web_search_call"}]}, "input", "input[0].type: input items of type 'web_search_call'"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role: must be one of"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].content[0]: only text parts are supported, got 'input_image'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "input[0].call_id: must be a string"),
    ({"input": [{"type": "reasoning", "encrypted_content": "xyz", "summary": []}]}, "input",
     "input[0].encrypted_content"),
    ({"input": "x", "tool_choice": {"type": "mcp", "server_label": "s"}}, "tool_choice", "tool_choice: give"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text",
     "text.format.schema: type json_schema needs a schema"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "prompt: prompt templates are not supported"),
    ({"input": "x", "structured_outputs": {"regex": "[0-9]+"}, "text": {"format": {"type": "json_object"}}},
     "structured_outputs", "structured_outputs: give either text.format or structured_outputs, not both"),
])
def test_bad_input_is_refused_naming_its_place(body: dict, param: str, says: str):
    with pytest.raises(ApiError) as refused:
        chat_of(**body)
    assert refused.value.status == 400 and refused.value.detail.param == param and str(refused.value).startswith(says)


def test_chat_refusals_are_named_as_the_responses_api_names_them():
    error = renamed(ApiError(400, "max_completion_tokens: must be at most 10", "max_completion_tokens"))
    assert (str(error), error.detail.param) == ("max_output_tokens: must be at most 10", "max_output_tokens")
    error = renamed(ApiError(400, "messages[3].content: bad", "messages"))
    assert (str(error), error.detail.param) == ("input: bad", "input")
    kept = ApiError(400, "temperature: must be >= 0", "temperature")
    assert renamed(kept) is kept


def test_the_store_keeps_the_newest_and_what_still_works_past_capacity():
    store = ResponseStore(1)

    def entry(response_id: str, status: str) -> Stored:
        return Stored(ResponseObject(id=response_id, created_at=0, status=status, model="m"), [])

    store.put(entry("working", "in_progress"))
    store.put(entry("done", "completed"))
    assert list(store.entries) == ["working", "done"]  # past capacity: the one still working stays, and the newest
    store.entries["working"].response.status = "completed"
    store.put(entry("newest", "completed"))
    assert list(store.entries) == ["newest"]
    with pytest.raises(ApiError) as missing:
        store.get("working", "previous_response_id")
    assert missing.value.status == 404 and missing.value.detail.param == "previous_response_id"
