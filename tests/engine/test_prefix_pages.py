"""Page bookkeeping of prefix caching (`PageTables` with a `PrefixCache`) under random
admissions, growth, releases and evictions, against a brute-force model: every page is free,
held by sequences, or cached and idle, exactly once; a cached page's holders are the tables
that list it; a match returns the longest run of full pages some request computed with the same
tokens; idle pages are evicted least recently released first; the pool is whole at the end."""

from __future__ import annotations

import random

import pytest

from flashtree.kv.cache import OutOfPages, PageTables

PAGE = 4


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


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_the_pool_consistent(seed):
    rng = random.Random(seed)
    pages = PageTables(24, PAGE, prefix_caching=True)
    stems = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]
    live: dict[int, list[int]] = {}  # seq -> its tokens (all computed)
    computed_runs: list[list[int]] = []  # every token run some sequence computed and cached
    for step in range(300):
        if live and rng.random() < 0.35:  # a sequence ends
            seq = rng.choice(list(live))
            pages.cache_computed(seq, lambda a, b, t=live[seq]: t[a:b], len(live[seq]))
            computed_runs.append(live.pop(seq))
            pages.free(seq)
        elif live and rng.random() < 0.5:  # a sequence grows
            seq = rng.choice(list(live))
            tokens = live[seq] + [rng.randrange(5) for _ in range(rng.randint(1, 6))]
            try:
                pages.reserve(seq, len(tokens))
            except OutOfPages:
                continue
            pages.set_length(seq, len(tokens))
            live[seq] = tokens
            pages.cache_computed(seq, lambda a, b, t=tokens: t[a:b], len(tokens))
        else:  # a new sequence, from the cache as far as it goes
            tokens = rng.choice(stems)[: rng.randint(1, 12)] + [
                rng.randrange(5) for _ in range(rng.randint(1, 8))]
            prefix = pages.cached_prefix(tokens)
            want = 0  # brute force: the longest full-page run of an earlier computed run
            for run in computed_runs + list(live.values()):
                n = 0
                while (n + 1) * PAGE <= min(len(run), len(tokens) - 1) and \
                        run[n * PAGE:(n + 1) * PAGE] == tokens[n * PAGE:(n + 1) * PAGE]:
                    n += 1
                want = max(want, n)
            assert len(prefix) <= want  # evicted pages are gone
            assert all(e.key[1] == tuple(tokens[i * PAGE:(i + 1) * PAGE])
                       for i, e in enumerate(prefix))
            if pages.pages_needed_after(prefix, len(tokens)) > pages.num_free:
                continue
            seq = step
            cached = pages.attach_prefix(seq, prefix, len(tokens))
            assert cached == len(prefix) * PAGE
            pages.reserve(seq, len(tokens))
            pages.set_length(seq, len(tokens))
            live[seq] = tokens
            pages.cache_computed(seq, lambda a, b, t=tokens: t[a:b], len(tokens))
        _check(pages)
    for seq in list(live):
        pages.free(seq)
    _check(pages)
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
