"""Vocab-parallel embedding and LM head: each TP rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashtree.distributed import (
    get_tp_rank,
    get_tp_size,
    tp_all_gather_last_dim,
    tp_all_reduce,
)
from flashtree.layers import dense


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_size()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp)
        self.vocab_start = get_tp_rank() * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, vocab_size)
        self.weight = nn.Parameter(
            torch.zeros(self.shard_size, hidden_size), requires_grad=False
        )
        self.packed = None  # replaces weight on the CPU (gguf.pack_gguf_int4): rows, matmul

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if loaded.shape != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(
                f"tensor {name} has shape {tuple(loaded.shape)}, "
                f"expected {(self.vocab_size, self.weight.shape[1])}"
            )
        rows = loaded[self.vocab_start : self.vocab_end]
        self.weight.data[: rows.shape[0]].copy_(rows)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [num_tokens] -> [num_tokens, hidden]
        if self.packed is not None:
            return self.packed.rows(token_ids)
        if get_tp_size() == 1:
            return F.embedding(token_ids, self.weight)
        local = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        out = F.embedding((token_ids - self.vocab_start) * local, self.weight)
        return tp_all_reduce(out * local.unsqueeze(-1))


class ParallelLMHead(VocabParallelEmbedding):
    """Scores hidden states against this rank's vocab slice; gathers the full vocabulary unless
    asked for the slice alone (ids vocab_start..vocab_end-1, for sharded argmax / top-k)."""

    def forward(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:  # type: ignore[override]
        # hidden: [n, hidden] -> logits [n, vocab] (or [n, vocab_end - vocab_start])
        local = dense(hidden, self.weight) if self.packed is None else self.packed.matmul(hidden)
        if not gather:
            return local[..., : self.vocab_end - self.vocab_start]
        return tp_all_gather_last_dim(local)[..., : self.vocab_size]

    def vocab_slice(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's slice of whole-vocabulary logits (what a captured graph returns)."""
        return logits[..., self.vocab_start : self.vocab_end]
