"""The generic tool format (templates that render no tools, like the default model's): its
output parsed into a reply or calls, streamed replies decoded as they come whatever the splits,
the grammar admitting exactly the documented answers (arguments checked with `jsonschema`), and
the conversation rendered into the default model's ChatML as documented."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashtree.sampling import SamplingParams
from flashtree.server.errors import ApiError
from flashtree.server.forced_tools import generic_grammar
from flashtree.server.protocol import ChatCompletionRequest, ChatMessage
from flashtree.server.tool_calls import GENERIC, GenericToolParser, parse_tool_calls
from flashtree.server.tool_use import ToolUse, render_prompt
from flashtree.structured_output import grammar_of
from flashtree.tokenizer import Tokenizer
from tests.server.test_tools_api import SCHEMAS, TOOLS

PARIS = {"city": "Paris", "unit": "celsius"}


def _calls(*calls: tuple[str, object]) -> str:
    return json.dumps({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})


def _stream(pieces: list[str]) -> tuple[str, list[tuple[str, dict]], list[str]]:
    """Feed `pieces`: the content and calls (name, arguments) the events add up to, and the
    content sent after each piece."""
    parser = GenericToolParser(TOOLS, "r")
    content, calls, sent = "", [], []
    for piece in [*pieces, None]:
        events = parser.feed(piece) if piece is not None else parser.finish()
        for event in events:
            assert len(event) == 1 and set(event) <= {"content", "tool_calls"}, event
            content += event.get("content", "")
            for delta in event.get("tool_calls", []):
                if "id" in delta:
                    calls.append((delta["function"]["name"], ""))
                else:
                    calls[-1] = (calls[-1][0], delta["function"]["arguments"])
        sent.append(content)
    return content, [(n, json.loads(a)) for n, a in calls], sent


def _splits(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted(cuts)
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=300, deadline=None)
@given(reply=st.text(), ascii_only=st.booleans(), spaced=st.booleans(), data=st.data())
def test_a_reply_streams_its_text_whole_or_cut_at_any_split(reply, ascii_only, spaced, data):
    """The reply's text (any Unicode, escaped or not, astral characters as surrogate pairs) is
    the content, sent as decoded; an output cut anywhere after the reply's opening quote gives
    a start of it (before, the text as written), the same whole or streamed, and never a
    half-decoded escape."""
    doc = json.dumps({"response": reply}, ensure_ascii=ascii_only)
    if spaced:
        doc = doc.replace('{"response": ', '{ "response" :')
    assert parse_tool_calls(doc, GENERIC, TOOLS, "r") == (reply, [])
    opened = doc.index('"', doc.index(":")) + 1
    cut = data.draw(st.integers(0, len(doc)))
    for text in (doc, doc[:cut]):
        whole, calls = parse_tool_calls(text, GENERIC, TOOLS, "r")
        assert calls == []
        assert reply.startswith(whole) if len(text) >= opened else whole == text
        pieces = _splits(text, data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
        content, _, sent = _stream(pieces)
        assert content == whole
        if len(text) >= opened:
            assert all(reply.startswith(s) for s in sent), (sent, reply)


# (output, content, calls): what is not a well-formed call of a given tool stays as written.
CASES = [
    (_calls(("get_weather", PARIS)), None, [("get_weather", PARIS)]),
    (_calls(("add", {"a": 1, "b": 2}), ("get_weather", PARIS)), None,
     [("add", {"a": 1, "b": 2}), ("get_weather", PARIS)]),
    (" " + _calls(("add", {})) + "\n", None, [("add", {})]),
    (_calls(("delete_all", {})), _calls(("delete_all", {})), []),
    (_calls(("add", [1, 2])), _calls(("add", [1, 2])), []),
    (_calls(("add", {}))[:-3], _calls(("add", {}))[:-3], []),  # cut short: not a call
    ('{"tool_calls": []}', '{"tool_calls": []}', []),
    ('{"tool_calls": [{"name": "add", "arguments": {}, "id": "x"}]}',
     '{"tool_calls": [{"name": "add", "arguments": {}, "id": "x"}]}', []),
    ('{"tool_calls": [], "response": "hi"}', '{"tool_calls": [], "response": "hi"}', []),
    ('{"response": "a\\"b\\u00e9\\ud83d\\ude00c"}', 'a"bé😀c', []),
    ('{"response": "lone \\ud800 surrogate"}', "lone \ufffd surrogate", []),  # UTF-8 can't
    ('{"response": "broken \\x escape"}', "broken ", []),
    ('{"response": "cut \\u00', "cut ", []),
    ('{"response": 5}', '{"response": 5}', []),
    ("plain text", "plain text", []),
    ("", "", []),
]


@pytest.mark.parametrize("text,content,calls", CASES)
def test_output_parses_the_same_whole_or_streamed_at_every_split(text, content, calls):
    got_content, got = parse_tool_calls(text, GENERIC, TOOLS, "req-1")
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)
    for cut in range(len(text) + 1):
        assert _stream([text[:cut], text[cut:]])[:2] == (content or "", calls), cut


@functools.cache
def _default_tokenizer() -> Tokenizer:
    from flashtree.models.registry import default_model_path

    return Tokenizer.load(default_model_path())


@functools.cache
def _grammar_tokenizer():
    import llguidance.hf

    return llguidance.hf.from_tokenizer(_default_tokenizer().hf)


def _admits(grammar: str, text: str) -> bool:
    """Whether the engine's matcher of `grammar` (as a request's guided_grammar) takes `text`
    as a whole answer."""
    from llguidance import LLMatcher

    tokenizer = _grammar_tokenizer()
    matcher = LLMatcher(tokenizer, grammar_of(SamplingParams(guided_grammar=grammar)))
    ids = tokenizer.tokenize_str(text)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


WEATHER = [TOOLS[0]]
# (forced tools or None, parallel, answer, whether its structure is the format's): the
# arguments must also satisfy the called function's schema (checked with jsonschema).
ANSWERS = [
    (None, True, _calls(("get_weather", PARIS)), True),
    (None, True, _calls(("get_weather", {"city": "Paris", "unit": "kelvin"})), True),
    (None, True, _calls(("get_weather", {"city": "Llanfairpwll", "unit": "celsius"})), True),
    (None, True, _calls(("add", {"a": 1, "b": 2}), ("get_weather", PARIS)), True),
    (None, False, _calls(("add", {"a": 1, "b": 2}), ("get_weather", PARIS)), False),
    (None, True, _calls(("add", {"a": 1, "b": 1000})), True),
    (None, True, _calls(("delete_all", {})), False),
    (None, True, '{"response": "Hello! \\"Hi\\""}', True),
    (None, True, '{"response": 5}', False),
    (None, True, '{"tool_calls": []}', False),
    (None, True, '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "1"}]}',
     False),
    (None, True, '{"arguments": {"a": 1, "b": 2}, "name": "add"}', False),
    (None, True, '{\n"response": "hi"}', False),  # on one line, as calls are written
    (WEATHER, True, _calls(("get_weather", PARIS)), True),
    (WEATHER, True, _calls(("add", {"a": 1, "b": 2})), False),
    (WEATHER, True, _calls(("get_weather", PARIS), ("get_weather", PARIS)), False),
    (WEATHER, True, '{"response": "hi"}', False),
    (TOOLS, True, _calls(("add", {"a": 3, "b": 4})), True),
]


@pytest.mark.parametrize("forced,parallel,answer,well_formed", ANSWERS)
def test_grammar_admits_exactly_the_formats_answers(forced, parallel, answer, well_formed):
    calls = json.loads(answer).get("tool_calls") if well_formed else None
    valid = well_formed and all(jsonschema.Draft202012Validator(SCHEMAS[c["name"]]).is_valid(
        c["arguments"]) for c in calls or [])
    assert _admits(generic_grammar(TOOLS, forced, parallel), answer) == valid


def _tool_use(**kw) -> ToolUse:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=TOOLS, **kw)
    use = ToolUse.of(body, _default_tokenizer())
    assert use is not None and use.family == GENERIC
    return use


def chatml(turns: list[tuple[str, str]]) -> str:
    """The default model's ChatML, written out (its template adds no BOS)."""
    return "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns) + \
        "<|im_start|>assistant\n"


LISTING = "\n".join(json.dumps(t) for t in TOOLS)
CALL = '{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}]}'
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And 2 + 3?"},
]
# The same conversation as the generic format shows it to the model, after the system prompt.
HISTORY_TURNS = [
    ("user", "Weather in Paris?"),
    ("assistant", '{"tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": '
                  '{"city": "Paris", "unit": "celsius"}}]}'),
    ("user", '{"tool_response": {"tool_call_id": "call_1", "content": "sunny, 21 degrees"}}'),
    ("assistant", "It is sunny."), ("user", "And 2 + 3?"),
]


def tools_prompt(answer: str) -> str:
    """The generic format's system prompt (or its end), `answer` saying what to answer with."""
    return f"You can call these tools:\n{LISTING}\n\nAnswer with one JSON object: {answer}."


def documented_prompt(answer: str) -> str:
    """HISTORY as the generic format shows it."""
    return chatml([("system", f"You are terse.\n\n{tools_prompt(answer)}"), *HISTORY_TURNS])


AUTO_ANSWER = f'{CALL} to call tools, or {{"response": "<your reply>"}} to reply'


@pytest.mark.parametrize("kw,answer", [
    ({}, AUTO_ANSWER),
    ({"tool_choice": "required"}, f"{CALL} calling get_weather or add"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, f"{CALL} calling add"),
], ids=["auto", "required", "named"])
def test_the_default_template_gets_the_documented_prompt(kw, answer):
    """The tools and the answer format end the system prompt; earlier calls are the JSON the
    model answers with, tool results user turns (ChatML written out by hand)."""
    use = _tool_use(**kw)
    want = use.tokenizer.hf.encode(documented_prompt(answer), add_special_tokens=False)
    assert render_prompt([ChatMessage(**m) for m in HISTORY], use.tokenizer, use) == want


def test_without_tools_a_conversation_renders_as_transformers_does():
    """A conversation without tools is the template's own rendering; earlier calls in it are
    shown in the generic format (the template cannot render them itself)."""
    tokenizer = _default_tokenizer()
    plain = [m for m in HISTORY if m["role"] in ("system", "user")]
    want = tokenizer.hf.encode(tokenizer.hf.apply_chat_template(
        plain, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert render_prompt([ChatMessage(**m) for m in plain], tokenizer, None) == want
    want = tokenizer.hf.encode(chatml([("system", "You are terse."), *HISTORY_TURNS]),
                               add_special_tokens=False)
    assert render_prompt([ChatMessage(**m) for m in HISTORY], tokenizer, None) == want


@pytest.mark.parametrize("kw,param", [({}, "tools"), ({"tool_choice": "required"}, "tool_choice")])
@pytest.mark.parametrize("guided", [
    {"response_format": {"type": "json_object"}}, {"guided_regex": "a+"}])
def test_structured_output_beside_tools_is_a_400(kw, param, guided):
    """The format's grammar holds the whole answer, so it cannot take another."""
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                 tools=TOOLS, **kw, **guided)
    use = ToolUse.of(body, _default_tokenizer())
    with pytest.raises(ApiError) as e:
        use.constrain(body.sampling_params(16), body.response_format)
    assert e.value.status == 400 and e.value.param == param
