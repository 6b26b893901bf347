"""The exact law of plain sampling's first tokens, from transformers alone: the model's logits
through `tests/sampling_oracle.py` (transformers' logits processors), every prefix of a depth
in one batched forward; and a pooled chi-square."""

from __future__ import annotations

import torch

from tests.sampling_oracle import penalize, warpers

# The engine's float32 logits and transformers' differ by float32 rounding over a few layers
# (3e-7 in log-probability on the tiny target here); a top-k or top-p cut closer than this to a
# token could fall on either side of it in the engine, and the law would not be its to match.
CUT_MARGIN = 1e-5


def _check_cuts(scaled: torch.Tensor, params) -> None:
    """No two logits and no top-p cut within CUT_MARGIN of each other. There the two sides'
    rules agree: both keep every logit >= the k-th; transformers drops a token when the mass up
    to it in ascending order is <= 1 - top_p, flashtree when the mass before it in descending
    order reaches top_p, the same set unless tokens tie or one sits at the cut within rounding.
    scaled: [B, V] logits / T."""
    ordered = scaled.sort(dim=-1, descending=True).values  # [B, V]
    gap = (ordered[:, :-1] - ordered[:, 1:]).min()
    assert gap > CUT_MARGIN, f"two logits within {gap:.2e}: a cut between them is ambiguous"
    if params.top_p < 1.0:
        k = params.top_k if 0 < params.top_k < scaled.shape[-1] else scaled.shape[-1]
        probs = torch.softmax(ordered[:, :k], dim=-1)
        above = probs.cumsum(-1) - probs  # [B, k] the mass of the tokens before each
        gap = (above - params.top_p).abs().min()
        assert gap > CUT_MARGIN, f"a top-p cut within {gap:.2e} of a token"


def plain_sampling_law(hf_model, prompt: list[int], params, length: int
                       ) -> dict[tuple[int, ...], float]:
    """Law of the first `length` tokens plain sampling draws with `params`: the penalized
    logits through transformers' temperature, top-k and top-p warpers, in flashtree's (and
    vLLM's) order, then softmax; every prefix of a depth in one batched forward."""
    warp = warpers(params)
    law = {(): 1.0}
    for depth in range(length):
        prefixes = list(law)
        outputs = torch.tensor(prefixes, dtype=torch.long).view(len(prefixes), depth)
        history = torch.cat([torch.tensor(prompt).expand(len(prefixes), -1), outputs], 1)
        with torch.no_grad():
            logits = hf_model(history).logits[:, -1].double()  # [B, V]
        penalized = penalize(logits, history, outputs, params)
        _check_cuts(penalized / params.temperature, params)
        probs = torch.softmax(warp(history, penalized), dim=-1)
        law = {prefix + (tok,): law[prefix] * p
               for prefix, row in zip(prefixes, probs.tolist())
               for tok, p in enumerate(row) if p > 0}
    return law


def chi_square_p(counts: dict, law: dict, n: int) -> float:
    """Pearson's test of n draws against the law, cells of expected count under 5 pooled into
    one (the pooled joint is a coarser law of the same draws, so the test stays valid)."""
    from scipy.stats import chisquare

    assert set(counts) <= set(law), f"impossible outputs {set(counts) - set(law)}"
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell in sorted(law, key=lambda c: -law[c]):
        if law[cell] * n >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(law[cell] * n)
        else:
            pool_o += counts.get(cell, 0)
            pool_e += law[cell] * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    scale = n / sum(exp)  # the law sums to 1 up to rounding
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)
