"""Drafts queued ahead on CUDA, where the draft replays a captured graph from device-side
inputs and the step's read waits for its own copy only: they and the candidates queued behind
them equal fresh ones (same tokens, same tokens per step) and are used. Skips without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.speculative.test_draft_ahead import assert_queued_drafts_used, run_counting

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("spec", ["dflash", "ddtree"])
def test_drafts_queued_ahead_equal_fresh_drafts_on_cuda(small_pair, spec):
    ahead, queued, used, took = run_counting(small_pair, spec, ahead=True, device="cuda")
    fresh, _, unused, _ = run_counting(small_pair, spec, ahead=False, device="cuda")
    assert ahead == fresh and unused == 0
    assert_queued_drafts_used(queued, used)
    assert took == used
