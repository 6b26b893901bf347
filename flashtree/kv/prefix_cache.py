"""Prefix caching: full KV pages of computed tokens, found again by the tokens that lead to them.

A cached page is keyed by its parent page's entry and its own tokens, a trie over pages with
exact keys (no hash collisions): a request whose first tokens fill the same pages reuses them,
the target's KV and the drafter's context K/V at once (both caches share page tables). Pages
hold reference counts; a cached page no request holds waits in LRU order and is evicted only
when a page is needed. A page is never written after it is cached: requests write only past
their committed length, and cached pages lie before it."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass

ROOT = -1  # the parent of a request's first page


@dataclass(frozen=True)
class Entry:
    id: int
    page: int
    key: tuple[int, tuple[int, ...]]  # (parent entry id, the page's tokens)


class PrefixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._by_key: dict[tuple[int, tuple[int, ...]], Entry] = {}
        self._by_page: dict[int, Entry] = {}
        self._refs: dict[int, int] = {}  # cached page -> requests holding it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached pages no request holds
        self._ids = itertools.count()
        self.queried_tokens = 0  # prompt tokens looked up, and how many were found
        self.hit_tokens = 0
        self.evictions = 0

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def is_cached(self, page: int) -> bool:
        return page in self._by_page

    def is_idle(self, page: int) -> bool:
        return page in self._idle

    def match(self, tokens: list[int], max_pages: int) -> list[Entry]:
        """The cached entries of the longest run of `tokens`' leading full pages, at most
        `max_pages`."""
        found: list[Entry] = []
        parent, p = ROOT, self.page_size
        for i in range(min(max_pages, len(tokens) // p)):
            entry = self._by_key.get((parent, tuple(tokens[i * p:(i + 1) * p])))
            if entry is None:
                break
            found.append(entry)
            parent = entry.id
        return found

    def acquire(self, page: int) -> None:
        self._refs[page] = self._refs.get(page, 0) + 1
        self._idle.pop(page, None)

    def release(self, page: int) -> None:
        """One request lets go of a cached page; unheld, it waits for eviction."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            del self._refs[page]
            self._idle[page] = None

    def register(self, parent: int, tokens: tuple[int, ...], page: int) -> Entry:
        """Cache `page` (held by the caller) as the child of entry `parent` holding `tokens`;
        when that key is cached already (another request computed the same page), the
        existing entry, and `page` stays private."""
        key = (parent, tokens)
        entry = self._by_key.get(key)
        if entry is None:
            entry = Entry(next(self._ids), page, key)
            self._by_key[key] = entry
            self._by_page[page] = entry
            self.acquire(page)
        return entry

    def evict(self) -> int:
        """Forget the least recently released idle page and return it for reuse. Its cached
        descendants become unreachable; they are idle too (a request holding one holds its
        ancestors) and released before it, so they go first."""
        page, _ = self._idle.popitem(last=False)
        entry = self._by_page.pop(page)
        del self._by_key[entry.key]
        self.evictions += 1
        return page
