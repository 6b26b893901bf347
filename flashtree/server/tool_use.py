"""A chat request's tools: the template family that writes calls (or the generic format, for
templates that write none), the tools shown to the model, `tool_choice` "required" or a named
function enforced through structured output, the conversation rendered as the template takes
it, and the output parsed back into OpenAI's `tool_calls` (streamed or whole)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from flashtree.sampling import SamplingParams
from flashtree.server.errors import ApiError
from flashtree.server.forced_tools import forced_call_grammar, generic_grammar
from flashtree.server.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice
from flashtree.server.tool_calls import (
    GENERIC,
    GenericToolParser,
    StreamingToolParser,
    ToolCall,
    detect_tool_format,
    parse_tool_calls,
    tool_parser,
    tools_for_template,
)
from flashtree.structured_output import schema_error
from flashtree.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass(frozen=True)
class ToolUse:
    family: str  # a key of tool_calls.FORMATS, or GENERIC
    tools: list[dict]  # as the chat template takes them
    forced: list[dict] | None  # the tools one of which the model must call
    parallel: bool  # the generic format may make several calls at once
    tokenizer: Tokenizer

    @staticmethod
    def of(body: ChatCompletionRequest, tokenizer: Tokenizer) -> ToolUse | None:
        """The request's tool use, or None (no tools, or tool_choice "none"). Raises ApiError
        for tools that are not functions, invalid parameter schemas, and a tool_choice that
        names no given tool."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice needs tools", "tool_choice")
            return None
        if choice == "none":
            return None
        family = detect_tool_format(tokenizer.chat_template or "") or GENERIC
        try:
            tools = tools_for_template(body.tools)
        except ValueError as e:
            raise ApiError(400, str(e), "tools") from None
        for i, tool in enumerate(tools):
            error = schema_error(tool["function"].get("parameters") or {})
            if error is not None:
                raise ApiError(400, f"tools.{i}.function.parameters is not a JSON schema this "
                                    f"server can follow: {error}", f"tools.{i}.function")
        forced = None
        if choice == "required":
            forced = tools
        elif isinstance(choice, NamedToolChoice):
            forced = [t for t in tools if t["function"]["name"] == choice.function.name]
            if not forced:
                raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not "
                                    "among the tools", "tool_choice")
        return ToolUse(family, tools, forced, body.parallel_tool_calls is not False, tokenizer)

    def constrain(self, params: SamplingParams, response_format) -> SamplingParams:
        """The request's sampling with tool-call markers kept in the text and the grammar of
        one call (a forced choice) or of the generic format's answer (always)."""
        if self.family == GENERIC:
            grammar = generic_grammar(self.tools, self.forced, self.parallel)
        elif self.forced is not None:
            grammar = forced_call_grammar(self.family, self.forced, self.tokenizer)
        else:
            return dataclasses.replace(params, skip_special_tokens=False)
        if params.guided_field or (response_format and response_format.type != "text"):
            what, param = ("tools on a model whose chat template renders none (the generic "
                           "format)", "tools") if self.forced is None else (
                "tool_choice 'required' or a named function", "tool_choice")
            raise ApiError(400, f"{what} cannot be combined with response_format or guided_*",
                           param)
        return dataclasses.replace(params, skip_special_tokens=False, guided_grammar=grammar)

    def generic_instructions(self) -> str:
        """The generic format's system prompt: the tools (one JSON object a line, as Hermes
        templates list them), and the JSON object to answer with."""
        call = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
        if self.forced is None:
            answer = f'{call} to call tools, or {{"response": "<your reply>"}} to reply'
        else:
            names = " or ".join(t["function"]["name"] for t in self.forced)
            answer = f"{call} calling {names}"
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools)
        return f"You can call these tools:\n{listing}\n\nAnswer with one JSON object: {answer}."

    def parse(self, text: str, rid: str) -> tuple[str | None, list[ToolCall]]:
        return parse_tool_calls(text, self.family, self.tools, rid)

    def stream_parser(self, rid: str) -> StreamingToolParser | GenericToolParser:
        return tool_parser(self.family, self.tools, rid)


class TemplateFailed(Exception):
    """No form of the conversation renders; the first form's error."""


def template_forms(messages: list[ChatMessage]) -> list[list[dict]]:
    """The conversation in the forms chat templates take, to try in order: earlier calls'
    arguments as objects (the form transformers documents), then, when there are calls, as
    JSON text (DeepSeek V3's template joins them to text and fails on objects). Raises
    ValueError for arguments that are not JSON."""
    forms = [[m.for_template() for m in messages]]
    if any(m.tool_calls for m in messages):
        forms.append([m.for_template(arguments_as_text=True) for m in messages])
    return forms


def render_first(forms: list[list[dict]], render: Callable[[list[dict]], T]) -> T:
    """`render` (a chat template) of the first form it accepts. Raises TemplateFailed."""
    errors = []
    for form in forms:
        try:
            return render(form)
        except Exception as e:  # noqa: BLE001 - a template error is the request's problem
            errors.append(e)
    raise TemplateFailed(errors[0])


def generic_messages(messages: list[ChatMessage], instructions: str | None) -> list[dict]:
    """The conversation for a template that renders no tools (llama.cpp's polyfill): earlier
    calls as the JSON object the model answers with, tool results as user turns holding
    {"tool_response": ...}, and `instructions` ending the system prompt (or being it). Raises
    ValueError for call arguments that are not JSON."""
    out = []
    for m in messages:
        shown = m.for_template()
        if m.tool_calls:
            answer: dict = {"tool_calls": [
                {"id": c.get("id"), "name": c["function"]["name"],
                 "arguments": c["function"].get("arguments")}
                for c in shown["tool_calls"] if isinstance(c.get("function"), dict)]}
            if m.content:
                answer["content"] = m.content
            shown = {"role": "assistant", "content": json.dumps(answer, ensure_ascii=False)}
        elif m.role == "tool":
            result = {"tool_call_id": m.tool_call_id, "content": m.content}
            shown = {"role": "user", "content": json.dumps({"tool_response": result},
                                                           ensure_ascii=False)}
        out.append(shown)
    if instructions is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


def render_prompt(messages: list[ChatMessage], tokenizer: Tokenizer, tools: ToolUse | None,
                  param: str = "messages") -> list[int]:
    """A chat request's prompt ids: the conversation through the model's chat template, with
    the tools (the generic format's, for a template that renders none). Raises ApiError naming
    `param`, the request field that holds the conversation."""
    generic = detect_tool_format(tokenizer.chat_template or "") is None
    try:
        if generic:
            instructions = tools.generic_instructions() if tools is not None else None
            forms = [generic_messages(messages, instructions)]
        else:
            forms = template_forms(messages)
    except ValueError as e:
        raise ApiError(400, str(e), param) from None
    shown_tools = None if generic or tools is None else tools.tools
    try:
        return render_first(forms, lambda form: tokenizer.apply_chat_template(form, shown_tools))
    except TemplateFailed as e:
        raise ApiError(400, f"the chat template failed on the {param}: {e}", param) from None
