"""OpenAI-compatible request bodies, strict about values (numbers finite and in range, booleans
true or false, bounded lists) and about the fields that would change the output if ignored,
while fields they do not know are ignored with a logged warning, as vLLM ignores them."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from flashtree.sampling import MAX_LOGPROBS, SamplingParams
from flashtree.tokenizer import unicode_error

log = logging.getLogger(__name__)

MAX_N = 16  # choices one request may ask for
MAX_STOP = 16  # stop strings: OpenAI allows 4, vLLM any number; room for vLLM's clients
MAX_PROMPTS = 64  # prompts in one completions request (vLLM sets no limit)

# Ranges, as vLLM's SamplingParams._verify_args and OpenAI's API reference give them: numbers
# are finite (JSON's Infinity and NaN are refused, and so is 1e308 by the ranges).
Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]  # OpenAI, vLLM
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]  # vLLM (0, 1]
# -1 or 0 is off; vLLM bounds top_k only below, SGLang reads 2^30 as the whole vocabulary.
TopK = Annotated[int, Field(ge=-1, le=1 << 30)]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]  # vLLM
# SGLang's range; vLLM asks only for a finite value > 0, and 1e308 overflows float32 logits.
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]  # OpenAI, vLLM
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]  # vLLM: a signed 64-bit integer
Flag = StrictBool  # true or false: "yes" or 1 is a mistake, not a boolean


def _text(value: str) -> str:
    error = unicode_error(value)
    if error is not None:
        raise ValueError(error)
    return value


Text = Annotated[str, AfterValidator(_text)]  # Unicode text (no lone surrogate)


def refused_unless(*neutral):
    """A field OpenAI or vLLM defines that changes the output and this server does not
    implement: ignoring it would silently answer something else, so any value but a neutral
    one is a 400 naming the field."""

    def check(value, info: ValidationInfo):
        # Typed: 1 and 0 are not the flags True and False.
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    return Annotated[Any, AfterValidator(check)]


# Unknown field names already warned about: each is logged once per process, and the first
# names only, so that a client inventing names can neither flood the log nor grow this set.
_WARNED_FIELDS: set[str] = set()
_MAX_WARNED_FIELDS = 1024


def _warn_once(model: str, names: list[str]) -> None:
    new = [n for n in names if n not in _WARNED_FIELDS]
    new = new[:max(0, _MAX_WARNED_FIELDS - len(_WARNED_FIELDS))]
    if new:
        _WARNED_FIELDS.update(new)
        more = f" and {len(new) - 8} more" if len(new) > 8 else ""
        log.warning("%s: ignored fields this server does not know: %s%s",
                    model, ", ".join(new[:8]), more)


class IgnoresUnknownFields(BaseModel):
    """A request object. A field it does not know (a typo, another server's extension, a newer
    API's field) is ignored, as vLLM does, with a warning in the log the first time."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _warn_ignored(cls, data):
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values()}
            _warn_once(cls.__name__, [repr(k)[:64] for k, v in data.items()
                                      if k not in known and v is not None])
        return data


class StreamOptions(IgnoresUnknownFields):
    include_usage: Flag = False
    continuous_usage_stats: Flag = False  # vLLM's: the usage so far in every chunk


class JsonSchemaFormat(IgnoresUnknownFields):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: Flag | None = None  # the schema is always enforced


class ResponseFormat(IgnoresUnknownFields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema' and only then")
        return self


_STRUCTURED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")


class _SamplingFields(IgnoresUnknownFields):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    min_p: MinP = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: Flag = False
    # flashtree's extension: the response carries each choice's decode steps and the tokens
    # they committed (`spec_decode`), how much speculation gave this request.
    spec_stats: Flag = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: Flag = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None  # accepted and not used, as OpenAI stores it
    # Structured output: OpenAI's response_format, or vLLM's guided_* fields (one of them).
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    # OpenAI's and vLLM's fields that change the output, not implemented here.
    logit_bias: refused_unless({}) = None
    min_tokens: refused_unless(0) = None
    use_beam_search: refused_unless(False) = None
    allowed_token_ids: refused_unless() = None
    bad_words: refused_unless([]) = None
    include_stop_str_in_output: refused_unless(False) = None
    prompt_logprobs: refused_unless() = None
    truncate_prompt_tokens: refused_unless() = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_token_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        given = info.data.get("max_tokens")
        if value is not None and given is not None and value != given:
            raise ValueError(f"max_tokens={given} and max_completion_tokens={value} disagree; "
                             "give one of them")
        return value

    @model_validator(mode="after")
    def _token_limit(self):
        self.max_tokens = self.max_tokens or self.max_completion_tokens
        return self

    @property
    def max_tokens_field(self) -> str:
        """The field the client gave the token limit in."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        if not all(stops):
            raise ValueError("a stop string must not be empty")
        for text in stops:
            _text(text)
        return stop

    @field_validator(*_STRUCTURED)
    @classmethod
    def _one_structured_output(cls, value, info: ValidationInfo):
        if value is None:
            return value
        earlier = [f for f in _STRUCTURED[:_STRUCTURED.index(info.field_name)]
                   if info.data.get(f) is not None]
        fmt = info.data.get("response_format")
        if fmt is not None and fmt.type != "text":
            earlier.insert(0, "response_format")
        if earlier:
            raise ValueError(f"give one structured-output field: {info.field_name} comes with "
                             f"{earlier[0]}")
        return value

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
    # One prompt or several (each its own n choices), as text or token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: Flag = False
    # The legacy API's count of alternatives per token (its limit is 5; vLLM's is larger).
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Sample this many and return the n with the highest cumulative log-probability.
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: refused_unless("") = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt):
        items = cls.prompt_list(prompt)
        if not 1 <= len(items) <= MAX_PROMPTS:
            raise ValueError(f"give 1 to {MAX_PROMPTS} prompts, got {len(items)}")
        listed = items[0] is not prompt  # a list of prompts: say which one is wrong
        for i, item in enumerate(items):
            where = f"prompt {i}: " if listed else ""
            error = isinstance(item, str) and unicode_error(item)
            if not item or error:
                raise ValueError(f"{where}{error or 'a prompt must not be empty'}")
        return prompt

    @staticmethod
    def prompt_list(prompt) -> list[str | list[int]]:
        """The request's prompts: one text or token list, or a list of them."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class ChatMessage(IgnoresUnknownFields):
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
        if content is None:
            return None
        if isinstance(content, str):
            return _text(content)
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part {part.get('type')!r} is not supported; allowed: "
                                 f"strings and parts {{'type': 'text', 'text': '...'}}")
            texts.append(part["text"])
        return _text("\n".join(texts))

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def for_template(self, arguments_as_text: bool = False) -> dict:
        """The message as chat templates read it: an assistant turn that only made calls keeps
        its null content (DeepSeek V3's template tests `content is none`), and earlier calls'
        arguments are objects (templates serialize them, so a JSON string would be encoded
        twice), or with `arguments_as_text` the JSON text as sent (for templates that join
        them to text, as DeepSeek V3's does). Raises ValueError for arguments that are not
        JSON."""
        out = self.model_dump(exclude_none=True)
        if self.tool_calls:
            out["content"] = self.content
        for call in out.get("tool_calls", []):
            function = call.get("function", {})
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except ValueError:
                    raise ValueError(f"tool call arguments are not JSON: {arguments!r}") from None
                function["arguments"] = arguments if arguments_as_text else parsed
            elif arguments_as_text and arguments is not None:
                function["arguments"] = json.dumps(arguments, ensure_ascii=False)
        return out


class FunctionName(IgnoresUnknownFields):
    name: str


class NamedToolChoice(IgnoresUnknownFields):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: Flag = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Flag | None = None  # accepted; a forced choice makes one call
    # vLLM's chat fields that change the prompt or the output, not implemented here.
    echo: refused_unless(False) = None
    add_generation_prompt: refused_unless(True) = None
    continue_final_message: refused_unless(False) = None
    chat_template: refused_unless() = None
    functions: refused_unless([]) = None  # OpenAI's deprecated form of tools
    function_call: refused_unless("none", "auto") = None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
