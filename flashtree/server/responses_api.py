"""OpenAI's Responses API (`POST /v1/responses`) for text in and out, as vLLM serves it without
tools: `input` a string or messages, `instructions` as the system message, `max_output_tokens`,
`temperature`, `top_p`; answered whole, or streamed as the `response.*` events that the
`openai` client's `responses.stream` assembles. Nothing is stored (`store` is false)."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import Field

from flashtree.engine.async_engine import AsyncEngine, Delta
from flashtree.sampling import SamplingParams
from flashtree.server import responses
from flashtree.server.errors import ApiError, EngineFailed, report_engine_failure
from flashtree.server.prompts import PromptBuilder
from flashtree.server.protocol import (
    ChatMessage,
    Flag,
    IgnoresUnknownFields,
    Temperature,
    Text,
    TopP,
    refused_unless,
)


class InputText(IgnoresUnknownFields):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(IgnoresUnknownFields):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]


class ResponsesRequest(IgnoresUnknownFields):
    model: str
    input: Text | list[InputMessage] = Field(min_length=1)
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: Flag = False
    store: Flag | None = None  # accepted; nothing is stored
    # Echoed in the response: text that JSON can carry (a lone surrogate is a 400, not a 500).
    metadata: dict[Text, Text] | None = None
    user: Text | None = None
    # Fields that would change the answer and are not implemented here.
    previous_response_id: refused_unless() = None  # nothing is stored to continue
    tools: refused_unless([]) = None
    tool_choice: refused_unless("none", "auto") = None
    background: refused_unless(False) = None
    include: refused_unless([]) = None
    top_logprobs: refused_unless(0) = None
    text: refused_unless({"format": {"type": "text"}}) = None

    def messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: the instructions first, as the system message."""
        turns = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) \
            else self.input
        out = [] if self.instructions is None else [
            ChatMessage(role="system", content=self.instructions)]
        for turn in turns:
            parts = [turn.content] if isinstance(turn.content, str) else \
                [p.text for p in turn.content]
            out.append(ChatMessage(role=turn.role,
                                   content=[{"type": "text", "text": t} for t in parts]))
        return out


class ResponseAnswer:
    """One response's object, its output message and its usage, as the Responses API shapes
    them (the fields the `openai` client's `Response` requires, and what vLLM fills in)."""

    def __init__(self, body: ResponsesRequest, model: str, prompt_tokens: int,
                 request_id: str) -> None:
        self.body, self.model, self.prompt_tokens = body, model, prompt_tokens
        self.request_id = request_id  # the server's id of the HTTP request, which the log names
        self.rid, self.item_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [self.text_part(text)]}

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, status: str, text: str | None = None, output_tokens: int = 0,
                 cached_tokens: int = 0, error: str | None = None) -> dict:
        """The response object; `text` None: no output yet. A response cut by
        max_output_tokens is "incomplete", as OpenAI reports it."""
        done = status in ("completed", "incomplete")
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "error": None if error is None else {
                "code": "server_error", "message": error},
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "output": [] if text is None else [
                self.message(text, "completed" if status == "completed" else "incomplete")],
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature, "top_p": self.body.top_p,
            "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "metadata": self.body.metadata or {}, "user": self.body.user,
            "previous_response_id": None, "reasoning": None,
            "usage": None if not done else {
                "input_tokens": self.prompt_tokens,
                # OpenAI's count of tokens written to its prompt cache for a retention
                # period: none here; the openai client's types require the field.
                "input_tokens_details": {"cached_tokens": cached_tokens,
                                         "cache_write_tokens": 0},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + output_tokens},
        }


async def answer(engine: AsyncEngine, prompts: PromptBuilder, body: ResponsesRequest,
                 model: str, max_tokens_limit: int, request_id: str):
    """The response to `body`: a dict, or its `ResponseEvents` when streamed. Raises
    ApiError, and EngineFailed when the engine fails the request."""
    if body.max_output_tokens is not None and body.max_output_tokens > max_tokens_limit:
        raise ApiError(400, f"max_output_tokens={body.max_output_tokens} exceeds this server's "
                            f"limit {max_tokens_limit}", "max_output_tokens")
    ids = await prompts.chat(body.messages(), None, body.max_output_tokens, "input",
                             "max_output_tokens")
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p,
                            max_tokens=body.max_output_tokens)
    try:
        streams, firsts = await responses.start(engine, [ids], params)
    except ValueError as e:  # what the server's checks leave: no room in the KV cache
        raise ApiError(400, str(e), "max_output_tokens") from None
    reply = ResponseAnswer(body, model, len(ids), request_id)
    if body.stream:
        return ResponseEvents(reply, streams[0], firsts[0])
    return await whole(reply, streams[0], firsts[0])


async def _deltas(stream: AsyncIterator[Delta], first: Delta) -> AsyncIterator[Delta]:
    delta = first
    while True:
        yield delta
        if delta.finished or delta.error:
            return
        delta = await anext(stream)


async def whole(reply: ResponseAnswer, stream: AsyncIterator[Delta], first: Delta) -> dict:
    """The finished response. Raises EngineFailed if the engine failed the request."""
    text, tokens, last = "", 0, first
    try:
        async for delta in _deltas(stream, first):
            if delta.error:
                raise EngineFailed(delta.error)
            text, tokens, last = text + delta.text, tokens + len(delta.token_ids), delta
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    status = "incomplete" if last.finish_reason == "length" else "completed"
    return reply.response(status, text, tokens, first.cached_tokens)


class ResponseEvents:
    """The response as server-sent `response.*` events, numbered in order; the last is
    `response.completed` (its status "incomplete" when cut by max_output_tokens, as vLLM sends
    it) or `response.failed`, also when the server cuts the stream (`failed`). A client that
    goes away aborts the request."""

    def __init__(self, reply: ResponseAnswer, stream: AsyncIterator[Delta], first: Delta
                 ) -> None:
        self.reply, self.stream, self.first = reply, stream, first
        self.numbers = itertools.count()
        self.text, self.tokens = "", 0  # the output so far

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def failed(self, message: str) -> str:
        """The `response.failed` event, with the output so far."""
        return self.event("response.failed", response=self.reply.response(
            "failed", self.text, self.tokens, error=message))

    async def events(self):
        reply = self.reply
        where = {"item_id": reply.item_id, "output_index": 0, "content_index": 0}
        yield self.event("response.created", response=reply.response("in_progress"))
        yield self.event("response.in_progress", response=reply.response("in_progress"))
        yield self.event("response.output_item.added", output_index=0,
                         item=reply.message("", "in_progress"))
        yield self.event("response.content_part.added", **where, part=reply.text_part(""))
        last = self.first
        try:
            async for delta in _deltas(self.stream, self.first):
                if delta.error:
                    yield self.failed(report_engine_failure(reply.request_id, delta.error))
                    return
                if delta.text:
                    yield self.event("response.output_text.delta", **where, delta=delta.text,
                                     logprobs=[])
                self.text, self.tokens = self.text + delta.text, self.tokens + len(
                    delta.token_ids)
                last = delta
        finally:
            await self.stream.aclose()  # type: ignore[attr-defined]
        status = "incomplete" if last.finish_reason == "length" else "completed"
        yield self.event("response.output_text.done", **where, text=self.text, logprobs=[])
        yield self.event("response.content_part.done", **where, part=reply.text_part(self.text))
        yield self.event("response.output_item.done", output_index=0,
                         item=reply.message(self.text, status))
        yield self.event("response.completed", response=reply.response(
            status, self.text, self.tokens, self.first.cached_tokens))
