"""A greedy speculative step queues the next step's draft blocks before its one device read
(`DFlashProposer.draft_ahead`); the next step uses them only when asked for exactly those
blocks. They must be the drafts a fresh draft would give, and they must be used."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams

PROMPTS = [[0, 1, 2], [3, 4], [1, 1, 0, 2, 4], [2]]


def run_counting(pair, spec: str, ahead: bool, device: str = "cpu") -> tuple[list, int]:
    """Greedy outputs (tokens, tokens per step) of PROMPTS, and how many steps took drafts
    queued ahead; `ahead=False` never queues any."""
    target, drafter = map(str, pair)
    llm = LLM(model=target, draft=drafter, spec=spec, spec_policy="fixed", device=device,
              skip_tokenizer_init=True, max_num_seqs=4)
    proposer = llm.engine.proposer
    used = []
    taken = proposer.drafted_ahead

    def counted(blocks, gather):
        logits = taken(blocks, gather)
        used.append(logits is not None)
        return logits
    proposer.drafted_ahead = counted
    if not ahead:
        proposer.draft_ahead = lambda *args, **kwargs: None
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    return [(o.outputs[0].token_ids, o.outputs[0].spec_accept_lengths) for o in outs], sum(used)


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
def test_drafts_queued_ahead_equal_fresh_drafts_and_are_used(small_pair, spec):
    queued, used = run_counting(small_pair, spec, ahead=True)
    fresh, unused = run_counting(small_pair, spec, ahead=False)
    assert queued == fresh  # same tokens, same tokens committed per step: the same drafts
    assert unused == 0
    steps = max(len(lengths) for _, lengths in queued)  # the batch's speculative steps
    assert used >= steps // 2, (used, steps)
