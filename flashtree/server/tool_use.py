"""A chat request's tools: the template family that writes calls, the tools shown to the
template, `tool_choice` "required" or a named function enforced through structured output, and
the output parsed back into OpenAI's `tool_calls` (streamed or whole)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashtree.sampling import SamplingParams
from flashtree.server.errors import ApiError
from flashtree.server.forced_tools import forced_call_grammar
from flashtree.server.protocol import ChatCompletionRequest, NamedToolChoice
from flashtree.server.tool_calls import (
    StreamingToolParser,
    ToolCall,
    detect_tool_format,
    parse_tool_calls,
    tools_for_template,
)
from flashtree.structured_output import schema_error
from flashtree.tokenizer import Tokenizer


@dataclass(frozen=True)
class ToolUse:
    family: str  # a key of tool_calls.FORMATS
    tools: list[dict]  # as the chat template takes them
    forced: list[dict] | None  # the tools one of which the model must call
    tokenizer: Tokenizer

    @staticmethod
    def of(body: ChatCompletionRequest, tokenizer: Tokenizer) -> ToolUse | None:
        """The request's tool use, or None (no tools, or tool_choice "none"). Raises ApiError
        for tools the model's template cannot take, invalid parameter schemas, and a
        tool_choice that names no given tool."""
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice needs tools", "tool_choice")
            return None
        if choice == "none":
            return None
        family = detect_tool_format(tokenizer.chat_template or "")
        if family is None:
            raise ApiError(400, "this model's chat template takes no tools", "tools")
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
        return ToolUse(family, tools, forced, tokenizer)

    def constrain(self, params: SamplingParams, response_format) -> SamplingParams:
        """The request's sampling with tool-call markers kept in the text and, for a forced
        choice, the grammar of one call."""
        changes: dict = {"skip_special_tokens": False}
        if self.forced is not None:
            if params.guided_field or (response_format and response_format.type != "text"):
                raise ApiError(400, "tool_choice 'required' or a named function cannot be "
                                    "combined with response_format or guided_*", "tool_choice")
            changes["guided_grammar"] = forced_call_grammar(self.family, self.forced,
                                                            self.tokenizer)
        return dataclasses.replace(params, **changes)

    def parse(self, text: str, rid: str) -> tuple[str | None, list[ToolCall]]:
        return parse_tool_calls(text, self.family, self.tools, rid)

    def stream_parser(self, rid: str) -> StreamingToolParser:
        return StreamingToolParser(self.family, self.tools, rid)
