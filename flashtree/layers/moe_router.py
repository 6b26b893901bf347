"""A MoE router's selection in one Triton launch: from the router logits to (weights, expert
ids), as `Router.select` computes them eagerly (softmax or sigmoid scores, the selection-only
correction bias, group-limited selection, top-k, renormalization and scaling). Eagerly that is
about ten small torch ops per MoE layer; at decode sizes (1-128 tokens) their launches, not
their arithmetic, are the router's time. One program per token; the router GEMV stays in torch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashtree.layers.config import MoEConfig
from flashtree.pdl import pdl_args, wait_for_previous


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_t, scaling,
                  E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, N_GROUP: tl.constexpr,
                  G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr,
                  RENORM: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    real = e < num_experts
    logits = tl.load(logits_ptr + t * stride_t + e, mask=real, other=-float("inf"))
    if SOFTMAX:
        p = tl.exp(logits - tl.max(logits, 0))
        scores = p / tl.sum(p, 0)
    else:
        scores = tl.sigmoid(logits)
    choice = scores  # what selects the experts; `scores` weights them
    if HAS_BIAS:
        choice += tl.load(bias_ptr + e, mask=real, other=0.0)
    choice = tl.where(real, choice, -float("inf"))
    if N_GROUP > 1:  # keep the TOPK_GROUP best groups' experts, mask the others
        g = tl.arange(0, G_PAD)
        member = (e[None, :] // (num_experts // N_GROUP) == g[:, None]) & real[None, :]
        grouped = tl.where(member, choice[None, :], -float("inf"))  # [G_PAD, E_PAD]
        group_score = tl.max(grouped, 1)
        if GROUP_TOP2:  # plus the second best: mask the (first) best, take the max again
            first = tl.min(tl.where(grouped == group_score[:, None], e[None, :], E_PAD), 1)
            group_score += tl.max(tl.where(e[None, :] == first[:, None], -float("inf"),
                                           grouped), 1)
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(tl.where(keep, -float("inf"), group_score), 0)
            keep |= g == tl.min(tl.where((group_score == top) & ~keep & (g < N_GROUP), g,
                                         G_PAD), 0)
        kept = tl.max((member & keep[:, None]).to(tl.int32), 0) > 0
        choice = tl.where(kept, choice, -float("inf"))
    k = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int32)
    for i in tl.static_range(TOP_K):  # max and mask; the lowest index wins a tie
        pick = tl.min(tl.where(choice == tl.max(choice, 0), e, E_PAD), 0)
        weights = tl.where(k == i, tl.sum(tl.where(e == pick, scores, 0.0), 0), weights)
        ids = tl.where(k == i, pick, ids)
        choice = tl.where(e == pick, -float("inf"), choice)
    if RENORM:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    tl.store(weights_ptr + t * TOP_K + k, weights * scaling, mask=k < TOP_K)
    tl.store(ids_ptr + t * TOP_K + k, ids.to(tl.int64), mask=k < TOP_K)


def route(logits: torch.Tensor, bias: torch.Tensor | None, cfg: MoEConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] float32 (rows contiguous), bias [E] float32 or None -> (weights [n, top_k]
    float32, ids [n, top_k] int64), the chosen experts in descending selection score."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "float32 rows, contiguous"
    n, experts = logits.shape
    weights = torch.empty(n, cfg.top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, cfg.top_k, dtype=torch.int64, device=logits.device)
    if n:
        _route_kernel[(n,)](
            logits, logits if bias is None else bias, weights, ids, experts, logits.stride(0),
            float(cfg.routed_scaling_factor), E_PAD=triton.next_power_of_2(experts),
            TOP_K=cfg.top_k, K_PAD=triton.next_power_of_2(cfg.top_k),
            SOFTMAX=cfg.scoring_func == "softmax", HAS_BIAS=bias is not None,
            N_GROUP=cfg.n_group, G_PAD=triton.next_power_of_2(cfg.n_group),
            TOPK_GROUP=cfg.topk_group, GROUP_TOP2=cfg.topk_method == "noaux_tc",
            RENORM=cfg.norm_topk_prob, num_warps=4, **pdl_args(logits.device))
    return weights, ids
