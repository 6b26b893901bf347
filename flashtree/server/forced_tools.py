"""Tool calls enforced through structured output, as Lark grammars (llguidance's dialect):
`tool_choice` "required" or a named function admits exactly one call, written the way the
template family writes calls, whose arguments follow the function's JSON schema; the generic
format (templates that write no calls) admits its JSON object, a call or a reply."""

from __future__ import annotations

import json

from flashtree.tokenizer import Tokenizer

# One call per family: markers (special tokens where the tokenizer has them), "{name}" and
# "{args}" (the arguments object); anything else is literal text.
_NAME, _ARGS = "{name}", "{args}"
_LAYOUTS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "\n", _ARGS, "\n", "</tool_call>"),
    "llama3_json": (_ARGS,),
    "kimi_k2": ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.", _NAME,
                ":0", "<|tool_call_argument_begin|>", _ARGS, "<|tool_call_end|>",
                "<|tool_calls_section_end|>"),
    "deepseek_v3": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "function",
                    "<｜tool▁sep｜>", _NAME, "\n```json\n", _ARGS, "\n```", "<｜tool▁call▁end｜>",
                    "<｜tool▁calls▁end｜>"),
}
# Families whose call object holds the name and the arguments (under this key) in one JSON.
_NAMED_OBJECT = {"hermes": "arguments", "llama3_json": "parameters"}


def forced_call_grammar(family: str, tools: list[dict], tokenizer: Tokenizer) -> str:
    """A Lark grammar for one call of one of `tools` (OpenAI function entries)."""
    functions = [t["function"] for t in tools]
    key = _NAMED_OBJECT.get(family)
    if key is not None:  # the name is a constant inside the JSON object
        args = {_ARGS: _json(_named_call(functions, key))}
        return "start: " + _sequence(_LAYOUTS[family], args, tokenizer)
    alternatives = [_sequence(_LAYOUTS[family], {_NAME: json.dumps(f["name"]),
                                                 _ARGS: _json(_parameters(f))}, tokenizer)
                    for f in functions]
    return "start: " + " | ".join(f"({a})" for a in alternatives)


def generic_grammar(tools: list[dict], forced: list[dict] | None, parallel: bool) -> str:
    """The generic format's answer: {"tool_calls": [{"name": ..., "arguments": {...}}]} calling
    one of `forced` once, or without a forced choice either calls of `tools` (several when
    `parallel`) or {"response": "..."}, the reply."""
    functions = [t["function"] for t in (tools if forced is None else forced)]
    count = {"minItems": 1} if parallel and forced is None else {"minItems": 1, "maxItems": 1}
    calls = _object({"tool_calls": {"type": "array", "items": _named_call(functions, "arguments"),
                                    **count}})
    reply = _object({"response": {"type": "string"}})
    return "start: " + _json(calls if forced is not None else {"anyOf": [calls, reply]})


def _named_call(functions: list[dict], key: str) -> dict:
    """The schema of {"name": ..., key: arguments} calling one of `functions`."""
    return {"anyOf": [_object({"name": {"const": f["name"]}, key: _parameters(f)})
                      for f in functions]}


def _object(properties: dict) -> dict:
    """An object of exactly these properties, in this order."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _json(schema: dict) -> str:
    """A JSON value of `schema` inside a Lark grammar, on one line as templates write calls:
    at most one space between tokens (free whitespace lets a model loop in it)."""
    options = {"whitespace_pattern": r"\x20?"}
    return f"%json {json.dumps({'x-guidance': options, **schema})}"


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _sequence(layout: tuple[str, ...], slots: dict[str, str], tokenizer: Tokenizer) -> str:
    return " ".join(slots[p] if p in slots else _literal(p, tokenizer) for p in layout)


def _literal(text: str, tokenizer: Tokenizer) -> str:
    """A marker the tokenizer holds as one special token is that token (`<[id]>`), so that
    the model writes the token and not its spelling; other text is a string literal."""
    token_id = tokenizer.special_token_id(text)
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text, ensure_ascii=False)
