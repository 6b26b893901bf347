"""On a CUDA device: speculative decoding (dflash, ddtree) returns exactly plain decoding's greedy
tokens in float32, and every KV page comes back. Skips cleanly without CUDA.

Also runnable without pytest: `python tests/gpu/test_cuda_equivalence.py`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from flashtree import LLM, SamplingParams
from tests.tiny import TINY_PROMPTS, save_reference_drafter, save_tiny_qwen3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = TINY_PROMPTS


def check_spec_equals_plain_on_cuda(root: Path) -> dict[str, float]:
    target = save_tiny_qwen3(root / "t", seed=5, vocab_size=5, initializer_range=0.3)
    drafter = save_reference_drafter(root / "d", target, seed=7, block_size=8,
                                     initializer_range=0.3)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", skip_tokenizer_init=True, page_size=4)
    plain = LLM(model=str(target), **common).generate(PROMPTS, sp)
    expected = [o.outputs[0].token_ids for o in plain]
    means = {}
    for spec, kw in (("dflash", {}), ("ddtree", {"tree_budget": 24})):
        llm = LLM(model=str(target), draft=str(drafter), spec_policy="fixed",
                  spec=spec, **common, **kw)
        outs = llm.generate(PROMPTS, sp)
        assert [o.outputs[0].token_ids for o in outs] == expected, spec
        assert llm.engine.pages.num_free == llm.engine.pages.num_pages
        lengths = [x for o in outs for x in o.outputs[0].spec_accept_lengths]
        means[spec] = sum(lengths) / len(lengths)
    return means


def test_spec_equals_plain_on_cuda(tmp_path):
    means = check_spec_equals_plain_on_cuda(tmp_path)
    assert means["ddtree"] >= means["dflash"] > 1.0


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print("mean acceptance on cuda:", check_spec_equals_plain_on_cuda(Path(d)))
