"""Tool calls through the `openai` client, one server per chat-template family on a tiny
random model that carries the family's published chat template (templates/: Qwen3, Llama 3.1,
Kimi K2, DeepSeek V3) and tokens: `tool_choice` "required" or a named function yields calls whose
arguments validate against the function's schema, streamed calls equal whole ones, the same calls
come back in every spec mode, a reply after earlier calls and their results is transformers'
greedy reply with the finish reason it implies, and bad tool requests are 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from flashtree.server.tool_calls import parse_tool_calls
from tests.server.conftest import API_KEY, MODEL, start_server, stop_servers
from tests.server.test_tool_calls import ARGUMENTS_AS_TEXT, real_template
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


# family: (its published chat template under templates/, the tokens its tokenizer adds for
# roles and tool calls, its BOS token (None: the template writes none), its end-of-turn token)
FAMILIES = {
    "hermes": ("qwen3", ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                         "<think>", "</think>"], None, "<|im_end|>"),
    "llama3_json": ("llama3_1", ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                 "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                    "<|begin_of_text|>", "<|eot_id|>"),
    "kimi_k2": ("kimi_k2", ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                            "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                            "<|tool_call_end|>"], None, "<|im_end|>"),
    "deepseek_v3": ("deepseek_v3", [
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
        "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
        "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"],
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
}


def _model(root, family: str):
    """A tiny random Llama with the default model's tokenizer, given the family's tokens (as
    added special tokens), BOS, end of turn (the model's EOS) and published chat template; and
    a drafter for it."""
    from flashtree.models.registry import default_model_path
    from flashtree.tokenizer import Tokenizer

    template, markers, bos, eos = FAMILIES[family]
    tok = Tokenizer.load(default_model_path()).hf
    tok.add_special_tokens({"additional_special_tokens": markers})
    tok.bos_token, tok.eos_token = bos or tok.bos_token, eos
    tok.chat_template = real_template(template)
    path = save_tiny_llama(root / family, seed=3, vocab_size=len(tok), initializer_range=0.2,
                           max_position_embeddings=1024, eos_token_id=tok.eos_token_id)
    tok.save_pretrained(path)
    return path, save_reference_drafter(root / f"{family}-drafter", path, block_size=4)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, tuple]:
    """family -> (model, drafter) directories."""
    root = tmp_path_factory.mktemp("tool_models")
    return {family: _model(root, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def family_clients(family_models):
    """(family, spec) -> client: every family with DDTree, and Hermes in every spec mode."""
    from openai import OpenAI

    wanted = [(f, "ddtree") for f in FAMILIES] + [("hermes", "none"), ("hermes", "dflash")]
    procs, clients = [], {}
    try:
        for family, spec in wanted:
            base, proc = start_server(*family_models[family],
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


def _greedy_reference(path, messages: list[dict], max_new: int) -> tuple[list[int], str, str]:
    """transformers' own reading of a chat request on the checkpoint at `path`: the prompt's
    token ids (its tokenizer's chat template, rendered by transformers' Jinja renderer as
    given: apply_chat_template would drop the null content DeepSeek V3's template tests), and
    the greedy continuation's text (up to EOS) and finish reason ("stop" at EOS, "length"
    after `max_new` tokens)."""
    from transformers import AutoTokenizer
    from transformers.utils.chat_template_utils import render_jinja_template

    from tests.helpers import load_reference

    tok = AutoTokenizer.from_pretrained(path)
    (prompt,), _ = render_jinja_template([messages], tools=TOOLS, chat_template=tok.chat_template,
                                         add_generation_prompt=True, **tok.special_tokens_map)
    ids = tok.encode(prompt, add_special_tokens=False)
    out = load_reference(path).generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False, max_new_tokens=max_new, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id, output_logits=True, return_dict_in_generate=True)
    # Near-ties would make the comparison depend on float rounding, not on correctness.
    gap = min(float(torch.topk(step[0], 2).values.diff().abs()) for step in out.logits)
    assert gap > 1e-3, f"ill-conditioned checkpoint (top-2 gap {gap:.2g}); change the seed"
    new = out.sequences[0, len(ids):].tolist()
    stopped = new[-1] == tok.eos_token_id
    text = tok.decode(new[:-1] if stopped else new, skip_special_tokens=False)
    return ids, text, "stop" if stopped else "length"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_conversation_with_earlier_calls_and_results(family_clients, family_models,
                                                       family):
    """A reply after an earlier call and its result is plain decoding's (transformers' greedy
    continuation of the prompt the family's template renders), with the finish reason the
    contract gives it: "tool_calls" when the text holds a call, else "stop" or "length"."""
    client = family_clients[family, "ddtree"]
    first = _ask(client, tool_choice="required").choices[0].message
    (call,) = first.tool_calls
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS,
                                           max_tokens=8, temperature=0)
    # The history as the template takes it: the call's arguments as an object, or as text
    # where the template joins them to text.
    arguments = json.loads(call.function.arguments)
    if family in ARGUMENTS_AS_TEXT:
        arguments = call.function.arguments
    shown = history[:1] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": arguments}}]},
        history[2]]
    ids, text, finish = _greedy_reference(family_models[family][0], shown, max_new=8)
    content, calls = parse_tool_calls(text, family, TOOLS, "r")
    choice = reply.choices[0]
    assert reply.usage.prompt_tokens == len(ids)
    assert choice.message.content == content
    assert [c.function.model_dump() for c in choice.message.tool_calls or []] == [
        {"name": c.name, "arguments": c.arguments} for c in calls]
    assert choice.finish_reason == ("tool_calls" if calls and finish == "stop" else finish)


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
