"""Tool calls on the default model, whose chat template renders no tools (the generic format),
through the `openai` client against real servers: a forced call of a named function comes back
with arguments valid for its schema; every answer (forced, or `auto` sampled with a seed) is
plain decoding of the documented prompt under the format's grammar (sent through
/v1/completions), the same under every spec mode, streamed as whole (a reply's text decoded as
it comes)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from flashtree.models.registry import DEFAULT_DRAFTER_DIR
from flashtree.server.forced_tools import generic_grammar
from flashtree.server.tool_calls import GENERIC, parse_tool_calls
from tests.server.conftest import API_KEY, MODEL, start_server, stop_servers
from tests.server.test_generic_tools import (
    AUTO_ANSWER,
    CALL,
    SCHEMAS,
    TOOLS,
    _default_tokenizer,
    chatml,
    tools_prompt,
)

SPECS = ("none", "dflash", "ddtree")
# name -> (the user's message, the forced tools, what the system prompt asks to answer with,
# sampling): a forced call (greedy), and a reply the model chooses to write (sampled with a
# seed), both short to keep the test cheap.
REQUESTS = {
    "named": ("What is the weather in Paris?", TOOLS[:1], f"{CALL} calling get_weather",
              {"temperature": 0, "max_tokens": 48}),
    "auto": ("Write a haiku about the sea.", None, AUTO_ANSWER,
             {"temperature": 0.8, "seed": 5, "max_tokens": 24}),
}


def _request(name: str) -> dict:
    message, forced, _, sampling = REQUESTS[name]
    choice = "auto" if forced is None else {"type": "function",
                                            "function": {"name": forced[0]["function"]["name"]}}
    return {"model": MODEL, "messages": [{"role": "user", "content": message}], "tools": TOOLS,
            "tool_choice": choice, **sampling}


def _whole(client, name: str) -> dict:
    choice = client.chat.completions.create(**_request(name)).choices[0]
    calls = [c.function.model_dump() for c in choice.message.tool_calls or []]
    return {"content": choice.message.content, "calls": calls,
            "finish_reason": choice.finish_reason}


def _streamed(client, name: str) -> dict:
    """A streamed answer put together as _whole puts a whole one (call ids left out)."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(**_request(name), stream=True):
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    return {"content": content if content or not calls else None,
            "calls": [calls[i] for i in sorted(calls)], "finish_reason": reason}


def _plain(client, name: str) -> tuple[str, dict]:
    """Plain decoding of the request's documented prompt under the format's grammar, through
    /v1/completions: its text, and the answer it documents."""
    message, forced, answer, sampling = REQUESTS[name]
    prompt = chatml([("system", tools_prompt(answer)), ("user", message)])
    ids = _default_tokenizer().hf.encode(prompt, add_special_tokens=False)
    choice = client.completions.create(
        model=MODEL, prompt=ids, **sampling,
        extra_body={"guided_grammar": generic_grammar(TOOLS, forced, parallel=True)}).choices[0]
    content, calls = parse_tool_calls(choice.text, GENERIC, TOOLS, "r")
    reason = "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason
    return choice.text, {"content": content, "finish_reason": reason,
                         "calls": [{"name": c.name, "arguments": c.arguments} for c in calls]}


@pytest.fixture(scope="module")
def answers() -> dict:
    """(spec, request name, "whole" | "streamed" | "plain") -> the default model's answer, each
    mode on a server of its own, started one at a time (each holds a KV pool)."""
    from openai import OpenAI

    out: dict = {}
    for spec in SPECS:
        base, proc = start_server("default", DEFAULT_DRAFTER_DIR, extra=(
            "--spec", spec, "--spec-policy", "fixed", "--max-model-len", "1024"))
        try:
            client = OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
            for name in REQUESTS:
                out[spec, name, "whole"] = _whole(client, name)
                out[spec, name, "streamed"] = _streamed(client, name)
            if spec == "none":
                out.update({("none", name, "plain"): _plain(client, name) for name in REQUESTS})
        finally:
            stop_servers([proc])
    return out


def test_the_default_model_calls_a_named_function_with_valid_arguments(answers):
    answer = answers["none", "named", "whole"]
    assert answer["finish_reason"] == "tool_calls" and answer["content"] is None, answer
    (call,) = answer["calls"]
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])


@pytest.mark.parametrize("name", list(REQUESTS))
def test_the_answer_is_plain_decoding_under_the_grammar(answers, name):
    text, plain = answers["none", name, "plain"]
    assert text.lstrip().startswith("{"), text  # the grammar held
    assert bool(plain["calls"]) == (name == "named"), plain  # the auto request gets a reply
    assert answers["none", name, "whole"] == plain


@pytest.mark.parametrize("name", list(REQUESTS))
def test_every_mode_gives_the_same_answer_streamed_or_whole(answers, name):
    plain = answers["none", name, "whole"]
    for spec in SPECS:
        assert answers[spec, name, "whole"] == plain, spec
        assert answers[spec, name, "streamed"] == plain, spec
