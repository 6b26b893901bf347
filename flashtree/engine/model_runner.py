"""Turns scheduled chunks into one target forward over the paged KV cache."""

from __future__ import annotations

import torch

from flashtree.attention.backend import AttentionMetadata
from flashtree.attention.sdpa import SdpaBackend
from flashtree.engine.scheduler import ScheduledChunk
from flashtree.kv.cache import KVCache, PageTables
from flashtree.models.llama import DecoderModel


class ModelRunner:
    def __init__(self, model: DecoderModel, cache: KVCache, pages: PageTables) -> None:
        self.model = model
        self.cache = cache
        self.pages = pages
        self.backend = SdpaBackend(cache)
        self.device = cache.k.device

    def build_metadata(self, chunks: list[ScheduledChunk]) -> AttentionMetadata:
        q_lens = [c.count for c in chunks]
        kv_lens = [c.start + c.count for c in chunks]
        slots: list[int] = []
        for c in chunks:
            slots += self.pages.slots(c.seq.seq_id, c.start, c.count)
        tables = [self.pages.table(c.seq.seq_id) for c in chunks]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [0]
        for q in q_lens:
            starts.append(starts[-1] + q)
        return AttentionMetadata(
            query_start=torch.tensor(starts, device=self.device),
            kv_lens=torch.tensor(kv_lens, device=self.device),
            slot_mapping=torch.tensor(slots, device=self.device),
            page_tables=torch.tensor(padded, device=self.device),
            max_query_len=max(q_lens),
            max_kv_len=max(kv_lens),
        )

    @torch.inference_mode()
    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Compute KV for every chunk; return float32 logits [num sampling chunks, vocab] for
        the last token of each chunk that ends its sequence."""
        ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for c in chunks:
            ids += c.seq.token_slice(c.start, c.start + c.count)
            positions += range(c.start, c.start + c.count)
            if c.samples:
                last_rows.append(len(ids) - 1)
        meta = self.build_metadata(chunks)
        self.backend.begin_forward(meta)
        hidden, _ = self.model(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            self.backend,
        )
        for c in chunks:
            c.seq.num_computed = c.start + c.count
            self.pages.set_length(c.seq.seq_id, c.seq.num_computed)
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])
