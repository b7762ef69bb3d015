"""A chat answer as the Responses API's output: its thinking a ``reasoning`` item, its text a ``message``, each tool
call a ``function_call`` (read by the chat route's readers, ``chat_output``); whole, or as the streamed events
that open each item, carry its deltas and close it, as vLLM sends them (an item closes when another kind of delta
begins; the last event is ``response.completed`` whatever the status, as on vLLM).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator, Callable

from scheduler_svc.api.frontend import Generation
from scheduler_svc.api.http import responses
from scheduler_svc.api.http.chat_output import DeltaParts, new_tool_call_id
from scheduler_svc.api.http.errors import ApiError
from scheduler_svc.api.http.responses_api.inputs import renamed
from scheduler_svc.api.http.responses_api.schemas import (
    Event,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    Usage,
)
from scheduler_svc.api.http.schemas import CompletionUsage, TokenLogprob
from scheduler_svc.api.http.tool_schemas import DeltaToolCall
from scheduler_svc.api.http.translate import Translated, api_error
from scheduler_svc.core.errors import RequestFailed
from scheduler_svc.core.tokenizer import ModelTokenizer

# A finished answer's status by its finish reason; "stop" and the rest are "completed".
STATUS_OF_FINISH = {"length": "incomplete", "abort": "cancelled"}


def sse_event(kind: str, number: int, **fields: object) -> str:
    return f"event: {kind}\ndata: {Event(type=kind, sequence_number=number, **fields).model_dump_json()}\n\n"


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def logprobs_of(piece: responses.Piece, t: Translated, tokenizer: ModelTokenizer | None) -> list[TokenLogprob] | None:
    """The piece's tokens' logprobs where ``include`` asked (none where the thinking they would show is left out)."""
    if t.chat_output is not None and t.chat_output.hides_tokens:
        return None
    logprobs = responses.chat_logprobs(piece, t, tokenizer)
    return logprobs.content if logprobs is not None else None


def output_items(t: Translated, choice: responses.Piece, tokenizer: ModelTokenizer | None) -> list[OutputItem]:
    output = t.chat_output
    reasoning, content, calls = None, choice.text, []
    if output is not None and output.active:
        parsed = output.reader().whole(choice.text)
        reasoning, content, calls = parsed.reasoning, parsed.content, output.one_call(parsed.calls)
    items: list[OutputItem] = []
    if reasoning:
        items.append(ReasoningItem(id=item_id("rs"), content=[ReasoningText(text=reasoning)]))
    if content:
        text = OutputText(text=content, logprobs=logprobs_of(choice, t, tokenizer))
        items.append(MessageItem(id=item_id("msg"), status="completed", content=[text]))
    items += [FunctionCallItem(id=item_id("fc"), call_id=call.id, name=call.function.name,
                               arguments=call.function.arguments, status="completed") for call in calls]
    return items


def usage_of(usage: CompletionUsage, reasoning_tokens: int) -> Usage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Usage(input_tokens=usage.prompt_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                 output_tokens=usage.completion_tokens,
                 output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                 total_tokens=usage.prompt_tokens + usage.completion_tokens)


def finished(shell: ResponseObject, finish_reason: str | None, items: list[OutputItem], usage: Usage) -> ResponseObject:
    status = STATUS_OF_FINISH.get(finish_reason or "", "completed")
    details = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
    return shell.model_copy(update={"status": status, "output": items, "usage": usage, "incomplete_details": details})


def failed(shell: ResponseObject, message: str) -> ResponseObject:
    return shell.model_copy(update={"status": "failed", "error": ResponseError(code="server_error", message=message)})


async def whole_response(shell: ResponseObject, t: Translated, generations: list[Generation],
                         tokenizer: ModelTokenizer | None) -> ResponseObject:
    """The finished response; raises a failure as an answer, named as the Responses API names it."""
    try:
        choices, usage = await responses.whole(t, generations)
    except ApiError as e:
        raise renamed(e) from e
    choice = choices[0]
    counter = t.chat_output.reasoning_tokens(tokenizer) if t.chat_output is not None else None
    thinking = counter.add(choice.token_ids) if counter is not None else 0
    return finished(shell, choice.finish_reason, output_items(t, choice, tokenizer), usage_of(usage, thinking))


class EventWriter:
    """The numbered events of one streamed answer, and the output items they closed."""

    def __init__(self) -> None:
        self.number = 0
        self.index = 0  # the open item's output_index
        self.open: str | None = None  # "reasoning", "message" or "call"
        self.item_id = ""
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.call: FunctionCallItem | None = None
        self.call_index: int | None = None
        self.items: list[OutputItem] = []
        # Text of blanks alone, held back: before a call it is no message (as the whole answer reads it).
        self.blank, self.blank_logprobs = "", []

    def event(self, kind: str, **fields: object) -> str:
        self.number += 1
        return sse_event(kind, self.number - 1, **fields)

    def opened(self, kind: str, item: OutputItem, part: dict[str, object] | None) -> list[str]:
        self.open, self.item_id, self.text, self.logprobs = kind, item.id, "", []
        events = [self.event("response.output_item.added", output_index=self.index, item=item.model_dump(mode="json"))]
        if part is not None:
            events.append(self.event("response.content_part.added", output_index=self.index, item_id=item.id,
                                     content_index=0, part=part))
        return events

    def switch(self, kind: str) -> list[str]:
        if self.open == kind:
            return []
        if kind == "reasoning":
            item = ReasoningItem(id=item_id("rs"), status="in_progress")
            return self.close() + self.opened(kind, item, ReasoningText(text="").model_dump())
        item = MessageItem(id=item_id("msg"), status="in_progress", content=[])
        return self.close() + self.opened(kind, item, OutputText(text="", logprobs=[]).model_dump(mode="json"))

    def open_call(self, call: DeltaToolCall) -> list[str]:
        name = call.function.name if call.function is not None and call.function.name else ""
        self.call = FunctionCallItem(id=item_id("fc"), call_id=call.id or new_tool_call_id(), name=name, arguments="",
                                     status="in_progress")
        self.call_index = call.index
        return self.close() + self.opened("call", self.call, None)

    def close(self) -> list[str]:
        """The open item's closing events (none when none is open)."""
        at = {"item_id": self.item_id, "output_index": self.index}
        item: OutputItem
        if self.open == "reasoning":
            part = ReasoningText(text=self.text)
            item = ReasoningItem(id=self.item_id, content=[part], status="completed")
            events = [self.event("response.reasoning_text.done", **at, content_index=0, text=self.text),
                      self.event("response.content_part.done", **at, content_index=0, part=part.model_dump())]
        elif self.open == "message":
            text = OutputText(text=self.text, logprobs=self.logprobs or None)
            item = MessageItem(id=self.item_id, status="completed", content=[text])
            events = [self.event("response.output_text.done", **at, content_index=0, text=self.text, logprobs=[]),
                      self.event("response.content_part.done", **at, content_index=0,
                                 part=text.model_dump(mode="json"))]
        elif self.open == "call" and self.call is not None:
            item = self.call.model_copy(update={"arguments": self.text, "status": "completed"})
            events = [self.event("response.function_call_arguments.done", **at, name=item.name, arguments=self.text)]
        else:
            return []
        events.append(self.event("response.output_item.done", output_index=self.index,
                                 item=item.model_dump(mode="json")))
        self.items.append(item)
        self.index += 1
        self.open = None
        return events

    def feed(self, parts: DeltaParts, logprobs: list[TokenLogprob] | None) -> list[str]:
        """One delta's events: its thinking, then its text, then its calls, call by call (vLLM's order)."""
        events = []
        if parts.reasoning:
            events += self.switch("reasoning")
            self.text += parts.reasoning
            events.append(self.event("response.reasoning_text.delta", item_id=self.item_id, output_index=self.index,
                                     content_index=0, delta=parts.reasoning))
        if parts.content:
            events += self.text_delta(parts.content, logprobs or [])
        for index, group in itertools.groupby(parts.calls, key=lambda call: call.index):
            calls = list(group)
            if self.open != "call" or self.call_index != index:
                self.blank, self.blank_logprobs = "", []
                events += self.open_call(calls[0])
            arguments = "".join(call.function.arguments or "" for call in calls if call.function is not None)
            if arguments:
                self.text += arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self.item_id,
                                         output_index=self.index, delta=arguments))
        return events

    def text_delta(self, text: str, logprobs: list[TokenLogprob], hold: bool = True) -> list[str]:
        if hold and self.open != "message" and not (self.blank + text).strip():
            self.blank += text
            self.blank_logprobs += logprobs
            return []
        text, logprobs = self.blank + text, self.blank_logprobs + logprobs
        self.blank, self.blank_logprobs = "", []
        events = self.switch("message")
        self.text += text
        self.logprobs += logprobs
        events.append(self.event("response.output_text.delta", item_id=self.item_id, output_index=self.index,
                                 content_index=0, delta=text, logprobs=[lp.model_dump() for lp in logprobs]))
        return events

    def finish(self) -> list[str]:
        """The last item closed; blanks held back are the answer's text where no call followed them."""
        events = self.text_delta("", [], hold=False) if self.blank and not any(
            isinstance(item, FunctionCallItem) for item in self.items) and self.open != "call" else []
        return events + self.close()


async def events(shell: ResponseObject, t: Translated, generations: list[Generation],
                 tokenizer: ModelTokenizer | None, done: Callable[[ResponseObject], None]) -> AsyncIterator[str]:
    """The answer's events, from ``response.created`` to ``response.completed`` (or an ``error`` event where the
    request fails after the stream began); ``done`` gets the final response (to store)."""
    writer = EventWriter()
    for kind in ("response.created", "response.in_progress"):
        yield writer.event(kind, response=shell.model_dump(mode="json"))
    output = t.chat_output if t.chat_output is not None and t.chat_output.active else None
    reader = output.reader() if output is not None else None
    counter = t.chat_output.reasoning_tokens(tokenizer) if t.chat_output is not None else None
    usage, finish = responses.UsageTotal(), None
    try:
        async for piece in responses.pieces(t, generations):
            usage.add(piece.usage)
            if counter is not None:
                counter.add(piece.token_ids)
            finish = piece.finish_reason or finish
            if reader is None:
                parts: DeltaParts | None = DeltaParts(piece.text)
            else:
                parts = reader.delta(piece.text, finished=piece.finish_reason is not None)
            if parts is not None:
                if output is not None:
                    parts.calls = output.one_call(parts.calls)
                for event in writer.feed(parts, logprobs_of(piece, t, tokenizer)):
                    yield event
    except RequestFailed as e:
        error = renamed(api_error(e, t.renames))
        done(failed(shell, str(error)))
        yield writer.event("error", code=error.detail.code or error.detail.type, message=str(error),
                           param=error.detail.param)
        return
    for event in writer.finish():
        yield event
    final = finished(shell, finish, writer.items, usage_of(usage.usage(), counter.count if counter else 0))
    done(final)
    yield writer.event("response.completed", response=final.model_dump(mode="json"))
