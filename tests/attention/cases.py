"""Random paged-attention cases shared by the CPU-interpreter and CUDA tests of the Triton
backend: several requests with ragged context lengths, pages interleaved across requests, and
per-request new tokens as decode steps, causal chains, random trees, prefill chunks or
bidirectional drafter blocks, compared with the SDPA reference backend."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from flashtree.attention.backend import AttentionMetadata
from flashtree.attention.sdpa import SdpaBackend
from flashtree.kv.cache import KVCache, PageTables
from flashtree.runner.forward_batch import BatchItem, ForwardBatch, Mode
from flashtree.speculative.tree import ancestor_mask

# kind -> (new tokens per request (lo, hi), causal, sliding window)
KINDS = {
    "decode": ((1, 1), True, None),
    "chain": ((2, 9), True, None),
    "tree": ((1, 12), True, None),
    "prefill": ((17, 40), True, None),
    "bidirectional": ((4, 8), False, None),
    "window": ((3, 9), True, 6),
    "bidirectional_window": ((4, 8), False, 5),
}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def random_tree(rng: random.Random, n: int) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a random topological tree (parent[i] < i)."""
    parents = [0] + [rng.randrange(i) for i in range(1, n)]
    return ancestor_mask(torch.tensor([parents]))[0]


@dataclass
class Case:
    meta: AttentionMetadata
    cache: KVCache  # one layer; context K/V written, garbage in unowned slots
    q: torch.Tensor  # [num_tokens, heads, hd]
    k: torch.Tensor  # [num_tokens, kv_heads, hd]
    v: torch.Tensor


def make_case(
    kind: str, q_per_kv: int, head_dim: int, dtype: torch.dtype, device: str, seed: int = 0,
    page_size: int = 4, num_seqs: int = 4, q_len: int | None = None, num_pages: int | None = None,
) -> Case:
    """A random batch of `kind` (KINDS); `q_len` fixes every request's new tokens, `num_pages`
    the pool size (default: just enough, plus 3 unowned pages)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    (lo, hi), causal, window = KINDS[kind]
    kv_heads = 2
    ctx_lens = [rng.choice([0, page_size, rng.randrange(1, 40)]) for _ in range(num_seqs)]
    q_lens = [q_len or rng.randint(lo, hi) for _ in range(num_seqs)]
    total = [c + q for c, q in zip(ctx_lens, q_lens)]
    needed = sum(-(-t // page_size) for t in total)
    num_pages = num_pages or needed + 3
    assert num_pages >= needed, f"{num_pages} pages for {needed} needed"
    pages = PageTables(num_pages, page_size)
    # Grow the requests a page at a time, round robin, so that their pages interleave.
    for length in range(page_size, max(total) + page_size, page_size):
        for i, t in enumerate(total):
            pages.reserve(i, min(length, t))
    items = []
    for i, (c, q) in enumerate(zip(ctx_lens, q_lens)):
        # In a tree batch one request is a chain (no mask), as in a mixed verify batch.
        visible = random_tree(rng, q) if kind == "tree" and i != 1 else None
        items.append(BatchItem(i, c, [0] * q, visible=visible))
    batch = ForwardBatch.build(Mode.VERIFY, items, pages, torch.device(device))
    # The kind's mask flags, as a drafter's LayerKindsBackend gives its layers.
    batch.attn = replace(batch.attn, causal=causal, sliding_window=window)
    cache = KVCache(1, num_pages, page_size, kv_heads, head_dim, dtype, torch.device(device))
    cache.k.normal_()
    cache.v.normal_()
    n_tok = sum(q_lens)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(n_tok, heads, head_dim, device=device).to(dtype)

    return Case(batch.attn, cache, rand(kv_heads * q_per_kv), rand(kv_heads), rand(kv_heads))


def decode_metadata(contexts: list[int], page_size: int, num_pages: int, device: str
                    ) -> AttentionMetadata:
    """One decode step's metadata: requests of `contexts` cached tokens and one new token
    each, their pages interleaved in a pool of `num_pages`."""
    pages = PageTables(num_pages, page_size)
    for length in range(page_size, max(contexts) + 1 + page_size, page_size):
        for i, c in enumerate(contexts):
            pages.reserve(i, min(length, c + 1))
    items = [BatchItem(i, c, [0]) for i, c in enumerate(contexts)]
    return ForwardBatch.build(Mode.DECODE, items, pages, torch.device(device)).attn


def sdpa_reference(case: Case) -> torch.Tensor:
    backend = SdpaBackend(case.cache)
    backend.begin_forward(case.meta)
    return backend.forward(0, case.q, case.k, case.v).float()


def assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    err = (got.float() - expected).abs().max().item()
    assert err <= TOLERANCE[got.dtype], f"{what} {got.dtype}: max error {err}"
    return err


def run_case(backend_cls, kind: str, q_per_kv: int, head_dim: int, dtype: torch.dtype,
             device: str, seed: int = 0, page_size: int = 4, q_len: int | None = None,
             **backend_kw) -> float:
    """Max abs difference between `backend_cls` and SDPA on one random case (`q_len` new
    tokens per request, or random); asserts it is within TOLERANCE[dtype]."""
    case = make_case(kind, q_per_kv, head_dim, dtype, device, seed, page_size, q_len=q_len)
    expected = sdpa_reference(case)
    backend = backend_cls(case.cache, **backend_kw)
    backend.begin_forward(case.meta)
    got = backend.forward(0, case.q, case.k, case.v)
    assert got.dtype == dtype, got.dtype
    return assert_close(got, expected, f"{kind} q_per_kv={q_per_kv} head_dim={head_dim}")


def run_latent_case(backend_cls, kind: str, heads: int, v_dim: int, tail: int,
                    dtype: torch.dtype, device: str, seed: int = 0, q_len: int | None = None,
                    **backend_kw) -> float:
    """MLA's absorbed attention (`forward_latent`: one cached latent head of v_dim + tail
    columns, values its first v_dim) by `backend_cls` against SDPA on one random case of
    `kind`; asserts the max abs difference is within TOLERANCE[dtype]."""
    base = make_case(kind, 1, 16, dtype, device, seed, q_len=q_len)
    slots = base.cache.k.shape[1]
    n_tok = base.q.shape[0]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_tok, heads, v_dim + tail, generator=gen).to(dtype).to(device)
    latent = torch.randn(n_tok, 1, v_dim + tail, generator=gen).to(dtype).to(device)
    context = torch.randn(slots, 1, v_dim + tail, generator=gen).to(dtype).to(device)
    scale = (v_dim + tail) ** -0.5

    def run(cls, **kw) -> torch.Tensor:
        cache = KVCache(1, slots // base.cache.page_size, base.cache.page_size, 1,
                        v_dim + tail, dtype, torch.device(device), v_head_dim=0)
        cache.k[0].copy_(context)  # the context's latents (and garbage in unowned slots)
        backend = cls(cache, **kw)
        backend.begin_forward(base.meta)
        return backend.forward_latent(0, q, latent, v_dim, scale)

    expected = run(SdpaBackend).float()
    got = run(backend_cls, **backend_kw)
    assert got.dtype == dtype, got.dtype
    return assert_close(got, expected, f"latent {kind} heads={heads} {v_dim}+{tail}")
