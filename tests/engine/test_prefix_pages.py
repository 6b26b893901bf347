"""Page bookkeeping of prefix caching (`PageTables` with a `PrefixCache`) under random
admissions, speculative growth, releases and evictions, compared for equality at every step with
a brute-force model (`prefix_model.py`): the pages each match returns, which pages are cached
and idle, the free count, the pages each sequence holds and what each eviction takes; plus the
pool's own invariants (every page free, held or cached and idle, exactly once)."""

from __future__ import annotations

import random

import pytest

from flashtree.kv.cache import OutOfPages, PageTables
from tests.engine.prefix_model import PrefixModel

PAGE, NUM_PAGES = 4, 24


def _check(pages: PageTables) -> None:
    prefix = pages.prefix
    held: dict[int, int] = {}
    for table in pages._tables.values():
        for page in table:
            held[page] = held.get(page, 0) + 1
    free, idle = set(pages._free), set(prefix._idle)
    assert len(free) == len(pages._free) and not free & idle and not free & set(held)
    assert not idle & set(held)
    assert free | idle | set(held) == set(range(pages.num_pages))
    for page, n in held.items():
        assert n == 1 or prefix.is_cached(page), f"page {page} shared but not cached"
        if prefix.is_cached(page):
            assert prefix._refs[page] == n
    assert set(prefix._refs) == {p for p in held if prefix.is_cached(p)}
    assert pages.num_free == len(free) + len(idle)


def _same_as_model(pages: PageTables, model: PrefixModel, probes: list[list[int]]) -> None:
    for tokens in probes:
        got = [e.page for e in pages.cached_prefix(tokens)]
        assert got == [n.page for n in model.match(tokens)], f"match of {tokens}"
    for page in range(pages.num_pages):
        node = model.cached.get(page)
        assert pages.prefix.is_cached(page) == (node is not None), f"page {page} cached?"
        assert pages.prefix.is_idle(page) == (node is not None and node.holders == 0), page
    assert pages.num_free == model.available()
    assert pages.prefix.evictions == model.evictions
    assert {s: pages.table(s) for s in model.seqs} == {s: q.table for s, q in model.seqs.items()}


def _grow(pages: PageTables, model: PrefixModel, seq: int, tokens: list[int]) -> bool:
    """Reserve room for `tokens` (the committed ones plus a draft) in both; False when the pool
    is short, which the model must predict."""
    have = len(model.seqs[seq].table)
    need = -(-len(tokens) // PAGE) - have
    try:
        pages.reserve(seq, len(tokens))
    except OutOfPages:
        assert need > model.available()
        return False
    model.take(seq, pages.table(seq)[have:])
    return True


def _commit(pages: PageTables, model: PrefixModel, seq: int, tokens: list[int]) -> None:
    pages.set_length(seq, len(tokens))
    pages.cache_computed(seq, lambda a, b: tokens[a:b], len(tokens))
    model.set_tokens(seq, tokens)
    model.register(seq)


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_matches_a_brute_force_model(seed):
    rng = random.Random(seed)
    pages = PageTables(NUM_PAGES, PAGE, prefix_caching=True)
    model = PrefixModel(NUM_PAGES, PAGE)
    stems = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    for step in range(300):
        live = list(model.seqs)
        if live and rng.random() < 0.35:  # a sequence ends
            seq = rng.choice(live)
            pages.free(seq)
            model.end(seq)
        elif live and rng.random() < 0.5:  # a speculative step: draft, then keep a part
            seq = rng.choice(live)
            committed = model.seqs[seq].tokens
            drafted = committed + [rng.randrange(5) for _ in range(rng.randint(1, 6))]
            if _grow(pages, model, seq, drafted):
                _commit(pages, model, seq, drafted[:rng.randint(len(committed) + 1,
                                                                len(drafted))])
        else:  # a new sequence, from the cache as far as it goes
            tokens = rng.choice(stems)[: rng.randint(1, 12)] + [
                rng.randrange(5) for _ in range(rng.randint(0, 8))]
            prefix, expect = pages.cached_prefix(tokens), model.match(tokens)
            assert [e.page for e in prefix] == [n.page for n in expect], f"match of {tokens}"
            need = pages.pages_needed_after(prefix, len(tokens))
            assert need == model.pages_needed(expect, len(tokens))
            if need > pages.num_free:
                continue
            assert pages.attach_prefix(step, prefix, len(tokens)) == len(prefix) * PAGE
            model.admit(step, tokens, expect)
            assert _grow(pages, model, step, tokens)
            _commit(pages, model, step, tokens)
        _check(pages)
        probes = stems + [q.tokens + [0] for q in model.seqs.values()]
        _same_as_model(pages, model, probes)
    for seq in list(model.seqs):
        pages.free(seq)
        model.end(seq)
    _check(pages)
    _same_as_model(pages, model, stems)
    assert pages.num_free == pages.num_pages
    assert pages.prefix.evictions > 0 and pages.prefix.hit_tokens > 0


def test_a_match_without_eviction_finds_every_cached_page_and_evicts_deepest_first():
    pages = PageTables(8, PAGE, prefix_caching=True)
    tokens = list(range(13))  # three full pages and one token
    pages.reserve(1, 13)
    pages.set_length(1, 13)
    pages.cache_computed(1, lambda a, b: tokens[a:b], 13)
    table = list(pages.table(1))
    pages.free(1)
    assert [e.page for e in pages.cached_prefix(tokens)] == table[:3]
    assert [e.page for e in pages.cached_prefix(tokens[:12])] == table[:2]  # one token left
    pages.reserve(2, 6 * PAGE)  # the five free pages first, then the deepest cached page
    assert pages.table(2)[-1] == table[2] and pages.prefix.evictions == 1
    assert [e.page for e in pages.cached_prefix(tokens)] == table[:2]
