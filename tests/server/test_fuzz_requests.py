"""Fuzz the three POST endpoints of one real server with 500 seeded bodies each, and with every
field's boundary values, each alone in a valid body (`fuzz_bodies`): no answer is a 5xx, every
4xx is OpenAI's error object whose `param` names the field at fault, every 2xx is a response
the `openai` client's own types accept and that agrees with the request (choices, indices,
usage within max_tokens), and `/health` answers after every body. The oracle for `param` is
the generator itself: it knows which fields it changed from a body the server accepts."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server import fuzz_bodies
from tests.server.conftest import API_KEY, MODEL, metric, openai_error, serve, stop_servers
from tests.server.fuzz_bodies import (
    ENDPOINTS,
    Case,
    boundaries,
    fields_of,
    generate,
    specs,
)

BODIES_PER_ENDPOINT = 500
REQUIRED = {"model", "prompt", "messages", "input"}
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def fuzz_server(tiny_chat_model, tmp_path_factory):
    """(base url, process, log path) of a speculative server with the fuzz test's limits."""
    model, drafter = tiny_chat_model
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    base, proc = serve(model, log, "--draft", str(drafter), "--device", "cpu",
                       "--max-model-len", "256",
                       "--max-tokens-limit", str(fuzz_bodies.MAX_TOKENS_LIMIT),
                       "--max-request-bytes", str(fuzz_bodies.MAX_REQUEST_BYTES),
                       "--max-num-seqs", "64", env={"FLASHTREE_API_KEY": API_KEY})
    yield base, proc, log
    stop_servers([proc])


def _vocab(model) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def test_every_request_field_has_a_generator(tiny_chat_model):
    """A field added to a request model is fuzzed too (or this fails)."""
    for path in ENDPOINTS:
        table = specs(_vocab(tiny_chat_model[0]), path)
        assert not [f for f in fields_of(path) if f not in table], path


def _send(client: httpx.Client, base: str, case: Case) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", **case.headers}
    content = case.content
    if case.chunked:  # a generator goes out with Transfer-Encoding: chunked
        content = iter([case.content[i:i + 4096] for i in range(0, len(case.content), 4096)])
    return client.post(f"{base}{case.path}", content=content, headers=headers)


def _check_error(case: Case, r: httpx.Response) -> None:
    """OpenAI's error object; `param` a field of the body (or a required one it lacks), the
    changed field when only one was, and set whenever the message names a field."""
    assert r.status_code in (400, 404, 413), r.status_code
    error = openai_error(r, r.status_code)
    message, param, code = error["message"], error["param"], error["code"]
    assert isinstance(message, str) and message
    assert param is None or isinstance(param, str) and param, param
    assert code is None or isinstance(code, str), code
    if r.status_code == 413:
        assert code == "request_too_large"
    if r.status_code == 404:
        assert (param, code) == ("model", "model_not_found")
    if not isinstance(case.body, dict):
        return
    root = param.split(".")[0] if param else None
    assert root is None or root in case.body or root in REQUIRED, f"param {param} not sent"
    if len(case.changed) == 1 and r.status_code == 400:
        limit = ENDPOINTS[case.path][1]
        allowed = {case.changed[0]} | ({limit} if code == "context_length_exceeded" else set())
        assert root in allowed, f"only {case.changed[0]} was changed, param is {param}"
    if param is None:
        named = [f for f in fields_of(case.path) if re.search(rf"\b{re.escape(f)}\b", message)]
        assert not named, f"the message names {named} and param is null"


def _events(r: httpx.Response) -> list[str]:
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


def _prompts(body: dict) -> list:
    from flashtree.server.protocol import CompletionRequest

    return CompletionRequest.prompt_list(body["prompt"])


def _check_usage(usage: dict, limit: int | None, sampled: int) -> None:
    prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
    assert prompt > 0 and usage["total_tokens"] == prompt + completion, usage
    assert limit is None or completion <= limit * sampled, (usage, limit, sampled)


def _number(body: dict, *names: str) -> int | None:
    """The first of `names` the body sets, as the number it means ("4" and 4.0 are 4, as
    pydantic reads them)."""
    given = [body[k] for k in names if body.get(k) is not None]
    return int(given[0]) if given else None


def _check_chunks(r: httpx.Response, choices: int, validate) -> None:
    """A stream of chunks ending in [DONE], none an error, each accepted by `validate` (the
    SDK's type), every choice index below `choices`."""
    events = _events(r)
    assert events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        validate(chunk)
        assert all(0 <= c["index"] < choices for c in chunk["choices"]), chunk


def _check_completion(body: dict, r: httpx.Response) -> None:
    prompts, n = _prompts(body), _number(body, "n") or 1
    limit = _number(body, "max_tokens", "max_completion_tokens") or 16
    if body.get("stream"):
        # The SDK reads chunks as `Completion`, whose finish_reason is never null, while
        # OpenAI's chunks carry null until the last.
        _check_chunks(r, len(prompts) * n, lambda chunk: Completion.model_validate(
            {**chunk, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"}
                                  for c in chunk["choices"]]}))
        return
    data = r.json()
    Completion.model_validate(data)
    assert (data["object"], data["model"]) == ("text_completion", MODEL)
    assert [c["index"] for c in data["choices"]] == list(range(len(prompts) * n))
    for i, choice in enumerate(data["choices"]):
        assert choice["finish_reason"] in ("stop", "length"), choice
        assert (choice["logprobs"] is None) == (body.get("logprobs") is None), choice
        prompt = prompts[i // n]
        if body.get("echo") and isinstance(prompt, str):
            assert choice["text"].startswith(prompt), (prompt, choice["text"])
    _check_usage(data["usage"], limit, len(prompts) * (_number(body, "best_of") or n))


def _check_chat(body: dict, r: httpx.Response) -> None:
    n, limit = _number(body, "n") or 1, _number(body, "max_tokens", "max_completion_tokens")
    if body.get("stream"):
        _check_chunks(r, n, ChatCompletionChunk.model_validate)
        return
    data = r.json()
    ChatCompletion.model_validate(data)
    assert (data["object"], data["model"]) == ("chat.completion", MODEL)
    assert [c["index"] for c in data["choices"]] == list(range(n))
    tools = {t["function"]["name"] for t in body.get("tools") or []}
    for choice in data["choices"]:
        assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
        assert choice["message"]["role"] == "assistant"
        assert (choice["logprobs"] is None) == (not body.get("logprobs")), choice
        for call in choice["message"].get("tool_calls") or []:
            assert call["function"]["name"] in tools, call
            assert isinstance(json.loads(call["function"]["arguments"]), dict), call
    _check_usage(data["usage"], limit, n)


def _check_response(body: dict, r: httpx.Response) -> None:
    limit = _number(body, "max_output_tokens")
    if body.get("stream"):
        events = [json.loads(e) for e in _events(r)]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        for event in events:
            STREAM_EVENT.validate_python(event)
        assert events[-1]["type"] == "response.completed", events[-1]
        data = events[-1]["response"]
    else:
        data = r.json()
    Response.model_validate(data)
    assert (data["object"], data["model"]) == ("response", MODEL)
    assert data["status"] in ("completed", "incomplete"), data["status"]
    usage = data["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0, usage
    assert limit is None or usage["output_tokens"] <= limit, (usage, limit)


CHECK = {"/v1/completions": _check_completion, "/v1/chat/completions": _check_chat,
         "/v1/responses": _check_response}


def test_fuzzed_bodies_get_a_well_formed_answer(fuzz_server, tiny_chat_model):
    base, proc, log = fuzz_server
    rng, vocab = random.Random(66), _vocab(tiny_chat_model[0])
    tables = {path: specs(vocab, path) for path in ENDPOINTS}
    cases = [generate(rng, path, vocab, tables[path])
             for path in ENDPOINTS for _ in range(BODIES_PER_ENDPOINT)]
    cases += [case for path in ENDPOINTS for case in boundaries(path, tables[path])]
    random.Random(0).shuffle(cases)
    failures, statuses = [], Counter()
    with httpx.Client(timeout=60) as client:
        for number, case in enumerate(cases):
            r = _send(client, base, case)
            statuses[case.path, r.status_code // 100] += 1
            try:
                assert r.status_code < 500, "a 5xx"
                if r.status_code >= 400:
                    _check_error(case, r)
                else:
                    assert r.status_code == 200, r.status_code
                    assert isinstance(case.body, dict), f"accepted a {case.kind} body"
                    CHECK[case.path](case.body, r)
                if case.expect is not None:  # one field changed to a boundary value
                    assert r.status_code // 100 == int(case.expect[0]), f"expected {case.expect}"
            except (AssertionError, ValueError, KeyError, TypeError) as e:
                failures.append(f"#{number} {case.path} {case.kind} changed={case.changed} "
                                f"{case.content[:300]!r}\n  -> {r.status_code} "
                                f"{r.text[:400]}\n  {type(e).__name__}: {e}")
            health = client.get(f"{base}/health", timeout=10)
            assert health.status_code == 200, f"/health {health.status_code} after #{number}"
    assert not failures, f"{len(failures)} bad answers:\n" + "\n".join(failures[:12])
    # The mix reached both the engine and the validation on every endpoint.
    for path in ENDPOINTS:
        assert statuses[path, 2] >= 100 and statuses[path, 4] >= 100, statuses
    assert proc.poll() is None
    assert metric(base, "flashtree:num_requests_running") == 0
    assert metric(base, "flashtree:num_requests_waiting") == 0
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
