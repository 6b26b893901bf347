"""Token comparisons against a float reference that allow only near-ties to differ: where the
reference's top-2 logit gap is below `margin` (twice what rounding may move one logit), the
other token is as right, and a greedy continuation may part there and differ afterwards."""

from __future__ import annotations

import torch


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N]: each row's largest logit less its second largest."""
    top = logits.float().topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def assert_argmax_equal_outside_near_ties(mine: torch.Tensor, ref: torch.Tensor, margin,
                                          what: str) -> None:
    """mine, ref [N, V]: the same argmax at every row whose reference gap is `margin` or more
    (a float, or one per row)."""
    _assert_top_outside_near_ties(mine.argmax(-1), ref, margin, what)


def _assert_top_outside_near_ties(ids: torch.Tensor, ref: torch.Tensor, margin, what: str):
    gaps = top2_gaps(ref)
    differ = (ids != ref.argmax(-1)) & (gaps >= margin)
    assert not differ.any(), (
        f"{what}: argmax differs at rows {differ.nonzero().flatten().tolist()} whose reference "
        f"top-2 gaps {gaps[differ].tolist()} are above the margin")


def assert_greedy_equal_up_to_near_tie(mine: list[int], ref: list[int], ref_logits: torch.Tensor,
                                       margin, what: str) -> int | None:
    """Greedy tokens `mine` equal `ref` up to the first row where `ref_logits` (the reference's
    logits [len(ref), V] that chose each of `ref`, row by row) has a top-2 gap below `margin`
    (a float, or one per row); where they part, the two tokens are that row's top two. Returns
    where they part (None: equal throughout)."""
    assert len(mine) == len(ref) == ref_logits.shape[0], (len(mine), len(ref), ref_logits.shape)
    _assert_top_outside_near_ties(torch.tensor(ref), ref_logits, margin,
                                  f"{what}: the reference's tokens against its logits")
    split = next((j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
    if split is not None:
        gap = top2_gaps(ref_logits[split: split + 1]).item()
        bound = margin[split].item() if torch.is_tensor(margin) else margin
        top2 = set(ref_logits[split].topk(2).indices.tolist())
        assert gap < bound and {mine[split], ref[split]} == top2, (
            f"{what}: token {split} is {mine[split]}, the reference's {ref[split]}, at a top-2 "
            f"gap of {gap:.3g} (near-tie margin {bound:.3g}; the reference's top two: {top2})")
    return split
