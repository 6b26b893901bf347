"""The KV pool's size (`runner/kv_pool.py`) against the caches the engine then allocates: within
a memory budget the pool holds as many pages of every cache together (the target's and the
drafter's, MLA's key-only latent cache included) as fit and not one more, never fewer than one
longest request's pages nor more than max_num_seqs of them; a page count given is taken."""

from __future__ import annotations

import pytest
import torch

from flashtree.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from flashtree.engine.llm_engine import LLMEngine
from flashtree.models.dflash import load_dflash_drafter
from flashtree.models.registry import load_model
from tests.tiny import save_reference_drafter, save_tiny_deepseek_v3, save_tiny_qwen3

PAGE, SEQS, MAX_LEN = 4, 4, 64
LONGEST = MAX_LEN // PAGE  # one longest request's pages


@pytest.fixture(scope="module", params=["qwen3+drafter", "deepseek_v3"])
def modules(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_pool")
    cpu, f32 = torch.device("cpu"), torch.float32
    if request.param == "deepseek_v3":
        return (*load_model(save_tiny_deepseek_v3(root / "t"), f32, cpu), None)
    target = save_tiny_qwen3(root / "t")
    drafter = save_reference_drafter(root / "d", target, block_size=4)
    return (*load_model(target, f32, cpu), load_dflash_drafter(drafter, f32, cpu))


def _engine(modules, num_pages: int | None = None, memory_bytes: int | None = None
            ) -> LLMEngine:
    model, cfg, drafter = modules
    spec = None if drafter is None else SpecConfig("ddtree", 4, 3)
    args = EngineConfig(torch.device("cpu"), torch.float32, SchedulerConfig(SEQS, MAX_LEN),
                        CacheConfig(PAGE, num_pages, memory_bytes), spec)
    return LLMEngine(model, cfg, None, args, drafter)


def _page_bytes(engine: LLMEngine) -> int:
    """One page of every cache the engine allocated, from the tensors themselves."""
    caches = [engine.cache] + ([engine.proposer.cache] if engine.proposer else [])
    assert all(c.num_pages == engine.pages.num_pages + 1 for c in caches)  # + scratch page
    return PAGE * sum(c.bytes_per_token for c in caches)


def test_pool_pages_fill_the_budget_within_its_bounds(modules):
    given = _engine(modules, num_pages=20)
    assert given.pages.num_pages == 20
    page = _page_bytes(given)
    for budget, pages in [(37 * page + page // 2, 37),  # binding: 37 fit, 38 do not
                          (3 * page, LONGEST),  # below one longest request: raised to it
                          (10 ** 9, SEQS * LONGEST)]:  # above what max_num_seqs need
        engine = _engine(modules, memory_bytes=budget)
        assert engine.pages.num_pages == pages, budget
        assert _page_bytes(engine) == page
