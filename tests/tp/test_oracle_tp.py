"""The acceptance oracle under tensor parallelism (gloo): every rank's drafter is rewritten
alike, over its own vocab slice, so TP=2 commits TP=1's tokens (the plain references) with the
same per-step acceptance, for DFlash and for DDTree with second choices."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams
from flashtree.bench.oracle import AcceptanceOracle, plain_references
from tests.tp.test_tp_cpu import PROMPTS, tiny  # noqa: F401 - the fixture


@pytest.mark.parametrize("spec,p,q", [("dflash", 0.7, 0.0), ("ddtree", 0.5, 0.8)])
def test_oracle_on_tp2_accepts_as_on_tp1(tiny, spec, p, q):  # noqa: F811
    target, drafter = tiny
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        llm = LLM(model=str(target), draft=str(drafter), spec=spec, spec_policy="fixed",
                  device="cpu", skip_tokenizer_init=True, tensor_parallel_size=tp)
        try:
            references = plain_references(llm, PROMPTS, params)
            AcceptanceOracle(llm, references, p, q, seed=3)
            outs = llm.generate(PROMPTS, params)
        finally:
            llm.shutdown()
        for prompt, out in zip(PROMPTS, outs):
            assert list(prompt) + list(out.outputs[0].token_ids) == references[tuple(prompt)]
        runs.append([o.outputs[0].spec_accept_lengths for o in outs])
    one, two = runs
    assert two == one
    assert max(n for lengths in one for n in lengths) > 1  # the oracle's drafts were accepted
