"""A greedy speculative step queues the next step's draft blocks before its one device read
(`DFlashProposer.draft_ahead`), and the candidates built from them; the next step uses them
only when asked for exactly those blocks. They must be the drafts and candidates a fresh draft
would give, and they must be used."""

from __future__ import annotations

import pytest

from flashtree import LLM, SamplingParams

PROMPTS = [[0, 1, 2], [3, 4], [1, 1, 0, 2, 4], [2]]


def run_counting(pair, spec: str, ahead: bool, device: str = "cpu"
                 ) -> tuple[list, int, int, int]:
    """Greedy outputs (tokens, tokens per step) of PROMPTS, how many steps queued drafts ahead,
    how many steps took them and how many took their queued candidates; `ahead=False` never
    queues any."""
    target, drafter = map(str, pair)
    llm = LLM(model=target, draft=drafter, spec=spec, spec_policy="fixed", device=device,
              skip_tokenizer_init=True, max_num_seqs=4)
    proposer = llm.engine.proposer
    used, queued = [], []
    taken, queue = proposer.drafted_ahead, proposer.draft_ahead

    def counted(blocks, gather):
        logits = taken(blocks, gather)
        used.append(logits is not None)
        return logits

    def queueing(*args, **kwargs):
        drafts = queue(*args, **kwargs) if ahead else None
        queued.append(drafts is not None)
        return drafts
    proposer.drafted_ahead, proposer.draft_ahead = counted, queueing
    step = llm.engine.speculative
    ahead_candidates, took = step._candidates_ahead, []

    def candidates_counted(*args):
        cands = ahead_candidates(*args)
        took.append(cands is not None)
        return cands
    step._candidates_ahead = candidates_counted
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    outputs = [(o.outputs[0].token_ids, o.outputs[0].spec_accept_lengths) for o in outs]
    return outputs, sum(queued), sum(used), sum(took)


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
def test_drafts_queued_ahead_equal_fresh_drafts_and_are_used(small_pair, spec):
    ahead, queued, used, took = run_counting(small_pair, spec, ahead=True)
    fresh, _, unused, _ = run_counting(small_pair, spec, ahead=False)
    assert ahead == fresh  # same tokens, same tokens committed per step: the same drafts
    assert unused == 0
    assert_queued_drafts_used(queued, used)
    assert took == used  # each step that took queued drafts took their candidates too


def assert_queued_drafts_used(queued: int, used: int) -> None:
    """Queued drafts are used unless the batch changed under them: a request finishing."""
    assert queued > 0 and used >= queued - len(PROMPTS), (queued, used)
