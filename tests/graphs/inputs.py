"""Random graph inputs and a model-like forward that reads every schema field, shared by the
CPU tests of the graph runner and their CUDA twin in tests/gpu/."""

from __future__ import annotations

import random

import torch

from flashtree.graphs.schema import GraphDims, GraphKey, GraphMode

DIMS = GraphDims(max_pages=6, scratch_slot=99)


def make_inputs(mode: GraphMode, q_lens: list[int], device: str, seed: int = 0
                ) -> dict[str, torch.Tensor]:
    """A real batch of len(q_lens) requests: what ForwardBatch would carry for `mode`."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n, n_tok, max_q = len(q_lens), sum(q_lens), max(q_lens)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    width = rng.randint(1, DIMS.max_pages)

    def ints(*shape: int, high: int = 50) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=gen).to(device)

    if mode == GraphMode.DECODE:
        scored = list(range(n))
    elif mode == GraphMode.DRAFT:  # every slot of each block but the bonus
        scored = [r for i in range(n) for r in range(starts[i] + 1, starts[i + 1])]
    elif mode == GraphMode.PREFILL:  # the last token of every chunk but the first
        scored = [s - 1 for s in starts[2:]]
    else:
        scored = list(range(n_tok))
    inputs = {
        "input_ids": ints(n_tok),
        "positions": ints(n_tok),
        "query_start": torch.tensor(starts, device=device),
        "kv_lens": torch.tensor(q_lens, device=device) + ints(n),
        "slot_mapping": torch.randperm(90, generator=gen)[:n_tok].to(device),
        "page_tables": ints(n, width, high=20),
        "logit_rows": torch.tensor(scored, dtype=torch.long, device=device),
    }
    if mode == GraphMode.VERIFY_TREE:
        inputs["new_token_mask"] = (torch.rand(n, max_q, max_q, generator=gen) < 0.5).to(device)
    return inputs


def model_like(_key: GraphKey, s: dict[str, torch.Tensor]) -> torch.Tensor:
    """One int64 per scored row that depends on every field the row's request reads: its token,
    position and slot, its request's KV length, page table and mask row. Padding (requests
    owning no tokens, zero page-table columns, unset mask columns) leaves real rows unchanged,
    so the value on padded static buffers equals the value on the real batch. Sizes come from
    the tensors, never from device data: capturable."""
    n_tok, width = s["input_ids"].shape[0], s["page_tables"].shape[1]
    tok = torch.arange(n_tok, device=s["input_ids"].device)  # [n_tok]
    qs = s["query_start"]
    req = torch.searchsorted(qs[1:], tok, right=True).clamp(max=qs.shape[0] - 2)  # [n_tok]
    within = tok - qs[req]  # index of the token in its request
    col = torch.arange(1, width + 1, device=tok.device)
    x = (s["input_ids"] + 7 * s["positions"] + 131 * s["slot_mapping"]
         + 1009 * s["kv_lens"][req] + 10007 * (s["page_tables"][req] * col).sum(-1))
    mask = s.get("new_token_mask")
    if mask is not None:
        bits = 2 ** torch.arange(mask.shape[2], device=tok.device)
        row = mask[req, within.clamp(0, mask.shape[1] - 1)]  # [n_tok, tokens]
        x = x + 1000003 * (row.long() * bits).sum(-1)
    return x[s["logit_rows"]]
