"""Reference attention backend on torch SDPA: gathers each sequence's K/V from its pages into a
padded batch and applies an explicit boolean mask. Correct for any mask; used on CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashtree.attention.backend import AttentionBackend, AttentionMetadata


@dataclass
class _Plan:
    slot_mapping: torch.Tensor  # [num_tokens]
    kv_slots: torch.Tensor  # [num_seqs, max_kv] flat slots to gather (padding -> slot 0)
    mask: torch.Tensor  # [num_seqs, 1, max_q, max_kv] bool, True = attend
    # Scatter between packed rows and padded [num_seqs, max_q] rows; None when every sequence
    # has max_q new tokens and packing is a reshape.
    padded_index: torch.Tensor | None  # [num_tokens] row in the flattened padded layout


class SdpaBackend(AttentionBackend):
    plan: _Plan | None = None

    def begin_forward(self, meta: AttentionMetadata) -> None:
        assert not meta.padded, "SDPA plans on the host: it cannot run a padded graph layout"
        device = meta.slot_mapping.device
        page = self.cache.page_size
        n, max_q, max_kv = meta.num_seqs, meta.max_query_len, meta.max_kv_len
        q_lens = meta.query_lens.to(device)
        kv_lens = meta.kv_lens.to(device)

        kv_idx = torch.arange(max_kv, device=device)  # [max_kv]
        pages = meta.page_tables.to(device)[:, kv_idx // page]  # [n, max_kv]
        kv_slots = pages * page + kv_idx % page

        q_idx = torch.arange(max_q, device=device)  # [max_q]
        ctx_lens = kv_lens - q_lens  # [n]
        # Key b is visible to new token a of sequence i when b is in the context, or b is a new
        # token that the causal (or given) mask allows.
        new_pos = kv_idx[None, None, :] - ctx_lens[:, None, None]  # [n, 1, max_kv]
        if meta.new_token_mask is None:
            visible = new_pos <= q_idx[None, :, None]
            if not meta.causal:
                visible = visible | (new_pos >= 0)
        else:
            among_new = meta.new_token_mask.to(device)  # [n, max_q, max_q]
            gather_col = new_pos.clamp(0, max_q - 1).expand(n, max_q, max_kv)
            visible = (new_pos < 0) | torch.gather(among_new, 2, gather_col)
        visible = visible & (kv_idx[None, None, :] < kv_lens[:, None, None])
        if meta.sliding_window is not None:
            distance = (ctx_lens[:, None, None] + q_idx[None, :, None]) - kv_idx[None, None, :]
            visible = visible & (distance < meta.sliding_window)
            if not meta.causal:
                visible = visible & (-distance < meta.sliding_window)
        # Padded query rows would have no visible key (NaN softmax); let them see key 0.
        pad_row = q_idx[None, :] >= q_lens[:, None]  # [n, max_q]
        visible = visible | (pad_row[:, :, None] & (kv_idx == 0)[None, None, :])

        uniform = bool((q_lens == max_q).all())
        padded_index = None
        if not uniform:
            starts = meta.query_start.to(device)[:-1]
            row = torch.repeat_interleave(torch.arange(n, device=device), q_lens)
            offset = torch.arange(meta.slot_mapping.shape[0], device=device) - starts[row]
            padded_index = row * max_q + offset
        self.plan = _Plan(meta.slot_mapping, kv_slots, visible.unsqueeze(1), padded_index)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self._plan().slot_mapping

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        keys = self._gather(self.cache.k[layer])
        assert self.cache.v is not None, "forward needs a cache with values"
        return self._attend(q, keys, self._gather(self.cache.v[layer]), None)

    def attend_latent(self, layer: int, q: torch.Tensor, v_dim: int, scale: float
                      ) -> torch.Tensor:
        keys = self._gather(self.cache.k[layer])  # [n, max_kv, 1, d]
        return self._attend(q, keys, keys[..., :v_dim], scale)

    def _plan(self) -> _Plan:
        assert self.plan is not None, "begin_forward must run before the layers"
        return self.plan

    def _gather(self, pool: torch.Tensor) -> torch.Tensor:
        # pool: [slots, kv_heads, d] -> [num_seqs, max_kv, kv_heads, d]
        n, max_kv = self._plan().kv_slots.shape
        return pool.index_select(0, self._plan().kv_slots.view(-1)).view(n, max_kv,
                                                                          *pool.shape[1:])

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                scale: float | None) -> torch.Tensor:
        """q: [num_tokens, heads, d]; keys, values: [num_seqs, max_kv, kv_heads, d / v_d]
        -> [num_tokens, heads, v_d]."""
        plan = self._plan()
        n = plan.kv_slots.shape[0]
        max_q = plan.mask.shape[2]
        heads, hd = q.shape[1], q.shape[2]
        if plan.padded_index is None:
            q_pad = q.view(n, max_q, heads, hd)
        else:
            q_pad = q.new_zeros(n * max_q, heads, hd).index_copy_(0, plan.padded_index, q)
            q_pad = q_pad.view(n, max_q, heads, hd)
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),  # [n, heads, max_q, hd]
            keys.transpose(1, 2),  # [n, kv_heads, max_kv, hd]
            values.transpose(1, 2),  # [n, kv_heads, max_kv, v_hd]
            attn_mask=plan.mask,
            enable_gqa=True,
            scale=scale,
        )  # [n, heads, max_q, v_hd]
        out = out.transpose(1, 2).reshape(n * max_q, heads, values.shape[-1])
        return out if plan.padded_index is None else out[plan.padded_index]
