"""Log-probabilities: plain decoding's equal the log-softmax of transformers' logits processed by
transformers' penalty and temperature processors (`tests/sampling_oracle.py`, the documented
semantics), and every speculative mode returns plain decoding's values for the same tokens,
greedy and seeded, with penalties (which see the accepted path) and a stop string that cuts a
multi-token commit."""

from __future__ import annotations

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.sampling_oracle import output_logprobs

PROMPT = [(53 * i) % 7000 + 300 for i in range(37)]  # spans pages and prefill chunks
TOP = 5


@pytest.fixture(scope="module")
def engines():
    """none / dflash / ddtree on the default model and its drafter, fixed policy, small
    prefill chunks so that prompt log-probs come from several chunks."""
    return {spec: LLM(model="default", spec=spec, spec_policy="fixed", device="cpu",
                      dtype="float32", max_model_len=160, page_size=16,
                      max_num_batched_tokens=16)
            for spec in ("none", "dflash", "ddtree")}


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]


def _assert_entry(entry, token: int, logp: torch.Tensor, atol: float) -> None:
    """entry: flashtree's dict for one token; logp: the oracle's log-probs [vocab]."""
    assert next(iter(entry)) == token  # the chosen token first
    chosen = logp[token]
    assert entry[token].logprob == pytest.approx(float(chosen), abs=atol)
    # The rank counts the more likely tokens; those within atol of the token may go either way.
    assert 1 + int((logp > chosen + atol).sum()) <= entry[token].rank
    assert entry[token].rank <= 1 + int((logp > chosen - atol).sum())
    top = logp.topk(TOP)
    for value, tid in zip(top.values.tolist(), top.indices.tolist()):
        assert entry[tid].logprob == pytest.approx(value, abs=atol)
    assert len(entry) in (TOP, TOP + 1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_plain_logprobs_equal_transformers(engines, hf_gguf_model, temperature):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=12, ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=TOP, repetition_penalty=1.2,
                            presence_penalty=0.4)
    out = engines["none"].generate([PROMPT], params)[0]
    tokens = out.outputs[0].token_ids
    logits = _hf_logits(hf_gguf_model, PROMPT + tokens)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    raw = torch.log_softmax(logits, -1)
    for j in range(1, len(PROMPT)):
        _assert_entry(out.prompt_logprobs[j], PROMPT[j], raw[j - 1], 2e-4)
    assert len(out.outputs[0].logprobs) == len(tokens)
    for j, token in enumerate(tokens):
        logp = output_logprobs(logits[len(PROMPT) + j - 1], params, PROMPT, tokens[:j])
        _assert_entry(out.outputs[0].logprobs[j], token, logp, 2e-4)
    expected = sum(e[t].logprob for e, t in zip(out.outputs[0].logprobs, tokens))
    assert out.outputs[0].cumulative_logprob == pytest.approx(expected)


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
@pytest.mark.parametrize("kw", [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
    dict(temperature=0.8, top_p=0.9, seed=11, presence_penalty=0.3),
], ids=["greedy", "greedy-penalties", "seeded"])
def test_speculative_logprobs_equal_plain(engines, spec, kw):
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3, **kw)
    plain = engines["none"].generate([PROMPT], params)[0].outputs[0]
    out = engines[spec].generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == plain.token_ids
    assert max(out.spec_accept_lengths) > 1  # some steps committed several tokens
    for got, want in zip(out.logprobs, plain.logprobs, strict=True):
        assert list(got) == list(want)
        for token, value in want.items():
            assert got[token].logprob == pytest.approx(value.logprob, abs=1e-4)
            assert got[token].rank == value.rank


def test_stop_string_cuts_logprobs_with_the_tokens(engines):
    probe = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    text = engines["none"].generate([PROMPT], probe)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop, logprobs=1)
    for spec in ("none", "ddtree"):
        out = engines[spec].generate([PROMPT], params)[0].outputs[0]
        assert out.finish_reason == "stop"
        assert len(out.logprobs) == len(out.token_ids) < 24


def test_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match=r"logprobs must be an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
