"""Tool calls in a chat model's output, parsed into OpenAI's `tool_calls`. Each chat-template
family writes calls its own way: Hermes/Qwen (`<tool_call>{json}</tool_call>`), Llama 3.x
(`{"name": ..., "parameters": {...}}`, possibly after `<|python_tag|>`), Kimi K2 and DeepSeek
V3/V3.1 (sections of special tokens); templates that write no calls get the generic format
(one JSON object, `GenericToolParser`). One incremental scanner per format serves streamed and
whole responses alike, so a stream's content and calls always add up to the whole response's.

A tool-call block becomes calls only when every call in it is well formed and names one of the
request's tools; otherwise its text stays in the content as the model wrote it, so nothing the
model said is lost. Whitespace right after a call is dropped, and whitespace right before one is
kept only when more content follows ("Let me check.\\n<tool_call>...</tool_call>" has the
content "Let me check."). Text without a call is returned unchanged."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def to_openai(self) -> dict:
        """One entry of a chat message's `tool_calls`."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


_Call = tuple[str, Any, str | None]  # name, decoded arguments, the call id the model wrote


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _named(obj: Any) -> _Call | None:
    """A Hermes or Llama call object: {"name": ..., "arguments" (or "parameters"): {...}}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], obj.get("arguments", obj.get("parameters")), None


def _hermes(body: str) -> list[_Call] | None:
    call = _named(_json(body))
    return None if call is None else [call]


def _llama(body: str) -> list[_Call] | None:
    """One or more call objects, separated by `;` or whitespace."""
    decoder, calls, rest = json.JSONDecoder(), [], body
    while rest := rest.lstrip("; \t\r\n"):
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        if (call := _named(obj)) is None:
            return None
        calls.append(call)
        rest = rest[end:]
    return calls or None


def _sequence(pattern: re.Pattern[str], one: Callable[[re.Match[str]], _Call | None]
              ) -> Callable[[str], list[_Call] | None]:
    """A section's calls: matches of `pattern` with nothing but whitespace around them."""
    def calls(body: str) -> list[_Call] | None:
        found, pos = [], 0
        for m in pattern.finditer(body):
            call = one(m)
            if call is None or body[pos:m.start()].strip():
                return None
            found.append(call)
            pos = m.end()
        return found if found and not body[pos:].strip() else None
    return calls


_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)
_KIMI_ID = re.compile(r"(?:functions\.)?([^:\s]+):\d+")


def _kimi_call(m: re.Match[str]) -> _Call | None:
    """`functions.NAME:INDEX` then the arguments; the model's id is kept, since Kimi's template
    writes the ids of earlier calls back into the prompt."""
    call_id = m[1].strip()
    name = _KIMI_ID.fullmatch(call_id)
    return None if name is None else (name[1], _json(m[2]), call_id)


_DEEPSEEK_CALL = re.compile(
    "<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
_DEEPSEEK_V3_TAIL = re.compile(r"(\S+)\s*```json(.*)```", re.S)


def _deepseek_call(m: re.Match[str]) -> _Call | None:
    """V3: `function<sep>NAME` and a ```json block; V3.1: `NAME<sep>` and the bare object."""
    head, tail = m[1].strip(), m[2].strip()
    v3 = _DEEPSEEK_V3_TAIL.fullmatch(tail) if head == "function" else None
    name, args = (v3[1], v3[2]) if v3 else (head, tail)
    return name, _json(args), None


@dataclass(frozen=True)
class _Format:
    start: str
    end: str | None  # None: the block runs to the end of the message
    calls: Callable[[str], list[_Call] | None]  # a block's calls; None if it is not calls
    bare_json: bool = False  # a message whose first non-space character is "{" is a block


FORMATS: dict[str, _Format] = {
    "hermes": _Format("<tool_call>", "</tool_call>", _hermes),
    "llama3_json": _Format("<|python_tag|>", None, _llama, bare_json=True),
    "kimi_k2": _Format("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                       _sequence(_KIMI_CALL, _kimi_call)),
    "deepseek_v3": _Format("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                           _sequence(_DEEPSEEK_CALL, _deepseek_call)),
}

# Markers in a chat template that say which family it writes, most specific first.
_TEMPLATE_MARKERS = (
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name', "llama3_json"),
)
_BY_MODEL_TYPE = {"qwen2": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                  "llama": "llama3_json", "kimi_k2": "kimi_k2", "deepseek_v3": "deepseek_v3"}


def detect_tool_format(chat_template: str, model_type: str | None = None) -> str | None:
    """The family (a key of FORMATS) whose calls `chat_template` writes, or None when it takes
    no tools. The template's markers decide; the model type only names the family of a
    template that reads `tools` but shows no known marker."""
    for marker, family in _TEMPLATE_MARKERS:
        if marker in chat_template:
            return family
    return _BY_MODEL_TYPE.get(model_type or "") if "tools" in chat_template else None


def tools_for_template(tools: list[dict]) -> list[dict]:
    """The request's `tools` as `apply_chat_template(tools=...)` takes them: transformers reads
    OpenAI's {"type": "function", "function": {name, description, parameters}} as it is; null
    fields are dropped, as templates would print them as "None". Raises ValueError for a tool
    that is not a named function."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not (
                isinstance(fn.get("name"), str) and fn["name"]):
            raise ValueError(f"tools.{i} is not supported; allowed: "
                             f"{{'type': 'function', 'function': {{'name': ..., ...}}}}")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _call_id(rid: str, index: int) -> str:
    return "call_" + hashlib.sha256(f"{rid}:{index}".encode()).hexdigest()[:24]


def _add_call(calls: list[ToolCall], rid: str, name: str, args: dict, model_id: str | None
              ) -> list[dict]:
    """Append a parsed call to `calls`; its two stream events (name, then whole arguments)."""
    index = len(calls)
    call = ToolCall(model_id or _call_id(rid, index), name, json.dumps(args, ensure_ascii=False))
    calls.append(call)
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


def _partial_start(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (without being all of it)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class StreamingToolParser:
    """One choice's output text, fed as it is decoded, turned into the `delta` pieces of
    chat.completion.chunk events: {"content": ...}, and per call {"tool_calls": [{"index", "id",
    "type", "function": {"name", "arguments": ""}}]} then {"tool_calls": [{"index", "function":
    {"arguments": ...}}]} with the whole arguments once the call's block has closed. Text that
    may still turn out to belong to a call is held back. `rid` must differ between choices and
    requests: the ids of calls are derived from it. `calls` lists the calls found so far."""

    def __init__(self, family: str, tools: list[dict], rid: str) -> None:
        if family not in FORMATS:
            raise ValueError(f"tool-call format {family!r} is not supported; "
                             f"allowed: {list(FORMATS)}")
        self._format, self._rid = FORMATS[family], rid
        self._names = {tool["function"]["name"] for tool in tools}
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not yet settled
        self._ws = ""  # whitespace after the content sent so far
        self._block: str | None = None  # the opening marker of the block being read
        self._started = False  # something other than whitespace has been read
        self._after_call = False  # nothing but whitespace since the last call

    def feed(self, delta: str) -> list[dict]:
        self._buf += delta
        return self._scan(final=False)

    def finish(self) -> list[dict]:
        """What is still held back, at the end of the output."""
        out = self._scan(final=True)
        if self._ws and not self._after_call:
            out.append({"content": self._ws})
        self._ws = ""
        return out

    def _scan(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while True:
            if self._block is None:
                start = self._find_start()
                if start is None:
                    keep = 0 if final else _partial_start(self._buf, self._format.start)
                    self._content(self._buf[:len(self._buf) - keep], out)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                pos, self._block = start
                self._content(self._buf[:pos], out)
                self._buf = self._buf[pos + len(self._block):]
                self._started = True
                continue
            closing = self._format.end or ""
            end = self._buf.find(closing) if closing else -1
            if end < 0:
                if not final:
                    return out
                body, closing = self._buf, ""  # unclosed at the end: still read as calls
            else:
                body = self._buf[:end]
            self._buf = self._buf[len(body) + len(closing):]
            self._close(self._block, body, closing, out)
            self._block = None

    def _find_start(self) -> tuple[int, str] | None:
        if self._format.bare_json and not self._started:
            rest = self._buf.lstrip()
            if rest.startswith("{"):
                return len(self._buf) - len(rest), ""
        pos = self._buf.find(self._format.start)
        return None if pos < 0 else (pos, self._format.start)

    def _close(self, opening: str, body: str, closing: str, out: list[dict]) -> None:
        calls = self._format.calls(body)
        if calls is None or any(name not in self._names or not isinstance(args, dict)
                                for name, args, _ in calls):
            self._content(opening + body + closing, out)
            return
        for name, args, model_id in calls:
            out += _add_call(self.calls, self._rid, name, args, model_id)
        self._after_call = True

    def _content(self, text: str, out: list[dict]) -> None:
        """Send settled content text, holding back its trailing whitespace."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        sent = text.rstrip()
        self._ws = text[len(sent):]
        if sent:
            self._started = True
            out.append({"content": sent})


GENERIC = "generic"  # the format of templates that write no calls of their own
_REPLY_START = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_ESCAPE = re.compile(r'\\(["\\/bfnrt]|u[0-9a-fA-F]{4})')
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _reply_end(raw: str) -> tuple[int, bool]:
    """For `raw`, the inside of a JSON string from after its opening quote: the length of its
    longest start that decodes and ends on no partial escape (nor half of a surrogate pair),
    and whether the string ends there (its closing quote, or an escape JSON has not)."""
    i = 0
    while i < len(raw):
        if raw[i] == '"':
            return i, True
        if raw[i] != "\\":
            i += 1
            continue
        if len(raw) < i + (6 if raw.startswith("\\u", i) else 2):
            break
        if not _ESCAPE.match(raw, i):
            return i, True
        width = 6 if raw[i + 1] == "u" else 2
        if _HIGH_SURROGATE.match(raw, i):
            if len(raw) < i + 12:
                break  # its low half may follow
            width = 12 if _LOW_SURROGATE.match(raw, i + 6) else 6
        i += width
    return i, False


class GenericToolParser:
    """The generic format's output, one JSON object that the grammar of
    `forced_tools.generic_grammar` keeps it to: {"response": "..."} is the reply, its text sent
    as it is decoded; {"tool_calls": [{"name": ..., "arguments": {...}}, ...]} is calls, sent
    when the output ends (the grammar ends it right after the object). A reply cut short (by
    max_tokens or a stop string) or broken is the text decoded so far; anything else stays
    content as written. The same feed/finish/calls as StreamingToolParser."""

    def __init__(self, tools: list[dict], rid: str) -> None:
        self._names = {tool["function"]["name"] for tool in tools}
        self._rid = rid
        self.calls: list[ToolCall] = []
        self._text = ""  # the output so far
        self._reply: int | None = None  # offset in _text of the reply's undecoded rest
        self._replied = False  # the reply's closing quote was read

    def feed(self, delta: str) -> list[dict]:
        self._text += delta
        if self._reply is None and (start := _REPLY_START.match(self._text)):
            self._reply = start.end()
        return [] if self._reply is None else self._decode_reply()

    def finish(self) -> list[dict]:
        if self._reply is not None:
            return self._decode_reply()
        calls = self._calls(_json(self._text))
        if calls is None:
            return [{"content": self._text}] if self._text else []
        return [e for name, args in calls
                for e in _add_call(self.calls, self._rid, name, args, None)]

    def _decode_reply(self) -> list[dict]:
        if self._replied:
            return []
        assert self._reply is not None, "no reply to decode"
        length, self._replied = _reply_end(self._text[self._reply:])
        text = json.loads('"' + self._text[self._reply:self._reply + length] + '"', strict=False)
        self._reply += length
        text = _LONE_SURROGATE.sub("\ufffd", text)  # not encodable; the grammar may allow them
        return [{"content": text}] if text else []

    def _calls(self, obj: Any) -> list[tuple[str, dict]] | None:
        calls = obj.get("tool_calls") if isinstance(obj, dict) and len(obj) == 1 else None
        if not isinstance(calls, list) or not calls:
            return None
        if not all(isinstance(c, dict) and set(c) == {"name", "arguments"}
                   and c["name"] in self._names and isinstance(c["arguments"], dict)
                   for c in calls):
            return None
        return [(c["name"], c["arguments"]) for c in calls]


def tool_parser(family: str, tools: list[dict], rid: str
                ) -> StreamingToolParser | GenericToolParser:
    """The incremental parser of `family`'s output (a key of FORMATS, or GENERIC)."""
    if family == GENERIC:
        return GenericToolParser(tools, rid)
    return StreamingToolParser(family, tools, rid)


def parse_tool_calls(text: str, family: str, tools: list[dict], rid: str
                     ) -> tuple[str | None, list[ToolCall]]:
    """A whole output's content (None when it has calls and nothing else) and its calls."""
    parser = tool_parser(family, tools, rid)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.get("content", "") for e in events)
    return (content or None) if parser.calls else content, parser.calls
