"""Log-probabilities returned with tokens, shaped like vLLM's: per token a dict from token id to
`Logprob`, the chosen token first, then the request's `logprobs` most likely alternatives.

An output token's values come from the distribution it was decided from before truncation: the
target's logits at that position after the request's penalties (counting every earlier output
token) and divided by its temperature (temperature 0: the penalized logits as they are); top-k,
top-p and min-p do not apply, so every alternative keeps a finite value. Speculative steps pass
the verify rows of the accepted path, which are those same logits, so the values equal plain
decoding's. Prompt tokens get the raw logits' log-softmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashtree.sampling import SamplingParams, penalize_rows
from flashtree.transfer import to_device


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 + the number of tokens more likely than this one


TokenLogprobs = dict[int, Logprob]


def output_logprobs(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int], tokens: list[int]) -> list[TokenLogprobs]:
    """Row j of logits [len(tokens), vocab] decided tokens[j] after output_ids + tokens[:j]."""
    assert params.logprobs is not None, "the request asked for no log-probs"
    assert logits.shape[0] == len(tokens), f"{logits.shape[0]} rows for {len(tokens)} tokens"
    vocab = logits.shape[-1]
    one_hot = torch.nn.functional.one_hot(to_device(tokens, logits.device), vocab)  # [k, V]
    earlier = one_hot.cumsum(0) - one_hot  # [k, V] counts of tokens[:j] in row j
    rows = penalize_rows(logits.float(), params, prompt_ids, output_ids, earlier)
    if not params.greedy:
        rows = rows / params.temperature
    return _collect(torch.log_softmax(rows, dim=-1), tokens, params.logprobs)


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], num_top: int
                    ) -> list[TokenLogprobs]:
    """Row j of logits [len(tokens), vocab] scored prompt token tokens[j]."""
    return _collect(torch.log_softmax(logits.float(), dim=-1), tokens, num_top)


def _collect(logp: torch.Tensor, tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """The chosen tokens' values and ranks and each row's top `num_top`, in one host read."""
    chosen_ids = to_device(tokens, logp.device)[:, None]  # [k, 1]
    chosen = logp.gather(1, chosen_ids)  # [k, 1]
    ranks = (logp > chosen).sum(-1, keepdim=True) + 1
    top_values, top_ids = logp.topk(num_top, dim=-1)  # [k, num_top]
    top_ranks = torch.arange(1, num_top + 1, device=logp.device).expand_as(top_ids)
    table = torch.cat([chosen.double(), ranks.double(), chosen_ids.double(), top_values.double(),
                       top_ranks.double(), top_ids.double()], 1).tolist()
    out = []
    for row in table:
        entry = {int(row[2]): Logprob(row[0], int(row[1]))}
        values, ranks_, ids = (row[3:3 + num_top], row[3 + num_top:3 + 2 * num_top],
                               row[3 + 2 * num_top:])
        for value, rank, token in zip(values, ranks_, ids):
            entry.setdefault(int(token), Logprob(value, int(rank)))
        out.append(entry)
    return out
