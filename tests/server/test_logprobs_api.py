"""Log-probabilities through the `openai` client: the plain server's equal the oracle's on
transformers' logits (`tests/sampling_oracle.py`); in every spec mode chat's `logprobs.content`
and completions' lists (with the echoed prompt) equal plain decoding's, greedy and seeded,
streamed as whole, and out-of-range requests are refused naming the field."""

from __future__ import annotations

import openai
import pytest
import torch

from flashtree import SamplingParams
from tests.sampling_oracle import output_logprobs
from tests.server.conftest import MODEL

CHAT = [{"role": "user", "content": "Name three colours of the sea."}]
SPECS = ("dflash", "ddtree")


def _chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                          logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True}, **kw)


def _assert_close(got: list[dict], want: list[dict]) -> None:
    """Chat log-prob entries: same tokens and alternatives, values within float tolerance."""
    assert [e["token"] for e in got] == [e["token"] for e in want]
    for g, w in zip(got, want):
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-4)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]]
        for gt, wt in zip(g["top_logprobs"], w["top_logprobs"]):
            assert gt["logprob"] == pytest.approx(wt["logprob"], abs=1e-4)


def test_plain_completion_logprobs_equal_transformers(spec_clients, tiny_chat_model):
    """The echoed prompt's values are the raw log-softmax of transformers' logits of the served
    checkpoint; each output token's are the oracle's (penalties, then temperature). top_k=1
    makes each draw the argmax of those values, which top-k leaves untruncated."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_chat_model[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    prompt, n, top = [(977 * i) % 40000 + 200 for i in range(12)], 8, 3
    # The tiny model's logits are nearly flat: a rewarding repetition penalty gives the seen
    # tokens enough mass that penalizing the wrong ones moves the values.
    kw = dict(temperature=0.7, top_k=1, repetition_penalty=0.5, presence_penalty=0.4,
              frequency_penalty=0.5)
    params = SamplingParams(**kw)
    ids, expected = list(prompt), []  # the oracle's tokens and [vocab] log-probs of each
    with torch.no_grad():
        for _ in range(n):
            logp = output_logprobs(hf(torch.tensor([ids])).logits[0, -1], params, prompt,
                                   ids[len(prompt):])
            best = logp.topk(top + 1).values
            # float32 logits of the two implementations agree to about 1e-4 (the tolerance):
            # the argmax and the top 3 are decided by wider gaps.
            assert best[0] - best[1] > 1e-3 and best[top - 1] - best[top] > 1e-3
            expected.append(logp)
            ids.append(int(logp.argmax()))
        raw = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)  # [len(ids), vocab]

    def text(token: int) -> str:
        return tok.decode([token], skip_special_tokens=False)

    got = spec_clients["none"].completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, logprobs=top, echo=True,
        extra_body={"ignore_eos": True, **kw}).choices[0].logprobs
    assert got.tokens == [text(t) for t in ids]
    assert got.token_logprobs[0] is None
    want = [float(raw[j - 1, ids[j]]) for j in range(1, len(prompt))]
    want += [float(logp[t]) for logp, t in zip(expected, ids[len(prompt):])]
    assert got.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for j, logp in enumerate(expected):
        values, tokens = logp.topk(top)
        alternatives = {text(t): v for t, v in zip(tokens.tolist(), values.tolist())}
        assert got.top_logprobs[len(prompt) + j] == pytest.approx(alternatives, abs=1e-4)


@pytest.mark.parametrize("kw", [dict(temperature=0), dict(temperature=0.9, seed=5)],
                         ids=["greedy", "seeded"])
def test_chat_logprobs_equal_plain_in_every_mode(spec_clients, kw):
    plain = _chat(spec_clients["none"], **kw).choices[0]
    entries = plain.model_dump()["logprobs"]["content"]
    assert len(entries) == 20
    for e in entries:
        assert len(e["top_logprobs"]) == 3 and e["logprob"] <= 0
        assert e["bytes"] == list(e["token"].encode())
        ranked = [t["logprob"] for t in e["top_logprobs"]]
        assert ranked == sorted(ranked, reverse=True) and e["logprob"] <= ranked[0] + 1e-6
        if kw["temperature"] == 0:  # the greedy token is the most likely one
            assert e["token"] == e["top_logprobs"][0]["token"]
    if "\ufffd" not in plain.message.content:
        assert "".join(e["token"] for e in entries) == plain.message.content
    for spec in SPECS:
        got = _chat(spec_clients[spec], **kw).choices[0]
        assert got.message.content == plain.message.content
        _assert_close(got.model_dump()["logprobs"]["content"], entries)


def test_streamed_chat_logprobs_equal_the_whole(spec_clients):
    for spec in ("none", "ddtree"):
        whole = _chat(spec_clients[spec], temperature=0).model_dump()
        streamed = []
        for chunk in _chat(spec_clients[spec], temperature=0, stream=True):
            for choice in chunk.choices:
                if choice.logprobs is not None:
                    streamed += choice.model_dump()["logprobs"]["content"]
        _assert_close(streamed, whole["choices"][0]["logprobs"]["content"])


def test_completion_logprobs_with_echo(spec_clients):
    prompt = "The sea is"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
              echo=True, extra_body={"ignore_eos": True})
    plain = spec_clients["none"].completions.create(**kw).choices[0]
    lp = plain.logprobs
    n = len(lp.tokens)
    assert n > 8 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert plain.text.startswith(prompt) and "".join(lp.tokens[: n - 8]) == prompt
    assert lp.text_offset[n - 8] == len(prompt)
    for spec in SPECS:
        got = spec_clients[spec].completions.create(**kw).choices[0]
        assert got.text == plain.text and got.logprobs.tokens == lp.tokens
        assert got.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:],
                                                                abs=1e-4)
    streamed = spec_clients["ddtree"].completions.create(stream=True, **kw)
    tokens, values = [], []
    for chunk in streamed:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert tokens == lp.tokens and values[0] is None
    assert values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)


@pytest.mark.parametrize("kw, param", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
], ids=["top-out-of-range", "top-without-logprobs"])
def test_bad_logprob_requests_name_the_field(spec_clients, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        spec_clients["ddtree"].chat.completions.create(model=MODEL, messages=CHAT,
                                                        max_tokens=2, **kw)
    assert e.value.body["param"] == param and "top_logprobs" in e.value.body["message"]


def test_completion_logprobs_out_of_range(spec_clients):
    with pytest.raises(openai.BadRequestError) as e:
        spec_clients["none"].completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                                logprobs=21)
    assert e.value.body["param"] == "logprobs" and "20" in e.value.body["message"]


def test_best_of_returns_the_most_likely_of_the_seeded_choices(spec_clients):
    kw = dict(model=MODEL, prompt="The sea is", max_tokens=6, temperature=1.0,
              extra_body={"ignore_eos": True})
    for spec in ("none", "ddtree"):
        client = spec_clients[spec]
        singles = []
        for i in range(4):  # choice i of a request seeded 5 is the request seeded 5 + i
            one = client.completions.create(seed=5 + i, logprobs=0, **kw).choices[0]
            singles.append((sum(one.logprobs.token_logprobs), one.text))
        best = client.completions.create(seed=5, n=2, best_of=4, **kw)
        expected = [text for _, text in sorted(singles, reverse=True)[:2]]
        assert [c.text for c in best.choices] == expected
        assert best.choices[0].logprobs is None  # not asked for
        assert best.usage.completion_tokens == 4 * 6  # every candidate counts
    with pytest.raises(openai.BadRequestError) as e:
        spec_clients["none"].completions.create(n=3, best_of=2, **kw)
    assert e.value.body["param"] == "best_of"
