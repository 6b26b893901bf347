"""The KV pool's size in pages: what `CacheConfig` asks for, or as many as `max_num_seqs`
requests of `max_model_len` tokens need within the memory budget, for the target's cache and
the drafter's together; the same on every TP rank."""

from __future__ import annotations

import torch

from flashtree.config import EngineConfig
from flashtree.distributed import tp_min
from flashtree.models.dflash import DFlashDraftModel
from flashtree.models.llama import DecoderModel

CPU_MEMORY_BYTES = 1 << 28  # the pool's budget on a CPU unless CacheConfig.memory_bytes says


def kv_bytes_per_token(model: DecoderModel, drafter: DFlashDraftModel | None,
                       dtype: torch.dtype) -> int:
    """Bytes one token's K/V takes on this rank: every target layer's and drafter layer's."""
    kv_heads, k_dim, v_dim = model.kv_cache_dims()  # this rank's share
    elements = model.cfg.num_layers * kv_heads * (k_dim + v_dim)
    if drafter is not None:
        d = drafter.layers[0].self_attn
        elements += 2 * len(drafter.layers) * d.num_kv_heads * d.head_dim
    return elements * dtype.itemsize


def kv_pool_pages(args: EngineConfig, model: DecoderModel, drafter: DFlashDraftModel | None
                  ) -> int:
    """The pages every cache of the engine holds (each also has a scratch page past them):
    `args.cache.num_pages`, or those of `max_num_seqs` longest requests, capped by the
    memory budget (`memory_bytes`; default: half the free GPU memory, CPU_MEMORY_BYTES on a
    CPU) and never below one longest request. Every TP rank must schedule alike: all take
    the smallest rank's count."""
    cache, device = args.cache, args.device
    pages = cache.num_pages
    if pages is None:
        budget = cache.memory_bytes
        if budget is None:
            budget = (torch.cuda.mem_get_info(device)[0] // 2 if device.type == "cuda"
                      else CPU_MEMORY_BYTES)
        per_page = kv_bytes_per_token(model, drafter, args.dtype) * cache.page_size
        longest = cache.pages_for(args.scheduler.max_model_len)
        wanted = args.scheduler.max_num_seqs * longest
        pages = max(longest, min(wanted, budget // per_page))
    return tp_min(pages, device)
