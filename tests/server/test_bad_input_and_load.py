"""Bad requests get a 4xx OpenAI-style error naming the problem, and the server keeps serving;
200 concurrent streams (a quarter disconnecting early) all finish correctly and free their KV."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(base, path, body=None, content=None, headers=None):
    return httpx.post(f"{base}{path}", json=body, content=content,
                      headers={**AUTH, **(headers or {})}, timeout=60)


def _still_serving(base):
    r = _post(base, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                        "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


BAD = [
    ("/v1/completions", b"{not json", 400, "not valid JSON (expecting property name enclosed in "
     "double quotes at character 1)"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                         "max_completion_tokens": 5}, 400, "disagree; give one of them"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_completion_tokens": 1000}, 400,
     "limit"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1000}, 400, "limit"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 400}, 400, "max_model_len"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 10**9]}, 400, "vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     400, "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 30000}, 413, "larger than"),
]


@pytest.mark.parametrize("path, body, status, words", BAD)
def test_bad_requests_get_a_clear_4xx(server, path, body, status, words):
    base = server[0]
    if isinstance(body, bytes):
        r = _post(base, path, content=body, headers={"content-type": "application/json"})
    else:
        r = _post(base, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words.lower() in error["message"].lower(), error
    _still_serving(base)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=8,
)
fields = st.sampled_from(["model", "prompt", "messages", "max_tokens", "temperature", "top_p",
                          "top_k", "seed", "stop", "stream", "n", "min_p", "stop_token_ids"])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(fields, json_values, max_size=6),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_bodies_never_500(server, body, path):
    body.setdefault("max_tokens", 2)
    r = httpx.post(f"{server[0]}{path}", content=json.dumps(body),
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


async def _stream(client, base, body, disconnect_after):
    text, chunks = "", 0
    async with client.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH,
                             timeout=300) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += "".join(c["text"] for c in chunk["choices"])
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                return None
    return text


def test_200_concurrent_streams_with_disconnects(server):
    base = server[0]
    rng = random.Random(0)
    prompts = ["Once upon a time", "The weather today", "def main():", "Dear friend,"]
    bodies = []
    for i in range(200):
        body = {"model": MODEL, "prompt": rng.choice(prompts), "stream": True,
                "max_tokens": rng.choice([4, 12, 24]), "ignore_eos": True,
                "temperature": rng.choice([0, 0.8]), "seed": i, "top_p": rng.choice([1, 0.9])}
        bodies.append(body)
    # What each request must return, computed one at a time without streaming.
    expected = [_post(base, "/v1/completions", {**b, "stream": False}).json()
                ["choices"][0]["text"] for b in bodies[:40]]
    disconnect = [2 if i % 4 == 3 else None for i in range(200)]

    async def run_all():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(limits=limits) as client:
            return await asyncio.gather(*[_stream(client, base, b, d)
                                          for b, d in zip(bodies, disconnect)])

    results = asyncio.run(run_all())
    for i, text in enumerate(results):
        if disconnect[i] is None:
            assert text is not None
            if i < 40:
                assert text == expected[i], i
    # Every request, finished or abandoned, has returned its KV pages.
    for _ in range(100):
        metrics = httpx.get(f"{base}/metrics").text
        if "flashtree:kv_cache_usage_perc 0.0" in metrics and \
                "flashtree:num_requests_running 0.0" in metrics:
            break
        asyncio.run(asyncio.sleep(0.2))
    assert "flashtree:kv_cache_usage_perc 0.0" in metrics
    _still_serving(base)
