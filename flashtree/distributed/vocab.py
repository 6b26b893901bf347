"""Greedy argmax and top-k log-probabilities over a vocabulary split across TP ranks, without
gathering full logits: each rank reduces its slice, then a small all-gather of per-rank
winners decides. Ties go to the lowest token id, as torch.argmax does on one device."""

from __future__ import annotations

import torch

from flashtree.distributed import get_tp_size, tp_all_gather, tp_all_gather_last_dim


def vocab_argmax(local: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """local: [n, V_rank] logits of token ids vocab_start.. -> [n] global argmax."""
    if get_tp_size() == 1:
        return local.argmax(dim=-1)
    value, index = local.max(dim=-1)  # first maximum within the slice
    values, ids = tp_all_gather(value), tp_all_gather(index + vocab_start)  # [tp, n]
    best = values.argmax(dim=0)  # first rank holding the maximum = the lowest id
    return ids.gather(0, best[None]).squeeze(0)


def vocab_topk_logprobs(local: torch.Tensor, k: int, vocab_start: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """local: [..., V_rank] logits -> (log-probabilities [..., k] float32 under the full
    vocabulary's softmax, token ids [..., k]), sorted descending; as `spec.tree.topk_logprobs`, the
    top-k runs on the logits as given and only the winners and the normaliser are float32."""
    kk = min(k, local.shape[-1])
    value, index = local.topk(kk, dim=-1)
    lse = torch.logsumexp(local.float(), dim=-1)  # [...] this rank's slice
    if get_tp_size() == 1:
        return value.float() - lse[..., None], index
    lse = torch.logsumexp(tp_all_gather(lse), dim=0)
    value = value.float()
    pad = k - kk  # a slice narrower than k (the last one of an odd vocabulary)
    if pad:
        value = torch.cat([value, value.new_full((*value.shape[:-1], pad), -torch.inf)], -1)
        index = torch.cat([index, index.new_zeros((*index.shape[:-1], pad))], -1)
    values = tp_all_gather_last_dim(value)  # [..., tp * k]
    ids = tp_all_gather_last_dim(index + vocab_start)
    top, where = values.topk(k, dim=-1)
    return top - lse[..., None], ids.gather(-1, where)
