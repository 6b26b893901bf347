"""The server through the official `openai` client: chat and completions, streaming identical
to non-streaming at temperature 0, usage counts, seeds, the API key, metrics that move, the
request shapes newer clients send, and errors naming the field at fault in `param`."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, metric

CHAT = [{"role": "user", "content": "Tell me about the sea."}]


def _stream_text(stream) -> tuple[str, object, str]:
    parts, usage, reason = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = getattr(choice, "delta", None)
            parts.append(piece.content or "" if piece is not None else choice.text or "")
            reason = choice.finish_reason or reason
    return "".join(parts), usage, reason


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_stream_equals_non_stream_with_usage(client, tiny_chat_model):
    from transformers import AutoTokenizer

    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                          temperature=0)
    text, usage, reason = _stream_text(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert text == full.choices[0].message.content
    assert reason == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    tok = AutoTokenizer.from_pretrained(tiny_chat_model[0])
    prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert full.usage.prompt_tokens == len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_completion_stream_equals_non_stream_and_length(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    text, _, reason = _stream_text(client.completions.create(stream=True, **kw))
    assert text == full.choices[0].text and reason == "length"
    assert full.usage.completion_tokens == 20


def test_seeds_reproduce_and_differ(client):
    kw = dict(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    c = client.completions.create(seed=8, **kw).choices[0].text
    assert a == b and a != c


def test_stop_string(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]


def test_api_key_is_enforced(server):
    base = server[0]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(f"{base}/v1/completions", json=body, headers=wrong).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()
    ok = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{base}/v1/completions", json=body, headers=ok).status_code == 200


def test_metrics_counters_move(client, server):
    base = server[0]
    # The adaptive policy may decode this request plainly (budget 0), so the draft counters
    # need not move; every decode step counts in the budget counter (tests/server/
    # test_bench_serving.py checks the draft counters on a fixed-policy server).
    before = {n: metric(base, n) for n in (
        "flashtree:generation_tokens_total", "flashtree:e2e_request_latency_seconds_count",
        "flashtree:spec_decode_budget_request_steps_total")}
    client.completions.create(model=MODEL, prompt="Count", max_tokens=12, temperature=0,
                              extra_body={"ignore_eos": True})
    for name, value in before.items():
        assert metric(base, name) > value, name
    assert metric(base, "flashtree:kv_cache_usage_perc") == 0.0


def test_request_shapes_clients_send_today(client):
    """Text parts as message content (joined by newlines, as a string of them would be),
    max_completion_tokens for max_tokens, user and metadata: the same answer as the plain
    request shape."""
    plain = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about\nthe sea."}],
        max_tokens=6, temperature=0)
    parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Tell me about"}, {"type": "text", "text": "the sea."}]}],
        max_completion_tokens=6, temperature=0, user="u-1", metadata={"team": "a"},
        stream_options=None)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.completion_tokens == plain.usage.completion_tokens <= 6
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_errors_name_the_field_in_param(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert e.value.body["param"] == "messages.0.content"
    assert "'image_url' is not supported; allowed: strings and parts" in e.value.body["message"]


def test_prefix_cache_reported_in_usage_and_metrics(client, server):
    """A repeated long prompt finds its full pages cached: `usage.prompt_tokens_details.
    cached_tokens` says how many prompt tokens (streamed too), the prefix-cache counters move
    under flashtree's and vLLM's names, and the answer is the same."""
    base = server[0]
    before = {n: metric(base, n) for n in (
        "flashtree:prefix_cache_queries_total", "flashtree:prefix_cache_hits_total",
        "vllm:prefix_cache_hits_total")}
    kw = dict(model=MODEL, prompt="The sea is wide and deep. " * 12, max_tokens=8,
              temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(**kw)
    again = client.completions.create(**kw)
    _, streamed, _ = _stream_text(client.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw))
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0  # full pages only
    assert streamed.prompt_tokens_details.cached_tokens == cached
    assert again.choices[0].text == first.choices[0].text
    assert metric(base, "flashtree:prefix_cache_queries_total") - before[
        "flashtree:prefix_cache_queries_total"] >= 3 * again.usage.prompt_tokens
    for name in ("flashtree:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"):
        assert metric(base, name) - before[name] >= 2 * cached


def test_n_choices_are_the_seeded_single_requests(client):
    """n=3 seeded: choice i is the request seeded seed + i, non-streamed and streamed (the
    choices' events interleave, each carries its index); usage counts the prompt once."""
    kw = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0,
              extra_body={"ignore_eos": True})
    many = client.chat.completions.create(n=3, seed=40, **kw)
    singles = [client.chat.completions.create(seed=40 + i, **kw) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [
        s.choices[0].message.content for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    texts, usage = ["", "", ""], None
    for chunk in client.chat.completions.create(n=3, seed=40, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in many.choices]
    assert usage.completion_tokens == many.usage.completion_tokens


def test_spec_stats_report_each_choices_decode_steps(client):
    """`spec_stats` (flashtree's extension) adds each choice's decode steps and the tokens they
    committed: every token but the first (sampled at the end of the prompt), non-streamed and
    in a last streamed chunk."""
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, n=2,
              extra_body={"ignore_eos": True, "spec_stats": True})
    full = client.chat.completions.create(**kw)
    stats = full.model_extra["spec_decode"]
    assert [s["index"] for s in stats] == [0, 1]
    for s in stats:
        assert s["decode_tokens"] == 11 and 1 <= s["decode_steps"] <= 11
        assert s["tokens_per_step"] == s["decode_tokens"] / s["decode_steps"]
    streamed = [chunk.model_extra.get("spec_decode") for chunk in
                client.chat.completions.create(stream=True, **kw)]
    assert streamed[-1] == stats and not any(streamed[:-1])
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert "spec_decode" not in (plain.model_extra or {})
