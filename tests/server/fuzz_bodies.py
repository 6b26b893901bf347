"""A seeded generator of request bodies for the fuzz test. Each body starts from a valid one and
changes a few fields of its endpoint's request model to a valid value, a boundary value just
inside or just outside the field's range (as docs/api.md gives the ranges), or a wrong one
(wrong types, NaN, infinities, huge and negative numbers, lone surrogates, empty, oversized and
nested lists, unknown fields), or breaks the body itself (not JSON, not an object, invalid
UTF-8, duplicate keys, deep nesting, over the size limit, the wrong content type)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.server.conftest import MODEL

MAX_TOKENS_LIMIT = 200  # the served --max-tokens-limit
MAX_REQUEST_BYTES = 20_000  # the served --max-request-bytes
SURROGATES = "\ud800\udbff\udc00\udfff"
_WORDS = ["Hi", "once", "upon", "a", "time", "def", "main():", "ünïcödé", "日本語", "🙂", "\u200f",
          "e\u0301", "\t", "\n", "{", "}", '"', "\\", "<tool_call>", "<|im_start|>", "\x00"]


def text(rng: random.Random, longest: int = 8) -> str:
    """Short text: words from many scripts, control characters, special-token markers."""
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, longest)))


def bad_text(rng: random.Random) -> str:
    """Text with a lone surrogate somewhere (sent as JSON's "\\ud800" escape)."""
    t = text(rng)
    i = rng.randint(0, len(t))
    return t[:i] + rng.choice(SURROGATES) + t[i:]


def junk(rng: random.Random, vocab: int):
    """A value of the wrong type, out of range or badly nested, for any field."""
    return rng.choice([
        None, True, False, 0, -1, 1, 2.5, -(10 ** 30), 10 ** 40, 2 ** 63, -(2 ** 64),
        float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 5e-324, "", "yes", "1",
        "null", bad_text(rng), "x" * rng.choice([1000, 5000]), [], {}, [None], [[]],
        [1, "a", None], {"a": {"b": [1, {"c": None}]}}, list(range(rng.choice([100, 2000]))),
        [text(rng)] * 300, {"type": "text"}, [vocab, -1], nested(rng, rng.randint(10, 200)),
        [{"role": "user", "content": bad_text(rng)}], {"name": bad_text(rng)},
    ])


def nested(rng: random.Random, depth: int):
    value = rng.choice([1, "x", None, {}])
    for _ in range(depth):
        value = [value] if rng.random() < 0.7 else {"a": value}
    return value


@dataclass(frozen=True)
class Spec:
    """A field's values: valid ones, boundary values the server must accept (`inside`) or
    refuse (`outside`) when the rest of the body is valid, and others either may happen to."""

    valid: Callable[[random.Random], object]
    inside: tuple = ()
    outside: tuple = ()
    other: tuple = ()


def _choice(*values) -> Callable[[random.Random], object]:
    return lambda rng: rng.choice(values)


def _ids(rng: random.Random, vocab: int, n: int = 4) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(1, n))]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def tool(rng: random.Random) -> dict:
    name = rng.choice(["get_time", "f", "x" * 64, "日本"])
    return {"type": "function", "function": {
        "name": name, "description": text(rng, 3),
        "parameters": rng.choice([SCHEMA, {"type": "object", "properties": {}}, {}])}}


NOT_IMPLEMENTED = {  # field: its neutral value (the only one accepted)
    "logit_bias": {}, "min_tokens": 0, "use_beam_search": False, "bad_words": [],
    "include_stop_str_in_output": False, "allowed_token_ids": None, "prompt_logprobs": None,
    "truncate_prompt_tokens": None, "suffix": "", "add_generation_prompt": True,
    "continue_final_message": False, "chat_template": None, "functions": [],
    "previous_response_id": None, "background": False, "include": [],
}
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"


def specs(vocab: int, path: str) -> dict[str, Spec]:
    """Every field of `path`'s request model (the fuzz test checks none is missing)."""
    limit = MAX_TOKENS_LIMIT
    tokens = Spec(lambda r: r.randint(1, 4), (1, limit), (0, limit + 1, -1, 4.5), ("4", 4.0))
    flag = Spec(_choice(True, False), (True, False), (0, 1, "true", "yes"), (None,))
    out = {
        "model": Spec(lambda r: MODEL, (MODEL,), ("", "gpt-4", MODEL.upper(), MODEL + " ")),
        "max_tokens": tokens, "max_output_tokens": tokens,
        # The base gives max_tokens: any other value of this one disagrees with it.
        "max_completion_tokens": Spec(tokens.valid, (), tokens.outside, tokens.other),
        "temperature": Spec(lambda r: r.choice([0.0, r.uniform(0, 2)]), (0, 2, 1e-300),
                            (2.0000001, -1e-9, 1e308, 10 ** 400, float("inf"), float("nan"))),
        "top_p": Spec(lambda r: r.uniform(0.01, 1), (1, 1e-9), (0, 1.0000001)),
        "top_k": Spec(lambda r: r.choice([-1, 0, r.randint(1, 50)]), (2 ** 30, -1, 0),
                      (2 ** 30 + 1, -2, 10 ** 12, 3.5), (3.0,)),
        "min_p": Spec(lambda r: r.uniform(0, 1), (0, 1), (1.5, -0.1)),
        "repetition_penalty": Spec(lambda r: r.uniform(0.5, 2), (2, 1e-9), (0, 2.1, 1e308)),
        "presence_penalty": Spec(lambda r: r.uniform(-2, 2), (-2, 2), (2.01, -3)),
        "frequency_penalty": Spec(lambda r: r.uniform(-2, 2), (-2, 2), (2.01, -3)),
        "seed": Spec(lambda r: r.randint(-(2 ** 63), 2 ** 63 - 1), (2 ** 63 - 1, -(2 ** 63)),
                     (2 ** 63, 2 ** 80, 1.5)),
        "stop": Spec(lambda r: r.choice([text(r, 2), [text(r, 2) for _ in range(r.randint(0, 3))]]),
                     (["s"] * 16, []), ([""], [f"s{i}" for i in range(17)]), (["s"] * 10_000,)),
        "stop_token_ids": Spec(lambda r: _ids(r, vocab), ([], [vocab - 1], [0]), ([vocab], [-1])),
        "n": Spec(lambda r: r.randint(1, 3), (16,), (17, 0, -1)),
        "stream_options": Spec(lambda r: {"include_usage": r.random() < 0.5,
                                          "continuous_usage_stats": r.random() < 0.5},
                               ({}, {"x": 1}), ({"include_usage": "yes"},)),
        "user": Spec(text, ("",), (), (bad_text(random.Random(0)),)),
        "metadata": Spec(lambda r: {"k": text(r)}, ({},), ({"k": 1}, {"k": None})),
        "response_format": Spec(_choice({"type": "text"}, {"type": "json_object"}, {
            "type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}),
            ({"type": "text"},), ({"type": "json_schema"}, {"type": "xml"}, {
                "type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}})),
        "guided_json": Spec(_choice(SCHEMA, json.dumps(SCHEMA)), (SCHEMA,),
                            ({"type": "object", "not": {}}, "{", {"type": 5})),
        "guided_regex": Spec(_choice("[ab]{1,3}", "yes|no"), ("yes|no",), ("(",), ("a{99999}",)),
        "guided_grammar": Spec(_choice('start: "yes" | "no"', 'root ::= "a" | "b"'),
                               ('start: "yes" | "no"',), ("start: (", "root ::= x")),
        "guided_choice": Spec(lambda r: [text(r, 2) for _ in range(r.randint(1, 3))],
                              (["a"],), ([], [""], ["<|im_start|>"]), (["a"] * 500,)),
        "prompt": Spec(lambda r: r.choice([
            text(r), [text(r) for _ in range(r.randint(1, 3))], _ids(r, vocab, 6),
            [_ids(r, vocab) for _ in range(r.randint(1, 3))]]),
            (["a"] * 64, [vocab - 1], [[0], [vocab - 1]]),
            ("", [], [[]], [""], ["a"] * 65, [vocab], [[1], [vocab]], "word " * 300,
             ["ok", bad_text(random.Random(1))], [1, "a"], [[1], "a"], [-1])),
        "echo": flag,
        "logprobs": Spec(lambda r: r.randint(0, 5), (0, 20), (21, -1)),
        "best_of": Spec(lambda r: r.randint(1, 3), (1, 16), (17, 0)),
        "messages": Spec(lambda r: messages(r), ([{"role": "user", "content": ""}],), (
            [], [{}], [{"role": "user"}], [{"role": "robot", "content": "x"}],
            [{"role": "user", "content": [{"type": "image_url"}]}],
            [{"role": "user", "content": "word " * 300}],
            [{"role": "user", "content": [{"type": "text", "text": bad_text(random.Random(3))}]}],
            [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}])),
        "top_logprobs": Spec(lambda r: r.randint(0, 5), (), (21, -1)),
        "tools": Spec(lambda r: [tool(r) for _ in range(r.randint(1, 2))], (), (
            [{"type": "code"}], [{"type": "function"}],
            [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}])),
        "tool_choice": Spec(_choice("none", "auto", "required", {
            "type": "function", "function": {"name": "get_time"}}), ("none", "auto"),
            ("any", "required", {"type": "function", "function": {"name": "nope"}})),
        "parallel_tool_calls": flag,
        "function_call": Spec(_choice("none", "auto"), ("none", "auto"), ("x",)),
    }
    for name in ("ignore_eos", "spec_stats", "stream", "store"):
        out[name] = flag
    for name, neutral in NOT_IMPLEMENTED.items():
        out[name] = Spec(lambda r, v=neutral: v, (neutral,), (1, [1], "x", {"a": 1}))
    if path == CHAT:
        out["logprobs"] = flag
        out["echo"] = Spec(lambda r: False, (False,), (True, 1, "x"))
    if path == RESPONSES:
        out |= {
            "input": Spec(lambda r: r.choice([text(r), [
                {"role": r.choice(["user", "system"]), "content": r.choice([
                    text(r), [{"type": "input_text", "text": text(r)}]])}]]), ("x",),
                ("", [], [{"role": "user", "content": [{"type": "input_image"}]}],
                 "word " * 300, bad_text(random.Random(4)))),
            "instructions": Spec(text, ("",), (bad_text(random.Random(2)),)),
            "text": Spec(lambda r: {"format": {"type": "text"}}, ({"format": {"type": "text"}},),
                         ({"format": {"type": "json"}},)),
            # Echoed back in the response: text JSON can carry.
            "user": Spec(text, ("",), (bad_text(random.Random(5)),)),
            "metadata": Spec(lambda r: {"k": text(r)}, ({},), ({"k": bad_text(random.Random(6))},
                                                             {"k": 1})),
            "tool_choice": Spec(_choice("none", "auto"), ("none", "auto"), ("required",)),
            "tools": Spec(lambda r: [], ([],), ([tool(random.Random(7))],)),
            "top_logprobs": Spec(lambda r: 0, (0,), (1,)),
        }
    return out


def messages(rng: random.Random) -> list[dict]:
    """A short conversation: text or text parts, maybe an earlier tool call and its result."""
    turns = [{"role": "user", "content": text(rng)}]
    if rng.random() < 0.3:
        turns.insert(0, {"role": rng.choice(["system", "developer"]), "content": text(rng)})
    if rng.random() < 0.2:
        turns[-1]["content"] = [{"type": "text", "text": text(rng)}]
    if rng.random() < 0.15:
        turns += [{"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function", "function": {"name": "get_time",
                                                          "arguments": '{"zone": "UTC"}'}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    return turns


@dataclass
class Case:
    """One request as sent, what the generator changed in it, and, for a body that differs
    from a valid one in one field set to a boundary value, whether the server must accept it
    ("2xx") or refuse it ("4xx")."""

    path: str
    content: bytes
    changed: tuple[str, ...] = ()  # top-level fields whose value is not the valid base's
    body: object = None  # the JSON value sent, when it is one
    headers: dict = field(default_factory=dict)
    chunked: bool = False
    kind: str = "fields"  # "base", "fields" or how the body was broken
    expect: str | None = None


ENDPOINTS = {  # path: (base body, its token-limit field)
    COMPLETIONS: ({"prompt": "Hi there"}, "max_tokens"),
    CHAT: ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    RESPONSES: ({"input": "Hi"}, "max_output_tokens"),
}


def fields_of(path: str) -> list[str]:
    """The request model's fields for `path` (aliases as clients send them)."""
    from flashtree.server.protocol import ChatCompletionRequest, CompletionRequest
    from flashtree.server.responses_api import ResponsesRequest

    model = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest,
             RESPONSES: ResponsesRequest}[path]
    return [f.alias or name for name, f in model.model_fields.items()]


def generate(rng: random.Random, path: str, vocab: int, table: dict[str, Spec]) -> Case:
    """One fuzzed request to `path`; `table` is `specs(vocab, path)`."""
    extra, limit_field = ENDPOINTS[path]
    base = {"model": MODEL, **extra, limit_field: rng.randint(1, 4)}
    roll = rng.random()
    if roll < 0.04:
        return _encode(path, base, (), "base", "2xx")
    if roll < 0.16:
        return _broken(rng, path, base)
    body, names, expect = dict(base), fields_of(path), {}
    for _ in range(rng.choice([1, 1, 1, 2, 3, 4, 6])):
        name, how = rng.choice(names), rng.random()
        spec, expect[name] = table[name], None
        if how < 0.35:
            body[name] = spec.valid(rng)
        elif how < 0.50 and spec.inside:
            body[name], expect[name] = rng.choice(spec.inside), "2xx"
        elif how < 0.70 and spec.outside:
            body[name], expect[name] = rng.choice(spec.outside), "4xx"
        elif how < 0.75 and spec.other:
            body[name] = rng.choice(spec.other)
        elif how < 0.80:
            body.pop(name, None)
        elif how < 0.88:
            body[rng.choice(["temprature", "foo", "", "__proto__", "x" * 64, "😀", "\ud800",
                             "extra_body", "max_tokens "])] = junk(rng, vocab)
        else:
            body[name] = junk(rng, vocab)
    changed = tuple(sorted(k for k in set(body) | set(base) if k not in body or k not in base
                           or _same(body[k]) != _same(base[k])))
    return _encode(path, body, changed, "fields" if changed else "base",
                   "2xx" if not changed else expect.get(changed[0]) if len(changed) == 1
                   else None)


def boundaries(path: str, table: dict[str, Spec]) -> list[Case]:
    """Every boundary value of every field of `path` (`table` is `specs(vocab, path)`), each
    alone in an otherwise valid body: the random bodies may miss some."""
    extra, limit_field = ENDPOINTS[path]
    base = {"model": MODEL, **extra, limit_field: 2}
    return [_encode(path, {**base, name: value}, (name,), "boundary", expect)
            for name in fields_of(path)
            for values, expect in ((table[name].inside, "2xx"), (table[name].outside, "4xx"))
            for value in values]


def _same(value) -> str:
    """A value as JSON text: True and 1, or 1 and 1.0, are different values here."""
    return json.dumps(value, sort_keys=True, allow_nan=True)


def _encode(path: str, body, changed: tuple, kind: str, expect: str | None) -> Case:
    # allow_nan: NaN and Infinity go out as Python writes them (not JSON, but what clients send)
    content = json.dumps(body, allow_nan=True).encode()
    return Case(path, content, changed, body, {"content-type": "application/json"}, kind=kind,
                expect=expect)


def _broken(rng: random.Random, path: str, base: dict) -> Case:
    """The body itself wrong (what a broken or hostile client sends)."""
    good = json.dumps(base).encode()
    how = rng.choice(["truncated", "not_object", "garbage", "utf8", "duplicate", "deep",
                      "too_large", "too_large_chunked", "content_type", "chunked", "bom",
                      "trailing", "number"])
    case = Case(path, good, (), None, {"content-type": "application/json"}, kind=how)
    if how == "truncated":
        case.content = good[:rng.randrange(len(good))]
    elif how == "not_object":
        case.body = rng.choice([None, [], [base], 1, "x", True, 1e308])
        case.content = json.dumps(case.body).encode()
    elif how == "garbage":
        case.content = bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
    elif how == "utf8":  # a string holding bytes that are not UTF-8 (or a surrogate's bytes)
        bad = rng.choice([b"\xff\xfe", b"\xed\xa0\x80", b"\xc3", b"\xf4\x90\x80\x80"])
        case.content = good.replace(b'"Hi', b'"H' + bad, 1)
    elif how == "duplicate":  # the last one counts, as in Python's parser
        case.body = {**base, "model": rng.choice([MODEL, 5, None])}
        case.content = good[:-1] + b', "model": ' + json.dumps(case.body["model"]).encode() + b"}"
    elif how == "deep":
        depth = rng.choice([500, 990, 1100, 5000])
        case.content = good[:-1] + b', "metadata": ' + b"[" * depth + b"]" * depth + b"}"
    elif how in ("too_large", "too_large_chunked"):
        case.content = good[:-1] + b', "user": "' + b"x" * MAX_REQUEST_BYTES + b'"}'
        case.chunked = how == "too_large_chunked"
    elif how == "content_type":
        case.headers = rng.choice([{}, {"content-type": "text/plain"},
                                   {"content-type": "application/x-www-form-urlencoded"}])
        case.body = base if "content-type" not in case.headers else None
    elif how == "chunked":
        case.body, case.chunked = base, True
    elif how == "bom":
        case.body, case.content = base, b"\xef\xbb\xbf" + good
    elif how == "number":  # number literals JSON allows, and some it does not
        literal = rng.choice([b"1e400", b"-0", b"1E2", b"4.0", b"0x10", b"04", b"1_000", b".5",
                              b"+1", b"Infinity", b"NaN", b"-Infinity", b"4" * 400])
        case.content = good[:-1] + b', "temperature": ' + literal + b"}"
        try:  # as the server's parser reads it (Python's, which takes NaN and Infinity)
            case.body, case.changed = json.loads(case.content), ("temperature",)
        except ValueError:
            case.expect = "4xx"
        else:  # accepted only when finite and in [0, 2] (NaN compares false)
            case.expect = "2xx" if 0 <= case.body["temperature"] <= 2 else "4xx"
    else:
        case.content = good + rng.choice([b" x", b"}", b"\x00", b" {}"])
    return case
