"""Graph-runner forwards of a real tiny target and drafter against the eager engine, shared by
the CPU-interpreter test and its CUDA-graph twin in tests/gpu/."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from flashtree import LLM, SamplingParams
from flashtree.attention.kinds import LayerKindsBackend
from flashtree.attention.triton import TritonBackend
from flashtree.engine.llm_engine import LLMEngine
from flashtree.graphs.runner import GraphRunner
from flashtree.graphs.schema import GraphDims, GraphMode
from flashtree.kv.cache import KVCache
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode
from flashtree.runner.graph_forward import GraphForward, graph_inputs, graph_mode
from flashtree.speculative.tree import ancestor_mask
from tests.tiny import save_reference_drafter, save_tiny_qwen3

PROMPTS = [[1, 2, 3, 4, 0, 1, 2, 5, 7], [3, 3, 1], [0, 4, 2, 2, 1, 3, 0, 1, 4, 2, 3, 1, 0, 9]]
TOKENS = {"decode": 1, "verify_chain": 5, "verify_tree": 6, "prefill": 8}
EAGER_MODES = {"decode": Mode.DECODE, "verify_chain": Mode.VERIFY, "verify_tree": Mode.VERIFY,
               "prefill": Mode.PREFILL}
BUCKETS = (2, 4)  # three requests run padded in the bucket of four


def make_engine(root: Path, device: str) -> LLMEngine:
    """A tiny target with a two-kind drafter (sliding causal + bidirectional), prompts
    prefilled: every request has context K/V in both caches. Eager (no CUDA graphs of its
    own), so that its forwards are the reference the graph runners here are checked against."""
    target = save_tiny_qwen3(root / "t", seed=5, vocab_size=11, initializer_range=0.3)
    drafter = save_reference_drafter(root / "d", target, seed=7, block_size=4,
                                     layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=3, initializer_range=0.3)
    llm = LLM(model=str(target), draft=str(drafter), spec="ddtree", device=device,
              dtype="float32", skip_tokenizer_init=True, page_size=4, enforce_eager=True)
    engine = llm.engine
    for p in PROMPTS:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    engine.step()
    assert all(s.num_computed == len(p) for s, p in zip(engine.scheduler.running, PROMPTS))
    return engine


def with_scratch_page(cache: KVCache) -> KVCache:
    """A copy of `cache` with one more page, whose first slot takes padded tokens' K/V."""
    k = cache.k
    copy = KVCache(k.shape[0], cache.num_pages + 1, cache.page_size, k.shape[2], k.shape[3],
                   k.dtype, k.device)
    copy.k[:, : k.shape[1]] = cache.k
    copy.v[:, : k.shape[1]] = cache.v
    return copy


def _dims(engine: LLMEngine) -> GraphDims:
    return GraphDims(max_pages=engine.pages.num_pages,
                     scratch_slot=engine.pages.num_pages * engine.pages.page_size)


def _items(engine: LLMEngine, mode: str, rng: random.Random) -> list[BatchItem]:
    items = []
    for seq in engine.scheduler.running:
        n = seq.num_computed
        if mode == "decode":
            items.append(BatchItem(seq.seq_id, n, [seq.output_ids[-1]]))
            continue
        size = rng.randint(2, TOKENS[mode])
        tokens = [rng.randrange(10) for _ in range(size)]
        if mode == "verify_chain":
            items.append(BatchItem(seq.seq_id, n, tokens, all_logits=True))
            continue
        if mode == "prefill":  # the first request's chunk does not end its prompt: unscored
            items.append(BatchItem(seq.seq_id, n, tokens, wants_logits=bool(items)))
            continue
        parents = [0] + [rng.randrange(v) for v in range(1, size)]
        depths = [0]
        for v in range(1, size):
            depths.append(depths[parents[v]] + 1)
        visible = ancestor_mask(torch.tensor([parents]))[0].to(engine.args.device)
        items.append(BatchItem(seq.seq_id, n, tokens, all_logits=True,
                               positions=[n + d for d in depths], visible=visible))
    for it in items:
        engine.pages.reserve(it.seq_id, it.start + len(it.tokens))
    return items


def _close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    got = got[: expected.shape[0]]
    err = (got - expected).abs().max().item()
    assert err < 1e-4, f"{what}: max error {err}"


def check_target(engine: LLMEngine, mode: str, rng: random.Random) -> None:
    device = engine.args.device
    items = _items(engine, mode, rng)
    graph_cache = with_scratch_page(engine.cache)
    runner_ = engine.runner
    expected, expected_features = runner_.forward(EAGER_MODES[mode], items)
    batch = ForwardBatch.build(EAGER_MODES[mode], items, engine.pages, device)
    assert graph_mode(batch) == GraphMode(mode)
    forward = GraphForward(runner_.model, TritonBackend(graph_cache), runner_.capture_layers)
    runner = GraphRunner(forward, _dims(engine), device, BUCKETS, poison=True)
    runner.capture(GraphMode(mode), TOKENS[mode])
    logits, features = runner.run(GraphMode(mode), len(items), batch.attn.max_query_len,
                                  graph_inputs(batch))
    _close(logits, expected, f"{mode} logits")
    _close(features, expected_features, f"{mode} features")


def check_draft(engine: LLMEngine) -> None:
    proposer, device = engine.proposer, engine.args.device
    block = proposer.block_size
    blocks = [(s.seq_id, s.num_computed, s.output_ids[-1], block)
              for s in engine.scheduler.running]
    for seq_id, n, _, b in blocks:
        engine.pages.reserve(seq_id, n + b)
    proposer.flush()  # held context rows, as a step does
    graph_cache = with_scratch_page(proposer.cache)
    expected = proposer.draft_logits(blocks)  # [sum(b - 1), vocab]
    items = [BatchItem(seq_id, n, [bonus] + [proposer.mask_token_id] * (b - 1), all_logits=True)
             for seq_id, n, bonus, b in blocks]
    batch = ForwardBatch.build(Mode.DRAFT, items, engine.pages, device)
    # A draft block's scored rows are its mask slots, not its bonus.
    assert batch.logit_rows.tolist() == [i * block + j for i in range(len(blocks))
                                         for j in range(1, block)]
    drafter = proposer.runner.model  # the drafter as the runner drives it
    backend = LayerKindsBackend(graph_cache, drafter.layer_kinds, TritonBackend)
    assert len(backend.by_kind) == 2, "make_engine's drafter has two mask kinds"
    runner = GraphRunner(GraphForward(drafter, backend), _dims(engine), device, BUCKETS,
                         poison=True)
    runner.capture(GraphMode.DRAFT, block)
    got, features = runner.run(GraphMode.DRAFT, len(blocks), block, graph_inputs(batch))
    assert features is None
    _close(got, expected, "draft logits")
