"""Paged KV cache: one pool of fixed-size pages shared by all sequences, a page table per
sequence, and the operations speculative decoding needs (write anywhere past the committed
length, then keep only a chosen subset of those tokens)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from flashtree.kv.prefix_cache import ROOT, Entry, PrefixCache
from flashtree.transfer import lists_to_device


class OutOfPages(RuntimeError):
    """Raised when an allocation needs more pages than the pool has free."""


class KVCache:
    """K and V storage for every layer. A token at logical index i of a sequence lives at flat
    slot `page_table[i // page_size] * page_size + i % page_size`.

    `v_head_dim=0` makes a key-only cache (`v` is None): MLA stores one latent "head" per token
    (normed compressed KV + roped shared key) and reads its values from the keys' first
    columns."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        v_head_dim: int | None = None,
    ) -> None:
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [layers, slots, kv_heads, hd]
        v_dim = head_dim if v_head_dim is None else v_head_dim
        self.v = (torch.zeros((*shape[:3], v_dim), dtype=dtype, device=device)
                  if v_dim else None)  # [layers, slots, kv_heads, v_hd]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies over all layers (K and V)."""
        per = self.k[:, 0].numel() * self.k.element_size()
        return per + (0 if self.v is None else self.v[:, 0].numel() * self.v.element_size())

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None) -> None:
        # slots: [n]; k: [n, kv_heads, head_dim]; v: [n, kv_heads, v_head_dim] (None: key-only)
        self.k[layer].index_copy_(0, slots, k)
        if self.v is not None:
            assert v is not None, "this cache stores values: write needs v"
            self.v[layer].index_copy_(0, slots, v)

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy K/V of every layer from `src_slots` to `dst_slots` (both [n])."""
        self.k[:, dst_slots] = self.k[:, src_slots]
        if self.v is not None:
            self.v[:, dst_slots] = self.v[:, src_slots]


class PageTables:
    """Owns the free-page list and each sequence's page table and KV length; with
    `prefix_caching`, also the cached pages (`kv/prefix_cache.py`) that tables share."""

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self.prefix = PrefixCache(page_size) if prefix_caching else None
        # Per sequence: its leading pages registered in the prefix cache, and the last one's
        # entry id (the parent of the next).
        self._chains: dict[int, tuple[int, int]] = {}
        # Called before a sequence lets go of cached pages: the drafter injects the context
        # rows it still holds back, which cached pages must have when another reads them.
        self.before_release: Callable[[], None] | None = None
        self._tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        # Each sequence's current allocation: a new number whenever it gets pages after
        # having none, so that slots noted earlier can be told stale once freed (`lease`).
        self._leases: dict[int, int] = {}
        self._next_lease = itertools.count()
        self._ended_leases: set[int] | None = None  # see watch_ended_leases

    @property
    def num_free(self) -> int:
        """Pages a reservation can take: free ones and cached ones no sequence holds."""
        return len(self._free) + (self.prefix.num_idle if self.prefix else 0)

    def pages_needed(self, seq_id: int, num_tokens: int) -> int:
        """Extra pages `seq_id` needs so that it can hold `num_tokens` tokens."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.page_size) - have)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make sure `seq_id` owns pages for logical indices [0, num_tokens)."""
        need = self.pages_needed(seq_id, num_tokens)
        if need > self.num_free:
            raise OutOfPages(f"sequence {seq_id} needs {need} pages, {self.num_free} free")
        if seq_id not in self._tables:
            self._tables[seq_id] = []
            self._leases[seq_id] = next(self._next_lease)
        table = self._tables[seq_id]
        self.lengths.setdefault(seq_id, 0)
        for _ in range(need):
            table.append(self._free.pop() if self._free else self.prefix.evict())

    @property
    def scratch_slot(self) -> int:
        """The first slot of the spare page past the pool (the caches allocate num_pages + 1):
        padded rows of captured graphs write there."""
        return self.num_pages * self.page_size

    def table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def slots(self, seq_id: int, start: int, count: int) -> list[int]:
        """Flat slots of logical indices [start, start + count) of `seq_id`."""
        table, p = self._tables[seq_id], self.page_size
        assert start + count <= len(table) * p, (
            f"seq {seq_id}: indices up to {start + count} exceed {len(table)} reserved pages"
        )
        return [table[i // p] * p + i % p for i in range(start, start + count)]

    def set_length(self, seq_id: int, length: int) -> None:
        """Record that logical indices [0, length) hold valid KV, freeing pages past them."""
        table = self._tables[seq_id]
        keep = -(-length // self.page_size)
        assert keep <= len(table), f"seq {seq_id}: length {length} beyond reserved pages"
        assert keep >= self._chains.get(seq_id, (0, ROOT))[0], "a cached page would be freed"
        while len(table) > keep:
            self._free.append(table.pop())
        self.lengths[seq_id] = length

    def lease(self, seq_id: int) -> int | None:
        """The number of `seq_id`'s current allocation (None while it holds no pages): slots
        read from its table stay its own exactly while this number stays the same."""
        return self._leases.get(seq_id)

    def leases(self, seq_ids: list[int]) -> tuple[int | None, ...]:
        """`lease` of each of `seq_ids`."""
        return tuple(map(self._leases.get, seq_ids))

    def watch_ended_leases(self) -> set[int]:
        """A set that gets every lease that ends from now on (its sequence freed); its one
        reader empties it when the leases in it no longer matter."""
        assert self._ended_leases is None, "ended leases have one reader"
        self._ended_leases = set()
        return self._ended_leases

    def free(self, seq_id: int) -> None:
        table = self._tables.pop(seq_id, [])
        cached, _ = self._chains.pop(seq_id, (0, ROOT))
        if cached and self.before_release is not None:
            self.before_release()
        # The deepest pages first: cached ones become idle before their parents, and so are
        # evicted first.
        for page in reversed(table):
            if self.prefix is not None and self.prefix.is_cached(page):
                self.prefix.release(page)
            else:
                self._free.append(page)
        self.lengths.pop(seq_id, None)
        lease = self._leases.pop(seq_id, None)
        if lease is not None and self._ended_leases is not None:
            self._ended_leases.add(lease)

    # ------------------------------------------------------------------ prefix caching
    def cached_prefix(self, tokens: list[int]) -> list[Entry]:
        """Cached pages a new sequence of `tokens` can start from: its longest cached run of
        full pages, leaving at least its last token to compute (its logits are wanted)."""
        if self.prefix is None:
            return []
        return self.prefix.match(tokens, (len(tokens) - 1) // self.page_size)

    def pages_needed_after(self, prefix: list[Entry], num_tokens: int) -> int:
        """Pages a new sequence of `num_tokens` starting from `prefix` takes from
        `num_free` (idle cached pages of its prefix leave the pool as it holds them)."""
        assert self.prefix is not None or not prefix
        idle = sum(self.prefix.is_idle(e.page) for e in prefix) if prefix else 0
        return -(-num_tokens // self.page_size) - len(prefix) + idle

    def attach_prefix(self, seq_id: int, prefix: list[Entry], num_tokens: int) -> int:
        """Start `seq_id` (holding no pages) from the cached `prefix`, counting the lookup of
        its first `num_tokens` tokens; returns the tokens it need not compute."""
        assert seq_id not in self._tables, f"sequence {seq_id} holds pages already"
        if self.prefix is None:
            return 0
        self.prefix.queried_tokens += num_tokens
        if not prefix:
            return 0
        for entry in prefix:
            self.prefix.acquire(entry.page)
        self._tables[seq_id] = [e.page for e in prefix]
        self._leases[seq_id] = next(self._next_lease)
        self._chains[seq_id] = (len(prefix), prefix[-1].id)
        cached = len(prefix) * self.page_size
        self.lengths[seq_id] = cached
        self.prefix.hit_tokens += cached
        return cached

    def cache_computed(self, seq_id: int, token_slice: Callable[[int, int], list[int]],
                       computed: int) -> None:
        """Register the full pages among `seq_id`'s first `computed` tokens that are not
        cached yet; `token_slice(start, end)` gives its tokens (read only for new pages)."""
        if self.prefix is None or seq_id not in self._tables:
            return
        done, parent = self._chains.get(seq_id, (0, ROOT))
        full = computed // self.page_size
        if full <= done:
            return
        p, table = self.page_size, self._tables[seq_id]
        tokens = token_slice(done * p, full * p)
        for i in range(full - done):
            entry = self.prefix.register(parent, tuple(tokens[i * p:(i + 1) * p]),
                                         table[done + i])
            parent = entry.id
        self._chains[seq_id] = (full, parent)

    def keep(self, cache: KVCache, kept: list[tuple[int, int, list[int]]]) -> None:
        """For each (seq_id, start, keep_offsets): keep the tokens at logical indices
        `start + keep_offsets[j]` (written speculatively past the committed length `start`) as
        indices `start + j`, and drop every other token past `start`. Offsets must be strictly
        increasing. One cache move for all requests (their slots are disjoint)."""
        src: list[int] = []
        dst: list[int] = []
        for seq_id, start, offsets in kept:
            assert all(a < b for a, b in zip(offsets, offsets[1:])), offsets
            slots = self.slots(seq_id, start, offsets[-1] + 1) if offsets else []
            for j, o in enumerate(offsets):
                if o != j:
                    src.append(slots[o])
                    dst.append(slots[j])
        if src:
            cache.move(*lists_to_device([src, dst], cache.k.device))
        for seq_id, start, offsets in kept:
            self.set_length(seq_id, start + len(offsets))
