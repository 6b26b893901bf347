"""Requests that OpenAI or vLLM refuse get a 400 shaped as OpenAI's error whose `param` names
the field at fault: non-finite or out-of-range numbers, a string for a boolean, a lone
surrogate, a prompt (or prompt + max_tokens) over the context, unbounded lists, fields this
server knows and does not implement. Fields it does not know are ignored, as vLLM ignores
them, with a warning in the log."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from flashtree.server.protocol import CompletionRequest
from tests.server.conftest import API_KEY, MODEL, openai_error

AUTH = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
WORDS = "word " * 100  # about 100 tokens
LONG = "word " * 240  # about 240 of the context's 256 tokens


def _post(base: str, path: str, body: dict | str | bytes) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{base}{path}", content=content, headers=AUTH, timeout=60)


C, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = f'"model": "{MODEL}", "max_tokens": 2'
MESSAGES = [{"role": "user", "content": "Hi"}]
CASES = [  # (path, body, param, words in the message)
    (C, f'{{{BASE}, "prompt": "a\\ud800b"}}', "prompt", "lone surrogate"),
    (C, f'{{{BASE}, "prompt": ["ok", "a\\udc00"]}}', "prompt", "prompt 1: character 1"),
    (CHAT, f'{{{BASE}, "messages": [{{"role": "user", "content": "a\\ud800b"}}]}}',
     "messages.0.content", "lone surrogate"),
    (CHAT, f'{{{BASE}, "messages": [{{"role": "user", "content": [{{"type": "text", '
           f'"text": "\\udbff"}}]}}]}}', "messages.0.content", "lone surrogate"),
    (C, {"model": MODEL, "prompt": "x", "max_tokens": 4, "max_completion_tokens": 5},
     "max_completion_tokens", "disagree"),
    (C, {"model": MODEL, "prompt": "x", "stop": [""]}, "stop", "empty"),
    (C, {"model": MODEL, "prompt": "x", "stop": [f"s{i}" for i in range(17)]}, "stop",
     "at most 16"),
    (C, {"model": MODEL, "prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids.0", "0"),
    (C, {"model": MODEL, "prompt": "x", "stop_token_ids": [3, 10**9]}, "stop_token_ids.1",
     "vocabulary"),
    (C, {"model": MODEL, "prompt": "x", "guided_choice": []}, "guided_choice", "at least 1"),
    (C, {"model": MODEL, "prompt": "x", "guided_json": {"type": "object"},
         "response_format": {"type": "json_object"}}, "guided_json", "response_format"),
    (C, {"model": MODEL, "prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]},
     "guided_choice", "guided_regex"),
    (C, {"model": MODEL, "prompt": [1, 10**9]}, "prompt", "outside the vocabulary"),
    (C, {"model": MODEL, "prompt": [[1, 2], [3, -1]]}, "prompt.1", "outside the vocabulary"),
    (C, {"model": MODEL, "prompt": ["x"] * 65}, "prompt", "1 to 64 prompts"),
    (C, f'{{{BASE}, "prompt": "x", "temperature": Infinity}}', "temperature", "finite"),
    (C, f'{{{BASE}, "prompt": "x", "temperature": NaN}}', "temperature", "finite"),
    (C, {"model": MODEL, "prompt": "x", "temperature": 1e308}, "temperature",
     "less than or equal to 2"),
    (C, f'{{{BASE}, "prompt": "x", "top_k": 1e12}}', "top_k", "1073741824"),
    (C, {"model": MODEL, "prompt": "x", "repetition_penalty": 1e308}, "repetition_penalty",
     "less than or equal to 2"),
    (C, {"model": MODEL, "prompt": "x", "seed": 2**80}, "seed", "9223372036854775807"),
    (C, {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream", "boolean"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "stream": 1}, "stream", "boolean"),
    (C, {"model": MODEL, "prompt": "x", "logit_bias": {"5": 10}}, "logit_bias",
     "not supported"),
    (C, {"model": MODEL, "prompt": "x", "suffix": "end"}, "suffix", "not supported"),
    (C, {"model": MODEL, "prompt": "x", "min_tokens": 3}, "min_tokens", "not supported"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "echo": True}, "echo", "not supported"),
    (CHAT, {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 1000},
     "max_completion_tokens", "limit 200"),
]


@pytest.mark.parametrize("path, body, param, words", CASES,
                         ids=[f"{i}-{case[2]}" for i, case in enumerate(CASES)])
def test_a_refused_field_is_named(server, path, body, param, words):
    error = openai_error(_post(server[0], path, body), 400)
    assert error["param"] == param, error
    assert words in error["message"], error
    assert httpx.get(f"{server[0]}/health").status_code == 200


@pytest.mark.parametrize("path, body, param", [
    (C, b'{"model": "tiny", "max_tokens": 2, "prompt": "a\xed\xa0\x80b"}', "prompt"),
    (CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\xed\xb0\x80"}]}',
     "messages.0.content"),
    (C, b'{"model": "tiny", "prompt": "\xff\xfe"}', None),
])
def test_invalid_utf8_bodies_get_an_openai_error(server, path, body, param):
    """Bytes that are not UTF-8: a surrogate encoded in three bytes (which Python's JSON
    decoder lets through as a lone surrogate, as it does the \\ud800 escape) is named like
    one; other invalid bytes make the body unreadable."""
    error = openai_error(_post(server[0], path, body), 400)
    assert error["param"] == param, error
    assert "lone surrogate" in error["message"] if param else error["message"], error


def test_a_prompt_over_the_context_names_its_length(server, served_tokenizer):
    prompt = "word " * 300
    n = len(served_tokenizer(prompt).input_ids)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    error = openai_error(_post(server[0], C, body), 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded"), error
    assert f"has {n} tokens" in error["message"] and "max_model_len) is 256" in error["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_prompt_and_max_tokens_over_the_context_is_refused_not_capped(server, served_tokenizer,
                                                                     field):
    """vLLM's 400 naming both lengths, where the server used to shorten the completion; the
    request that exactly fills the context (256 tokens) runs."""
    n = len(served_tokenizer(LONG).input_ids)
    body = {"model": MODEL, "prompt": LONG, field: 257 - n, "temperature": 0}
    error = openai_error(_post(server[0], C, body), 400)
    assert (error["param"], error["code"]) == (field, "context_length_exceeded"), error
    assert f"requested 257 tokens ({n} in the prompt, {257 - n} in the completion)" \
        in error["message"], error
    ok = _post(server[0], C, {**body, field: 256 - n, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 256 - n


def test_chat_over_the_context_counts_the_rendered_messages(server, served_tokenizer):
    messages = [{"role": "user", "content": WORDS}]
    n = len(served_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"])
    body = {"model": MODEL, "messages": messages, "max_tokens": 257 - n}
    error = openai_error(_post(server[0], CHAT, body), 400)
    assert error["param"] == "max_tokens", error
    assert f"({n} in the messages, {257 - n} in the completion)" in error["message"], error


def test_unknown_fields_are_ignored_as_vllm_ignores_them(server):
    """A typo, another server's extension, a newer API's field, in the body or in a message:
    the answer is the one without them. Known fields at their neutral value pass too."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    plain = _post(server[0], C, body)
    extra = _post(server[0], C, {**body, "temprature": 1.5, "top_a": 0.2, "vendor": {"x": [1]},
                                 "stream_options": None, "logit_bias": {}, "suffix": "",
                                 "min_tokens": 0})
    assert plain.status_code == extra.status_code == 200, (plain.text, extra.text)
    assert extra.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": MESSAGES}
    plain = _post(server[0], CHAT, chat)
    messages = [{**MESSAGES[0], "reasoning_content": "hmm", "refusal": None}]
    extra = _post(server[0], CHAT, {**chat, "messages": messages, "service_tier": "auto"})
    assert plain.status_code == extra.status_code == 200, (plain.text, extra.text)
    assert extra.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_ignored_fields_are_logged(caplog):
    with caplog.at_level(logging.WARNING, logger="flashtree.server.protocol"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "temprature": 0.5,
                                          "vendor_field": 1, "unset": None})
    assert "ignored fields this server does not know: 'temprature', 'vendor_field'" \
        in caplog.text, caplog.text
