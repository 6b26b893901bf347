"""A brute-force model of prefix-cached page bookkeeping, written from the contract of
`PageTables` + `PrefixCache` rather than from their code: a trie of cached pages (a page's KV
depends on every token before it, so a page is found only through the cached pages before
it), reference counts as holder counts, and eviction by scanning every idle page for the
oldest release time (a sequence lets go of its pages deepest first)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Node:
    """One cached page (the root is a node without a page)."""

    page: int = -1
    parent: Node | None = None
    tokens: tuple[int, ...] = ()
    holders: int = 0
    released_at: int = 0  # clock value when its last holder let go (meaningful when idle)
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)


@dataclass
class Seq:
    tokens: list[int]
    table: list[int]
    registered: int  # leading full pages already offered to the cache
    tail: Node  # the cached node the next registered page hangs under


class PrefixModel:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.free = set(range(num_pages))
        self.root = Node()
        self.cached: dict[int, Node] = {}  # page -> its node
        self.seqs: dict[int, Seq] = {}
        self.clock = 0
        self.evictions = 0

    def idle(self) -> list[Node]:
        return [n for n in self.cached.values() if n.holders == 0]

    def available(self) -> int:
        return len(self.free) + len(self.idle())

    def match(self, tokens: list[int]) -> list[Node]:
        """The cached pages of `tokens`' leading full pages, leaving its last token out."""
        found, node, p = [], self.root, self.page_size
        for i in range((len(tokens) - 1) // p):
            node = node.children.get(tuple(tokens[i * p:(i + 1) * p]))
            if node is None:
                break
            found.append(node)
        return found

    def pages_needed(self, prefix: list[Node], num_tokens: int) -> int:
        idle_in_prefix = sum(n.holders == 0 for n in prefix)
        return -(-num_tokens // self.page_size) - len(prefix) + idle_in_prefix

    def admit(self, seq: int, tokens: list[int], prefix: list[Node]) -> None:
        for node in prefix:
            node.holders += 1
        tail = prefix[-1] if prefix else self.root
        self.seqs[seq] = Seq(list(tokens), [n.page for n in prefix], len(prefix), tail)

    def take(self, seq: int, new_pages: list[int]) -> None:
        """`seq` grows by `new_pages` (as the code chose them): free pages while any are left,
        then idle cached pages, oldest release first. Asserts the choice was allowed."""
        need = len(new_pages)
        if need <= len(self.free):
            assert set(new_pages) <= self.free, (new_pages, sorted(self.free))
        else:
            victims = sorted(self.idle(), key=lambda n: n.released_at)[: need - len(self.free)]
            expect = self.free | {n.page for n in victims}
            assert set(new_pages) == expect, (
                f"took {sorted(new_pages)}; free pages and the least recently released idle "
                f"pages are {sorted(expect)}")
            for node in victims:
                del node.parent.children[node.tokens]
                del self.cached[node.page]
            self.evictions += len(victims)
        self.free -= set(new_pages)
        self.seqs[seq].table += new_pages

    def set_tokens(self, seq: int, tokens: list[int]) -> None:
        """`seq` now holds `tokens`; its pages past them go back to the free pool (they are
        never cached: cached pages are full pages of tokens it keeps)."""
        s = self.seqs[seq]
        keep = -(-len(tokens) // self.page_size)
        self.free |= set(s.table[keep:])
        del s.table[keep:]
        s.tokens = list(tokens)

    def register(self, seq: int) -> None:
        """Offer `seq`'s full pages to the cache: a page whose tokens are cached already under
        the same parent stays private, and the cached one becomes the parent of the next."""
        s, p = self.seqs[seq], self.page_size
        for i in range(s.registered, len(s.tokens) // p):
            key = tuple(s.tokens[i * p:(i + 1) * p])
            node = s.tail.children.get(key)
            if node is None:
                node = Node(page=s.table[i], parent=s.tail, tokens=key, holders=1)
                s.tail.children[key] = node
                self.cached[node.page] = node
            s.tail = node
        s.registered = max(s.registered, len(s.tokens) // p)

    def end(self, seq: int) -> None:
        """`seq` lets go of its pages, deepest first: cached ones it held lose a holder (idle at
        zero, stamped with the release time), private ones become free."""
        for page in reversed(self.seqs.pop(seq).table):
            node = self.cached.get(page)
            if node is None:
                self.free.add(page)
                continue
            node.holders -= 1
            if node.holders == 0:
                self.clock += 1
                node.released_at = self.clock
