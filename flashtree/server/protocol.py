"""OpenAI-compatible request bodies. Unknown fields are rejected (extra="forbid") so a typo in
a field name is an error, not a silently ignored setting."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flashtree.sampling import MAX_LOGPROBS, SamplingParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


MAX_N = 16  # choices one request may ask for


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema' and only then")
        return self


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # flashtree's extension: the response carries each choice's decode steps and the tokens
    # they committed (`spec_decode`), how much speculation gave this request.
    spec_stats: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # accepted and not used, as OpenAI stores it
    # Structured output: OpenAI's response_format, or vLLM's guided_* fields (one of them).
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None

    @model_validator(mode="after")
    def _one_token_limit(self):
        given = {self.max_tokens, self.max_completion_tokens} - {None}
        if len(given) > 1:
            raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens="
                             f"{self.max_completion_tokens} disagree; give one of them")
        self.max_tokens = self.max_tokens or self.max_completion_tokens
        return self

    def sampling_params(self, default_max_tokens: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            max_tokens=self.max_tokens or default_max_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, n=self.n,
            logprobs=self.num_logprobs, prompt_logprobs=self.num_prompt_logprobs,
            guided_regex=self.guided_regex, guided_grammar=self.guided_grammar,
            guided_choice=self.guided_choice, **self._json_constraint(),
        )

    def _json_constraint(self) -> dict:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return {"guided_json": self.guided_json}
        if self.guided_json is not None:
            raise ValueError("give response_format or guided_json, not both")
        if fmt.type == "json_object":
            return {"guided_json_object": True}
        assert fmt.json_schema is not None
        return {"guided_json": fmt.json_schema.schema_}

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per output token when log-probs are asked for, else None."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(min_length=1)
    echo: bool = False
    # The legacy API's count of alternatives per token (its limit is 5; vLLM's is larger).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Sample this many and return the n with the highest cumulative log-probability.
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or a list of text parts ({"type": "text", "text": ...}) joined by newlines;
    # None only in an assistant message that made tool calls.
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls (OpenAI's shape)
    tool_call_id: str | None = None  # the call a tool message answers

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: str | list[dict] | None) -> str | None:
        if content is None or isinstance(content, str):
            return content
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part {part.get('type')!r} is not supported; allowed: "
                                 f"strings and parts {{'type': 'text', 'text': '...'}}")
            texts.append(part["text"])
        return "\n".join(texts)

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self) -> dict:
        """The message as chat templates read it: earlier calls' arguments as objects (the
        templates serialize them, so a JSON string would be encoded twice)."""
        out = self.model_dump(exclude_none=True)
        for call in out.get("tool_calls", []):
            function = call.get("function", {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"])
                except ValueError:
                    raise ValueError(f"tool call arguments are not JSON: "
                                     f"{function['arguments']!r}") from None
        return out


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; a forced choice makes one call

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
