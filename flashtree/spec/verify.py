"""Chain verification: walk the drafted tokens with the target's own decision."""

from __future__ import annotations

from collections.abc import Callable


def walk_chain(drafts: list[int], target_token: Callable[[int, list[int]], int]) -> list[int]:
    """Tokens committed by verifying `[bonus, *drafts]` in one forward.

    `target_token(j, committed_so_far)` is the target's decision at verify row j (greedy argmax or
    a sample drawn with the request's own generator, after penalties that see the tokens
    committed so far). Row j predicts the token after drafts[:j]; the walk follows the drafts
    while they equal the target's decision, so every committed token IS the target's decision
    and the result is distributed exactly as plain decoding (one draw per committed token).
    Returns 1..len(drafts)+1 tokens: the accepted drafts plus the target's next token."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        token = target_token(j, out)
        out.append(token)
        if token != draft:
            return out
    out.append(target_token(len(drafts), out))
    return out
