"""Tool calls through the `openai` client, one server per chat-template family (Hermes/Qwen,
Llama 3 JSON, Kimi K2 and DeepSeek V3 with their markers as special tokens) on a tiny random
model: `tool_choice` "required" or a named function yields calls whose arguments validate
against the function's schema, streamed calls equal whole ones, the same calls come back in
every spec mode, earlier calls and tool results render, and bad tool requests are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, start_server, stop_servers
from tests.tiny import save_reference_drafter, save_tiny_llama

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 10},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 999},
            "b": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _template(header: str, call: str) -> str:
    """A small chat template: the tools in a system turn after `header`, an assistant's earlier
    calls each written by the Jinja snippet `call` (over `c`)."""
    return ("{%- if tools %}<|im_start|>system\n" + header
            + "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}" + call + "{% endfor %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


KIMI = ["<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
        "<|tool_call_end|>", "<|tool_calls_section_end|>"]
DEEPSEEK = ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
            "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"]
FAMILIES = {  # family: (special tokens to add, chat template)
    "hermes": ([], _template("Call tools inside <tool_call></tool_call> tags.\n",
                             "<tool_call>\n{{ c.function | tojson }}\n</tool_call>")),
    "llama3_json": ([], _template(
        'Reply {"name": function name, "parameters": dictionary of argument name and its '
        'value}.\n', '{{ {"name": c.function.name, "parameters": c.function.arguments}'
                     ' | tojson }}')),
    "kimi_k2": (KIMI, _template("", KIMI[0] + KIMI[1] + "functions.{{ c.function.name }}:0"
                                + KIMI[2] + "{{ c.function.arguments | tojson }}" + KIMI[3]
                                + KIMI[4])),
    "deepseek_v3": (DEEPSEEK, _template("", DEEPSEEK[0] + DEEPSEEK[1] + "function" + DEEPSEEK[2]
                                        + "{{ c.function.name }}\n```json\n"
                                        "{{ c.function.arguments | tojson }}\n```"
                                        + DEEPSEEK[3] + DEEPSEEK[4])),
}


def _model(root, family: str):
    """A tiny random Llama with the default model's tokenizer, the family's markers as added
    special tokens and its template; and a drafter for it."""
    from flashtree.models.registry import default_model_path
    from flashtree.tokenizer import Tokenizer

    markers, template = FAMILIES[family]
    tok = Tokenizer.load(default_model_path()).hf
    if markers:
        tok.add_special_tokens({"additional_special_tokens": markers})
    tok.chat_template = template
    path = save_tiny_llama(root / family, seed=3, vocab_size=len(tok), initializer_range=0.2,
                           max_position_embeddings=1024,
                           eos_token_id=tok.eos_token_id)
    tok.save_pretrained(path)
    return path, save_reference_drafter(root / f"{family}-drafter", path, block_size=4)


@pytest.fixture(scope="module")
def family_clients(tmp_path_factory):
    """(family, spec) -> client: every family with DDTree, and Hermes in every spec mode."""
    from openai import OpenAI

    root = tmp_path_factory.mktemp("tool_models")
    wanted = [(f, "ddtree") for f in FAMILIES] + [("hermes", "none"), ("hermes", "dflash")]
    procs, clients = [], {}
    try:
        for family, spec in wanted:
            base, proc = start_server(*_model(root, family),
                                      extra=("--spec", spec, "--spec-policy", "fixed",
                                             "--max-model-len", "1024"))
            procs.append(proc)
            clients[family, spec] = OpenAI(base_url=f"{base}/v1", api_key=API_KEY,
                                           max_retries=0)
        yield clients
    finally:
        stop_servers(procs)


def _ask(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                          max_tokens=120, **{"temperature": 0, **kw})


def _check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls, "no tool call came back"
    for call in calls:
        assert call["type"] == "function" and call["id"]
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_forced_calls_parse_and_validate(family_clients, family):
    client = family_clients[family, "ddtree"]
    required = _ask(client, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls"
    assert required.message.content is None
    _check_calls(required.model_dump()["message"]["tool_calls"])
    named = _ask(client, tool_choice={"type": "function", "function": {"name": "add"}},
                 temperature=1.0, seed=4).choices[0]
    _check_calls(named.model_dump()["message"]["tool_calls"], names=("add",))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_streamed_calls_equal_whole(family_clients, family):
    client = family_clients[family, "ddtree"]
    whole = _ask(client, tool_choice="required").choices[0].model_dump()["message"]
    calls: dict[int, dict] = {}
    reason = None
    for chunk in _ask(client, tool_choice="required", stream=True):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["function"]["name"] += d.function.name or ""
                    call["function"]["arguments"] += d.function.arguments or ""
    streamed = [calls[i] for i in sorted(calls)]
    assert all(c["id"] for c in streamed)
    # Ids are the request's own; everything else is the whole response's.
    assert ([{**c, "id": None} for c in streamed]
            == [{**c, "id": None} for c in whole["tool_calls"]])
    assert reason == "tool_calls"


def test_every_spec_mode_returns_plain_decodings_calls(family_clients):
    outs = [_ask(family_clients["hermes", spec], tool_choice="required", temperature=0.8,
                 seed=9).choices[0].model_dump()["message"]["tool_calls"]
            for spec in ("none", "dflash", "ddtree")]
    _check_calls(outs[0])
    functions = [[c["function"] for c in calls] for calls in outs]  # ids are per request
    assert functions[1] == functions[0] and functions[2] == functions[0]


def test_a_conversation_with_earlier_calls_and_results(family_clients):
    for family in FAMILIES:
        client = family_clients[family, "ddtree"]
        first = _ask(client, tool_choice="required").choices[0].message
        history = ASK + [first.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                          "content": "sunny, 21 degrees"}]
        reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "wat"}}}}}]), "tools.0.function"),
    (dict(tools=[{"type": "retrieval"}]), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice"),
], ids=["bad-schema", "not-a-function", "unknown-name", "choice-without-tools", "with-format"])
def test_bad_tool_requests_are_400s(family_clients, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        family_clients["hermes", "ddtree"].chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, **kw)
    assert e.value.body["param"] == param


def test_tools_on_a_template_without_them(spec_clients):
    with pytest.raises(openai.BadRequestError) as e:
        spec_clients["none"].chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                                     max_tokens=4)
    assert e.value.body["param"] == "tools" and "takes no tools" in e.value.body["message"]
