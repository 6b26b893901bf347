"""Tool-call parsing for every template family: the calls and content of whole outputs (several
calls, content around them, nested and non-ASCII arguments), malformed or unknown calls kept as
content, streams that add up to the whole parse however the output is split into deltas, with
no marker ever sent as content; and the published chat templates of Qwen3, Llama 3.1, Kimi K2 and
DeepSeek V3 (templates/): each one's family detected, the whole tool format rendered as the family
documents it, and the calls it writes parsed back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.utils.chat_template_utils import render_jinja_template

from flashtree.server.protocol import ChatMessage
from flashtree.server.tool_calls import (
    StreamingToolParser,
    ToolCall,
    detect_tool_format,
    parse_tool_calls,
    tools_for_template,
)
from flashtree.server.tool_use import render_first, template_forms

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]
PARIS = {"city": "Paris"}
NESTED = {"query": {"terms": ["a", "b"], "filter": {"year": 2024, "exact": True}}, "limit": 3}
UNICODE = {"city": "Zürich", "note": "天气 ☀ \"quoted\" \\ back"}


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def hermes(name: str, args) -> str:
    return f"<tool_call>\n{_dumps({'name': name, 'arguments': args})}\n</tool_call>"


def llama(name: str, args, key: str = "parameters") -> str:
    return _dumps({"name": name, key: args})


def kimi(*calls: tuple[str, object]) -> str:
    return "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
        f"{args if isinstance(args, str) else _dumps(args)}<|tool_call_end|>"
        for i, (name, args) in enumerate(calls)) + "<|tool_calls_section_end|>"


def deepseek_v3(*calls: tuple[str, object]) -> str:
    return "<｜tool▁calls▁begin｜>" + "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{_dumps(args)}\n```"
        "<｜tool▁call▁end｜>" for name, args in calls) + "<｜tool▁calls▁end｜>"


def deepseek_v31(*calls: tuple[str, object]) -> str:
    return "<｜tool▁calls▁begin｜>" + "".join(
        f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{_dumps(args)}<｜tool▁call▁end｜>"
        for name, args in calls) + "<｜tool▁calls▁end｜>"


BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>'
UNKNOWN = hermes("delete_everything", {})
# Sections with text outside their calls are not calls.
KIMI_TRAILING = kimi(("search", {})).replace("<|tool_calls_section_end|>",
                                             "oops<|tool_calls_section_end|>")
DEEPSEEK_BETWEEN = deepseek_v31(("search", {}), ("search", {})).replace(
    "<｜tool▁call▁end｜><｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>and<｜tool▁call▁begin｜>")
# (family, output, content, [(name, arguments)])
CASES = [
    ("hermes", hermes("get_weather", PARIS), None, [("get_weather", PARIS)]),
    ("hermes", "Let me check.\n" + hermes("get_weather", PARIS) + "\n" + hermes("search", NESTED),
     "Let me check.", [("get_weather", PARIS), ("search", NESTED)]),
    ("hermes", "<think>\nhmm\n</think>\n\n" + hermes("get_weather", UNICODE),
     "<think>\nhmm\n</think>", [("get_weather", UNICODE)]),
    ("hermes", "A\n" + hermes("search", {}) + "\nB\n", "A\nB\n", [("search", {})]),
    ("hermes", hermes("search", {"q": "x"})[:-len("\n</tool_call>")], None,
     [("search", {"q": "x"})]),  # the stop string ate the closing tag
    ("hermes", "Sure: " + BAD_JSON, "Sure: " + BAD_JSON, []),
    ("hermes", UNKNOWN + "\n" + hermes("search", {}), UNKNOWN, [("search", {})]),
    ("hermes", '<tool_call>\n{"name": "search"}\n</tool_call>',
     '<tool_call>\n{"name": "search"}\n</tool_call>', []),
    ("hermes", "a < b and <tool", "a < b and <tool", []),
    ("llama3_json", llama("get_weather", PARIS), None, [("get_weather", PARIS)]),
    ("llama3_json", "\n<|python_tag|>" + llama("search", NESTED, key="arguments"), None,
     [("search", NESTED)]),
    ("llama3_json", llama("get_weather", PARIS) + "; " + llama("search", UNICODE) + "\n"
     + llama("search", {}), None,
     [("get_weather", PARIS), ("search", UNICODE), ("search", {})]),
    ("llama3_json", "Checking. <|python_tag|>" + llama("get_weather", PARIS), "Checking.",
     [("get_weather", PARIS)]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", llama("search", {}) + " and more", llama("search", {}) + " and more", []),
    ("llama3_json", llama("get_weather", PARIS)[:-1], llama("get_weather", PARIS)[:-1], []),
    ("llama3_json", "It is {sunny} today.", "It is {sunny} today.", []),
    ("kimi_k2", kimi(("get_weather", PARIS)), None, [("get_weather", PARIS)]),
    ("kimi_k2", "I will look.\n" + kimi(("get_weather", UNICODE), ("search", NESTED)),
     "I will look.", [("get_weather", UNICODE), ("search", NESTED)]),
    ("kimi_k2", "x " + kimi(("search", '{"q": ')), "x " + kimi(("search", '{"q": ')), []),
    ("kimi_k2", kimi(("search", "[1, 2]")), kimi(("search", "[1, 2]")), []),
    ("kimi_k2", "<|tool_calls_section_beg", "<|tool_calls_section_beg", []),
    ("kimi_k2", KIMI_TRAILING, KIMI_TRAILING, []),
    ("deepseek_v3", deepseek_v3(("get_weather", PARIS)), None, [("get_weather", PARIS)]),
    ("deepseek_v3",
     "Looking it up.\n\n" + deepseek_v3(("get_weather", UNICODE), ("search", NESTED)),
     "Looking it up.", [("get_weather", UNICODE), ("search", NESTED)]),
    ("deepseek_v3", deepseek_v31(("get_weather", PARIS), ("search", NESTED)), None,
     [("get_weather", PARIS), ("search", NESTED)]),
    ("deepseek_v3", deepseek_v31(("nope", PARIS)), deepseek_v31(("nope", PARIS)), []),
    ("deepseek_v3", "plain answer", "plain answer", []),
    ("deepseek_v3", DEEPSEEK_BETWEEN, DEEPSEEK_BETWEEN, []),
]
IDS = [f"{family}-{i}" for i, (family, *_) in enumerate(CASES)]


def _stream(family: str, pieces: list[str], rid: str = "r") -> tuple[str, list[ToolCall]]:
    """Feed `pieces` as deltas; the content and calls the events add up to, checking each
    call's first event carries its id and name and the later ones only arguments."""
    parser = StreamingToolParser(family, TOOLS, rid)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    content, calls = "", []
    for event in events:
        assert len(event) == 1 and set(event) <= {"content", "tool_calls"}, event
        if "content" in event:
            assert event["content"], "an empty content delta"
            content += event["content"]
            continue
        (delta,) = event["tool_calls"]
        if delta["index"] == len(calls):
            assert delta["type"] == "function" and delta["function"]["arguments"] == ""
            calls.append(ToolCall(delta["id"], delta["function"]["name"], ""))
        else:
            assert delta["index"] == len(calls) - 1 and set(delta) == {"index", "function"}
            last = calls[-1]
            args = last.arguments + delta["function"]["arguments"]
            calls[-1] = ToolCall(last.id, last.name, args)
    return content, calls


@pytest.mark.parametrize("family,text,content,calls", CASES, ids=IDS)
def test_whole_output(family, text, content, calls):
    got_content, got = parse_tool_calls(text, family, TOOLS, "req-1")
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("family,text,content,calls", CASES, ids=IDS)
def test_stream_equals_whole_at_every_split(family, text, content, calls):
    whole = parse_tool_calls(text, family, TOOLS, "r")
    want = (whole[0] or "", whole[1])
    assert _stream(family, list(text)) == want  # one character at a time
    for cut in range(len(text) + 1):
        assert _stream(family, [text[:cut], text[cut:]]) == want, cut


@pytest.mark.parametrize("family,text,content,calls", CASES, ids=IDS)
def test_markers_are_never_sent_as_content(family, text, content, calls):
    """No prefix of the output ever gets more content out than the whole output has."""
    parser = StreamingToolParser(family, TOOLS, "r")
    sent = ""
    for ch in text:
        sent += "".join(e.get("content", "") for e in parser.feed(ch))
        assert (content or "").startswith(sent)


# Pieces that outputs of each family are made of, markers cut at awkward places among them.
PIECES = {
    "hermes": ["<tool_call>", "</tool_call>", "<tool", "\n", " ", "hi", "{",
               '{"name": "search", "arguments": {}}', '"arguments"'],
    "llama3_json": ["<|python_tag|>", "<|py", "\n", " ", ";", "hi", "{", "}",
                    llama("search", {}), llama("get_weather", UNICODE)],
    "kimi_k2": ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                "<|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>",
                "<|tool_call_end|>", "<|tool_calls", "{}", "\n", "hi"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                    "<｜tool▁call▁end｜>", "search<｜tool▁sep｜>", "<｜tool", "{}", "\n", "hi"],
}


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_stream_equals_whole_for_any_output_and_split(data):
    family = data.draw(st.sampled_from(sorted(PIECES)))
    text = "".join(data.draw(st.lists(st.sampled_from(PIECES[family]), max_size=12)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls = parse_tool_calls(text, family, TOOLS, "r")
    assert _stream(family, pieces) == (content or "", calls)
    if not calls:
        assert content == text  # an output without calls is left as it is


def test_stream_holds_back_a_possible_marker_and_sends_calls_whole():
    parser = StreamingToolParser("hermes", TOOLS, "r")
    assert parser.feed("Sure.\n<tool") == [{"content": "Sure."}]
    assert parser.feed('_call>\n{"name": "get_weather", "arguments": {"city": "Pa') == []
    (named, args) = parser.feed('ris"}}\n</tool_call>')
    call_id = named["tool_calls"][0]["id"]
    assert named == {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                                     "function": {"name": "get_weather", "arguments": ""}}]}
    assert args == {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}
    assert parser.feed("\n") == [] and parser.finish() == []
    assert parser.calls == [ToolCall(call_id, "get_weather", '{"city": "Paris"}')]


def test_stream_sends_text_that_turns_out_not_to_be_a_marker():
    parser = StreamingToolParser("kimi_k2", TOOLS, "r")
    assert parser.feed("a <|tool_calls") == [{"content": "a"}]
    assert parser.feed("!> b ") == [{"content": " <|tool_calls!> b"}]
    assert parser.finish() == [{"content": " "}]


def test_llama_json_output_is_held_until_the_end():
    parser = StreamingToolParser("llama3_json", TOOLS, "r")
    assert parser.feed('{"answer": ') == [] and parser.feed("42}") == []
    assert parser.finish() == [{"content": '{"answer": 42}'}]


def test_call_ids_are_stable_per_request_and_distinct():
    text = hermes("search", {}) + hermes("search", {})
    _, first = parse_tool_calls(text, "hermes", TOOLS, "chatcmpl-1-0")
    _, again = parse_tool_calls(text, "hermes", TOOLS, "chatcmpl-1-0")
    _, other = parse_tool_calls(text, "hermes", TOOLS, "chatcmpl-1-1")
    assert first == again
    ids = [c.id for c in first + other]
    assert len(set(ids)) == 4 and all(i.startswith("call_") for i in ids)


def test_kimi_calls_keep_the_models_ids():
    text = kimi(("get_weather", PARIS), ("search", {}))
    _, calls = parse_tool_calls(text, "kimi_k2", TOOLS, "r")
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.search:1"]
    bare = text.replace("functions.", "")
    assert [c.id for c in parse_tool_calls(bare, "kimi_k2", TOOLS, "r")[1]] == [
        "get_weather:0", "search:1"]


def test_openai_shape():
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    assert call.to_openai() == {"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        StreamingToolParser("mistral", TOOLS, "r")


TEMPLATES_DIR = Path(__file__).parent / "templates"
# The chat template each family's models publish, and the family's end-of-turn token.
FAMILY_TEMPLATES = {"hermes": ("qwen3", "<|im_end|>"), "llama3_json": ("llama3_1", "<|eot_id|>"),
                    "kimi_k2": ("kimi_k2", "<|im_end|>"),
                    "deepseek_v3": ("deepseek_v3", "<｜end▁of▁sentence｜>")}


def real_template(name: str) -> str:
    """A published chat template, as stored under templates/ (its first line names the source)."""
    return (TEMPLATES_DIR / f"{name}.jinja").read_text()


PLAIN = "{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.mark.parametrize("template,model_type,family", [
    ("qwen3", "qwen3", "hermes"),
    ("llama3_1", "llama", "llama3_json"),
    ("llama3_2", "llama", "llama3_json"),  # JSON calls without <|python_tag|>
    ("kimi_k2", "kimi_k2", "kimi_k2"),
    ("deepseek_v3", "deepseek_v3", "deepseek_v3"),
    ("deepseek_v3", "qwen2", "deepseek_v3"),  # R1 distilled into Qwen writes DeepSeek's markers
])
def test_detect_tool_format_of_published_templates(template, model_type, family):
    """The markers decide, whatever the model type says."""
    text = real_template(template)
    assert detect_tool_format(text, model_type) == family
    assert detect_tool_format(text) == family


@pytest.mark.parametrize("template,model_type,family", [
    ("{% if tools %}{{ tools | tojson }}{% endif %}", "qwen3", "hermes"),
    ("{% if tools %}{{ tools | tojson }}{% endif %}", "gemma3", None),
    ("{% if tools %}{{ tools | tojson }}{% endif %}", None, None),
    (PLAIN, "qwen3", None),  # a template that takes no tools
], ids=["tools-qwen3", "tools-gemma3", "tools-unknown", "no-tools"])
def test_detect_tool_format_without_markers(template, model_type, family):
    assert detect_tool_format(template, model_type) == family


# DeepSeek V3's template joins a call's arguments to text (`... + arguments + ...`); the others
# serialize an object (`| tojson`), the form transformers documents for chat templates.
ARGUMENTS_AS_TEXT = {"deepseek_v3"}


def _call_id(family: str, name: str, index: int) -> str:
    """Kimi K2's template writes the call id into the prompt, in its own `functions.NAME:INDEX`."""
    return f"functions.{name}:{index}" if family == "kimi_k2" else f"call_{index}"


def _calls_turn(family: str, calls: list[tuple[str, object]], openai: bool = False) -> dict:
    """An assistant turn that only made `calls` (name, arguments): as the family's template
    takes it, or (`openai`) as a client sends it back, arguments as JSON text."""
    as_text = openai or family in ARGUMENTS_AS_TEXT
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": _call_id(family, name, i), "type": "function",
         "function": {"name": name, "arguments": _dumps(args) if as_text else args}}
        for i, (name, args) in enumerate(calls)]}


def _render(family: str, messages: list[dict], generation_prompt: bool) -> str:
    """The conversation through the family's published template, with the request's tools."""
    template = real_template(FAMILY_TEMPLATES[family][0])
    return render_jinja_template([messages], tools=tools_for_template(TOOLS),
                                 chat_template=template, add_generation_prompt=generation_prompt,
                                 bos_token="<BOS>")[0][0]


ASK = [{"role": "system", "content": "You are terse."},
       {"role": "user", "content": "Weather in Paris?"}]
# The whole tool format of each family, as its model card and template document it, in order:
# tools declared, the user turn, the assistant's call, the tool's result, the answer.
# (DeepSeek V3's published template writes no tool list.)
DOCUMENTED = {
    "hermes": [
        "<|im_start|>system\nYou are terse.\n\n# Tools\n", "<tools>\n" + _dumps(TOOLS[0]) + "\n",
        "</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags", "<|im_end|>\n",
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n",
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n',
        "<|im_start|>user\n<tool_response>\nsunny, 21 degrees\n</tool_response><|im_end|>\n",
        "<|im_start|>assistant\n", "It is sunny.<|im_end|>\n"],
    "llama3_json": [
        "<BOS><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n",
        "You are terse.<|eot_id|>", "<|start_header_id|>user<|end_header_id|>\n\n",
        'Respond in the format {"name": function name, "parameters": dictionary of argument '
        "name and its value}.", json.dumps(TOOLS[0], indent=4), "Weather in Paris?<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21 degrees"<|eot_id|>',
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is sunny.<|eot_id|>"],
    "kimi_k2": [
        "<|im_system|>tool_declare<|im_middle|>", _dumps(TOOLS) + "<|im_end|>",
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>",
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>",
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n",
        "sunny, 21 degrees<|im_end|>",
        "<|im_assistant|>assistant<|im_middle|>It is sunny.<|im_end|>"],
    "deepseek_v3": [
        "<BOS>You are terse.<｜User｜>Weather in Paris?",
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>',
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny, 21 degrees<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>", "It is sunny.<｜end▁of▁sentence｜>"],
}


def _conversation(family: str, openai: bool = False) -> list[dict]:
    """System, user, the assistant's call, the tool's result, the assistant's answer."""
    return ASK + [_calls_turn(family, [("get_weather", PARIS)], openai),
                  {"role": "tool", "tool_call_id": _call_id(family, "get_weather", 0),
                   "content": "sunny, 21 degrees"},
                  {"role": "assistant", "content": "It is sunny."}]


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_published_template_renders_the_documented_tool_format(family):
    rendered = _render(family, _conversation(family), generation_prompt=False)
    pos = 0
    for marker in DOCUMENTED[family]:
        found = rendered.find(marker, pos)
        assert found >= 0, f"{marker!r} not after offset {pos} in:\n{rendered}"
        pos = found + len(marker)


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
def test_server_messages_render_as_the_template_documents(family):
    """The server's rendering of an OpenAI conversation (`template_forms`, tried in order by
    `render_first`) is exactly the conversation in the form the family's template takes."""
    forms = template_forms([ChatMessage(**m) for m in _conversation(family, openai=True)])
    assert (render_first(forms, lambda shown: _render(family, shown, generation_prompt=True))
            == _render(family, _conversation(family), generation_prompt=True))


# What a model writes around its calls that is not a call: Qwen3's template opens the turn
# after the last user message with an (empty) thinking block.
CONTENT_BEFORE_CALLS = {"hermes": "<think>\n\n</think>"}
# (name, arguments) of an assistant turn's calls; Llama 3.1's template refuses two a turn.
ONE_CALL, TWO_CALLS = [("get_weather", UNICODE)], [("get_weather", PARIS), ("search", NESTED)]
TURNS = [pytest.param(f, turn, id=f"{f}-{len(turn)}") for f in FAMILY_TEMPLATES
         for turn in (ONE_CALL, TWO_CALLS) if f != "llama3_json" or len(turn) == 1]


@pytest.mark.parametrize("family,turn", TURNS)
def test_parser_reads_back_the_calls_the_published_template_writes(family, turn):
    """An assistant turn rendered by the family's template, as a model trained on it would
    write it (up to its end-of-turn token), parses back to the same calls, whole or streamed."""
    prompt = _render(family, ASK, generation_prompt=True)
    whole = _render(family, ASK + [_calls_turn(family, turn)], generation_prompt=False)
    assert whole.startswith(prompt)
    written = whole[len(prompt):].split(FAMILY_TEMPLATES[family][1])[0]
    content, parsed = parse_tool_calls(written, family, TOOLS, "r")
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == turn, written
    assert content == CONTENT_BEFORE_CALLS.get(family)
    if family == "kimi_k2":  # the model's own ids, which the template writes back
        assert [c.id for c in parsed] == [_call_id(family, name, i) for i, (name, _) in
                                          enumerate(turn)]
    assert _stream(family, list(written)) == (content or "", parsed)


def test_tools_for_template_render_without_nulls():
    tools = [{"type": "function", "function": {"name": "f", "description": None,
                                               "parameters": {"type": "object"}}}]
    converted = tools_for_template(tools)
    assert converted == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    template = ("{% for t in tools %}{{ t.function.name }}:{{ t.function.description }};"
                "{{ t | tojson }}{% endfor %}")
    rendered = render_jinja_template([[{"role": "user", "content": "hi"}]], tools=converted,
                                     chat_template=template)[0][0]
    assert rendered.startswith("f:;") and "None" not in rendered and "null" not in rendered
    assert tools_for_template(TOOLS) == TOOLS


@pytest.mark.parametrize("tool", [
    {"type": "retrieval"},
    {"type": "function", "function": {"description": "no name"}},
    {"type": "function", "function": {"name": ""}},
])
def test_tools_for_template_refuses_other_tools(tool):
    with pytest.raises(ValueError, match=r"tools\.1 is not supported"):
        tools_for_template([TOOLS[0], tool])
